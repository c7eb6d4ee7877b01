"""Which precision a device runs natively, and what `auto` means for the target dtype and mixed precision.

bf16 halves the cache and, where the hardware has it, speeds up CPU matmuls (BENCHMARKS.md "Training", "SmolLM2
recipe"); where it does not, PyTorch emulates it and the same work runs several times slower than in float32.
So `auto` is bf16 only on a CUDA device that supports it or a CPU with AVX-512 BF16 or AMX, float32 elsewhere, and
an explicit bf16 on a CPU without them runs with a warning. One line says what was chosen and why, once per
process: the config's dtype line when the config has loaded without error (`say_pending`, called by
`load_config`), the mixed-precision line when training starts. `EAGLE3_NATIVE_BF16=0|1` overrides the CPU detection (the test suite pins it to 0, so every machine runs
the same float32 tests). `prepare_like_ddp` makes FSDP2 under mixed precision compute what DDP computes.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from types import MethodType
from typing import Any

import torch

log = logging.getLogger("eagle3")

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
EMULATED_SLOWDOWN = "bf16 is emulated on this CPU: expect it to run several times slower than float32"
_said: set[str] = set()
_pending: list[tuple[int, str]] = []


DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The dtype names of the config schema (target.dtype, cache fingerprints, export) -> torch dtypes."""


def _say_once(level: int, msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.log(level, msg)


def say_pending() -> None:
    """Log the choices made while validating a config (held back so a config error stays the only output)."""
    while _pending:
        _say_once(*_pending.pop(0))


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_native_bf16() -> tuple[bool, str]:
    """(has native bf16, why), for this machine's CPU."""
    forced = os.environ.get("EAGLE3_NATIVE_BF16")
    if forced in ("0", "1"):
        return forced == "1", f"EAGLE3_NATIVE_BF16={forced}"
    found = [f for f in CPU_BF16_FLAGS if f in cpu_flags()]
    if found:
        return True, f"the CPU has {'/'.join(found)}"
    return False, f"the CPU has no {' or '.join(CPU_BF16_FLAGS)}"


def native_bf16(device: str) -> tuple[bool, str]:
    """(bf16 runs natively on `device`, why). `cuda...`/`auto` ask CUDA when it is visible here; a CUDA device that
    is not visible from this process (a config checked on a login node) is taken to be a bf16 GPU."""
    if device.startswith("cuda") or device == "auto":
        if torch.cuda.is_available():
            ok = torch.cuda.is_bf16_supported()
            return ok, f"CUDA device {torch.cuda.get_device_name(0)} {'supports' if ok else 'lacks'} bf16"
        if device != "auto":
            return True, f"target.device={device} (not visible here; GPUs eagle3 targets run bf16)"
    return cpu_native_bf16()


def resolve_dtype(dtype: str, device: str, what: str = "target.dtype") -> str:
    """`auto` -> bfloat16 where native, else float32; an explicit bfloat16 where emulated gets a warning."""
    native, why = native_bf16(device)
    if dtype == "auto":
        chosen = "bfloat16" if native else "float32"
        _pending.append((logging.INFO, f"{what}=auto: {chosen} ({why})"))
        return chosen
    if dtype == "bfloat16" and not native and not device.startswith("cuda"):
        _pending.append((logging.WARNING, f"{what}=bfloat16 on {device}: {why}; {EMULATED_SLOWDOWN}. "
                                          f"{what}=auto (or float32) avoids it"))
    return dtype


def resolve_mixed_precision(mixed_precision: str, device: str) -> str:
    """train.mixed_precision `auto` -> `bf16` where native on the training device, else `no` (float32)."""
    if mixed_precision == "auto":
        native, why = native_bf16(device)
        chosen = "bf16" if native else "no"
        _say_once(logging.INFO, f"train.mixed_precision=auto: {'bf16' if native else 'no (float32)'} on {device} ({why})")
        return chosen
    if mixed_precision == "bf16" and device == "cpu":
        native, why = cpu_native_bf16()
        if not native:
            _say_once(logging.WARNING, f"train.mixed_precision=bf16 on the CPU: {why}; {EMULATED_SLOWDOWN}. "
                                       "train.mixed_precision=auto (or no) avoids it")
    return mixed_precision


def prepare_like_ddp(accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """`accelerator.prepare(model, optimizer)`, with FSDP2 computing under mixed precision what DDP computes.

    Under DDP, accelerate keeps the weights, their gradients and the all-reduce in float32 and runs the forward under
    autocast (bf16 matmuls; `Accelerator.prepare_model`). Under FSDP2 it does neither: `AcceleratorState` gives the
    plugin `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)` (`FullyShardedDataParallelPlugin
    .set_mixed_precision`) and `_prepare_fsdp2` never wraps the forward in autocast. The whole forward then ran in
    bf16, and each gradient was made, summed (over the TTT steps, the micro-batches of an accumulation group) and
    reduce-scattered over the ranks in bf16. Here FSDP2 keeps float32 weights, gradients and reductions (the default
    policy) and the forward runs under DDP's autocast: FSDP2's gradients are DDP's up to the order of float32 sums
    (tests/test_fsdp.py). The price: the weights are gathered in float32 (Kimi-K2.5's 0.9 B head: 3.6 GB a rank,
    plus autocast's bf16 copies) and all-gathered / reduce-scattered in float32, twice bf16's traffic."""
    fsdp2 = getattr(accelerator, "is_fsdp2", False) and accelerator.mixed_precision != "no"
    if fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        accelerator.state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy()
        _say_once(logging.INFO, f"FSDP2 with mixed precision {accelerator.mixed_precision}: float32 weights, "
                                "gradients and reductions, the forward under autocast, as DDP")
    model, optimizer = accelerator.prepare(model, optimizer)
    if fsdp2 and accelerator.native_amp:  # the wrapper `Accelerator.prepare_model` gives a DDP model
        from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

        autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
        model.forward = MethodType(convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
    return model, optimizer


# Exponent bits all ones (inf or NaN; e4m3fn has no inf and one NaN pattern per sign), per dtype, read as integers.
_NON_FINITE_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000), torch.float8_e4m3fn: (torch.uint8, 0x7F)}


def all_finite(x: torch.Tensor, block: int = 1 << 20) -> bool:
    """Whether every value of `x` is finite, read off the exponent bits in cache-sized blocks: `isfinite` on a CPU
    without native bf16 converts every value first, and took 0.5 s where this takes 0.02 s for one 4K-token batch of
    Kimi-width states (the check every hand-over of states makes: eagle3.targets.sglang_dump.check_states)."""
    kind = _NON_FINITE_BITS.get(x.dtype)
    if kind is None or x.device.type != "cpu":
        return bool(torch.isfinite(x).all())
    bits, mask = kind
    flat = x.detach().contiguous().view(bits).reshape(-1)
    return all(int((part & mask).amax()) != mask for part in flat.split(block)) if flat.numel() else True
