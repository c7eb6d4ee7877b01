"""SGLang server with eagle3's hidden-state capture: `sglang.launch_server` plus two small patches.

    EAGLE3_SGLANG_DUMP_DIR=/dev/shm/eagle3-sglang EAGLE3_SGLANG_LAYER_IDS='[2, 30, 58]' EAGLE3_SGLANG_FAMILY=deepseek \\
        python -m eagle3.targets.sglang_server --model-path /models/Kimi-K2.5 --tp-size 8 --trust-remote-code \\
        --disable-radix-cache --chunked-prefill-size -1 --disable-cuda-graph --skip-server-warmup --port 30000

Nobody types that: `python -m eagle3.targets.sglang serve --config ...` (or `SGLangTarget`, which launches it)
builds the command and the environment from the config. Every argument after the module name is SGLang's own.

What the patches do (tested against nothing here: no GPU in the task that wrote this; see
scripts/gpu_check_sglang.sh, which compares the result with an HF forward on a GPU box):

1. `ModelRunner.load_model` -> after loading, `model.set_eagle3_layers_to_capture(to_engine_ids(ids, "sglang",
   family))`, the same call SGLang makes when it serves an EAGLE-3 draft, so the model's own decoder loop appends
   `hidden_states + residual` (the residual stream *entering* layer i) for every i in its `layers_to_capture`.
   The patch then reads `layers_to_capture` back and refuses to start unless it equals eagle3's ids (id k =
   input of layer k): SGLang's spelling differs between Llama- and DeepSeek-family models and between versions,
   and a wrong layer is silent poison for the drafter.
2. `LogitsProcessor.forward` -> before SGLang prunes the batch to the last token of each prompt, it holds every
   prompt token's final hidden state (after the final norm: the models apply `norm` before calling it) and the
   list of aux states. For an extend (prefill) batch, tensor-parallel rank 0 copies them to the CPU once and
   writes one dump per prompt (eagle3.targets.sglang_dump). That is how the *final* state comes out too, which
   SGLang's `--enable-return-aux-hidden-states` cannot return next to the aux states. Decode, verify and
   draft batches pass through untouched.

Plain TP replicates hidden states on every rank after the all-reduce, so rank 0 alone writes. DP attention
(token-sharded states) is refused by the client's preflight.

The patches must also reach SGLang's scheduler processes, which start with the `spawn` method: spawn re-imports
the parent's `__main__` module by name (as `__mp_main__`), so the module-level `install()` below runs in every
TP worker before it unpickles its target.
"""

from __future__ import annotations

import inspect
import json
import os
import runpy
import sys
import traceback
from typing import Any

from eagle3.targets.sglang_dump import ENV_DUMP_DIR, ENV_FAMILY, ENV_LAYER_IDS, ensure_dump_dir, write_dump

_installed = False
_warned: set[str] = set()


def _say(msg: str) -> None:
    """Server-side log line; SGLang owns the logging config, so write straight to stderr, flushed."""
    print(f"[eagle3 capture pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _say(msg)


def _settings() -> tuple[str, list[int], str]:
    dump_dir = os.environ[ENV_DUMP_DIR]
    layer_ids = [int(i) for i in json.loads(os.environ[ENV_LAYER_IDS])]
    family = os.environ.get(ENV_FAMILY, "llama")
    if family not in ("llama", "deepseek"):
        raise ValueError(f"{ENV_FAMILY}={family!r}: expected 'llama' or 'deepseek'")
    return dump_dir, layer_ids, family


def capture_lists(model: Any) -> list[tuple[str, list[int]]]:
    """Every non-empty `layers_to_capture` in the model tree (Kimi's multimodal wrapper nests the LLM)."""
    found = []
    for name, module in model.named_modules():
        v = getattr(module, "layers_to_capture", None)
        if v:
            found.append((name or "<root>", sorted(int(i) for i in v)))
    return found


def enable_capture(model: Any, layer_ids: list[int], family: str) -> None:
    """Ask the model to capture the inputs of `layer_ids` (eagle3 convention) and check what it set."""
    from eagle3.layer_ids import to_engine_ids

    if not hasattr(model, "set_eagle3_layers_to_capture"):
        raise RuntimeError(
            f"{type(model).__name__} has no set_eagle3_layers_to_capture: SGLang cannot capture aux hidden states "
            f"for this architecture"
        )
    engine_ids = to_engine_ids(layer_ids, "sglang", family)  # type: ignore[arg-type]
    model.set_eagle3_layers_to_capture(engine_ids)
    found = capture_lists(model)
    if not found:
        raise RuntimeError(f"set_eagle3_layers_to_capture({engine_ids}) left no layers_to_capture in the model")
    bad = [(n, v) for n, v in found if v != sorted(layer_ids)]
    if bad:
        raise RuntimeError(
            f"SGLang spelled eagle3 ids {layer_ids} (input of decoder layer k) as {engine_ids} for a {family}-family "
            f"model and got layers_to_capture {bad}; expected {sorted(layer_ids)}. The layer-id translation in "
            f"eagle3.layer_ids.to_engine_ids does not match this SGLang version: refusing to capture wrong layers"
        )
    _say(f"capturing inputs of decoder layers {layer_ids} (SGLang spelling {engine_ids}, {family} family)")


def _is_prefill(meta: Any) -> bool:
    mode = getattr(meta, "forward_mode", None)
    if mode is None or not mode.is_extend():
        return False
    for other in ("is_target_verify", "is_draft_extend", "is_draft_extend_v2", "is_idle"):
        fn = getattr(mode, other, None)
        if fn is not None and fn():
            return False
    return True


def _segment_lengths(meta: Any) -> list[int] | None:
    lens = getattr(meta, "extend_seq_lens_cpu", None)
    if lens is None and getattr(meta, "extend_seq_lens", None) is not None:
        lens = meta.extend_seq_lens.tolist()
    return [int(n) for n in lens] if lens is not None else None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def capture_batch(input_ids: Any, hidden_states: Any, meta: Any, aux_hidden_states: Any, dump_dir: str,
                  layer_ids: list[int]) -> int:
    """Write one dump per prompt of a prefill batch; return how many were written (0 for other batches)."""
    import torch

    if not _is_prefill(meta) or _rank() != 0:
        return 0
    if not aux_hidden_states:
        _warn_once("noaux", "no aux hidden states reached the logits processor: capture is not enabled; "
                            "nothing is written")
        return 0
    if len(aux_hidden_states) != len(layer_ids):
        _warn_once("naux", f"{len(aux_hidden_states)} aux states for {len(layer_ids)} layer ids; nothing is written")
        return 0
    lens = _segment_lengths(meta)
    if lens is None:
        _warn_once("nolens", "the batch metadata has no extend_seq_lens; nothing is written")
        return 0
    pad = int(getattr(meta, "padded_static_len", -1) or -1)
    aux = torch.cat(list(aux_hidden_states), dim=-1)
    # One device->host copy for the whole batch, then cheap CPU slicing.
    ids_c, aux_c, fin_c = input_ids.to("cpu"), aux.to("cpu"), hidden_states.to("cpu")
    start = 0
    for i, n in enumerate(lens):
        s = i * pad if pad > 0 else start
        write_dump(dump_dir, ids_c[s:s + n], aux_c[s:s + n], fin_c[s:s + n], layer_ids)
        start += n
    return len(lens)


def install() -> None:
    """Patch SGLang in this process (idempotent). Needs sglang; reads the EAGLE3_SGLANG_* environment."""
    global _installed
    if _installed:
        return
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.model_executor.model_runner import ModelRunner

    dump_dir, layer_ids, family = _settings()
    ensure_dump_dir(dump_dir)

    orig_load = ModelRunner.load_model

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig_load(self, *args, **kwargs)
        if getattr(self, "is_draft_worker", False):
            return out
        enable_capture(self.model, layer_ids, family)
        return out

    orig_forward = LogitsProcessor.forward
    sig = inspect.signature(orig_forward)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind(self, *args, **kwargs).arguments
            capture_batch(bound["input_ids"], bound["hidden_states"], bound["logits_metadata"],
                          bound.get("aux_hidden_states"), dump_dir, layer_ids)
        except Exception:  # a failed capture must not kill serving; the client reports the missing dump
            _warn_once("exc", "capture failed (the client will report the missing dump):\n" + traceback.format_exc())
        return orig_forward(self, *args, **kwargs)

    ModelRunner.load_model = load_model
    LogitsProcessor.forward = forward
    _installed = True
    _say(f"installed: dumps -> {dump_dir}, layer ids {layer_ids} ({family})")


def main(argv: list[str] | None = None) -> None:
    """Run `python -m sglang.launch_server` in this (patched) process with SGLang's own arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    install()
    sys.argv = ["sglang.launch_server", *args]
    # alter_sys=False keeps *this* module as sys.modules["__main__"], so spawned workers re-import it (and patch).
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


# Runs in the launching process and, through spawn's re-import of __main__, in every SGLang worker process.
if __name__ in ("__main__", "__mp_main__") and os.environ.get(ENV_DUMP_DIR):
    install()

if __name__ == "__main__":
    main()
