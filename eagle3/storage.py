"""How the cache stores hidden states: exactly, or as fp8 with one float32 scale per token per state.

    extract:
      storage: fp8          # exact (default) | fp8 | fp8-aux

- `exact`: the target's own bits (bf16/fp16 as uint16 patterns, float32 as float32): lossless.
- `fp8`: every state (low/mid/high aux and the final) as float8_e4m3fn with scale = amax / 448 per token and
  state, so a token costs 4H + 16 bytes of states instead of 8H (bf16): ~0.5x for any H >= 576.
- `fp8-aux`: the three aux states in fp8, the final state (the teacher's input) exact: 5H + 12 bytes.

Scales are float32, not bf16: 16 bytes per token (0.06% of Kimi's 28 KB) buys scales that are exactly amax / 448,
so the largest element of every token maps to +-448 and no quantised value can land above the fp8 range after a
second rounding of its scale. e4m3 (3 mantissa bits) rather than e5m2: a per-token scale already covers the
range, and the extra mantissa bit halves the error (BENCHMARKS.md "fp8 cache").

Dequantisation is left to the consumer, on the device the states are used on (eagle3.trainer.to_device): the
host never holds a second, dequantised copy of a shard, and a GPU reads half the bytes over PCIe.
"""

from __future__ import annotations

from typing import get_args

import torch

from eagle3.config import Storage

STORAGES: tuple[Storage, ...] = get_args(Storage)
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_BYTES = 4


def fp8_states(storage: str) -> tuple[bool, bool]:
    """(aux stored in fp8, final stored in fp8) for a storage name."""
    if storage not in STORAGES:
        raise ValueError(f"unknown cache storage {storage!r}; expected one of {', '.join(STORAGES)}")
    return storage != "exact", storage == "fp8"


QUANTIZE_ELEMENTS = 1 << 24
"""States quantised at once (64 MB of float32 temporaries): a 32K-token Kimi sample's aux states are 2.8 GB in
float32, and each whole-tensor step would hold another copy of that."""


def quantize(x: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, parts*H] states -> ([T, parts*H] float8_e4m3fn, [T, parts] float32 scales), one scale per token and
    state, in blocks of tokens (QUANTIZE_ELEMENTS; each token's result is the same whatever the blocks). An all-zero
    state gets scale 0 (it dequantises to exact zeros). Non-finite states are refused: their scale would be inf and
    every other element of the token would become 0 or NaN."""
    t, width = x.shape
    q = torch.empty(t, width, dtype=FP8, device=x.device)
    scale = torch.empty(t, parts, dtype=torch.float32, device=x.device)
    rows = max(1, QUANTIZE_ELEMENTS // max(width, 1))
    for r0 in range(0, t, rows):
        v = x[r0 : r0 + rows].detach().float().reshape(-1, parts, width // parts)
        if not bool(torch.isfinite(v).all()):
            raise ValueError("fp8 storage: the states contain NaN/inf (such samples are skipped before writing)")
        s = v.abs().amax(-1) / FP8_MAX
        q[r0 : r0 + rows] = (v / torch.where(s > 0, s, 1.0)[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8).flatten(1)
        scale[r0 : r0 + rows] = s
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., parts*H] fp8 with [..., parts] scales -> [..., parts*H] in `dtype` (multiplied in float32, one
    rounding to `dtype`)."""
    parts = scale.shape[-1]
    v = q.float().unflatten(-1, (parts, -1)) * scale.float()[..., None]
    return v.flatten(-2).to(dtype)


def dense(states: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An item or batch with its fp8 states (those with an `<name>_scale` entry) dequantised to `dtype` and the
    scales dropped; exact states pass through untouched (no copy)."""
    out = {k: v for k, v in states.items() if not k.endswith("_scale")}
    for name in ("aux", "final"):
        scale = states.get(f"{name}_scale")
        if scale is not None:
            out[name] = dequantize(states[name], scale, dtype)
    return out


def state_bytes_per_token(hidden_size: int, item_size: int, storage: str) -> int:
    """Bytes the four states of one token take in `storage` (`item_size`: the target dtype's element size)."""
    aux8, final8 = fp8_states(storage)
    aux = 3 * hidden_size + 3 * SCALE_BYTES if aux8 else 3 * hidden_size * item_size
    final = hidden_size + SCALE_BYTES if final8 else hidden_size * item_size
    return aux + final
