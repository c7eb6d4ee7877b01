"""The dump-folder protocol between eagle3's SGLang capture patch (server side) and `SGLangTarget` (client side).

Why files and not JSON: a token carries (3 aux + 1 final) x hidden bf16 values (Kimi-K2.5's size: docs/kimi-k2.5.md
"The target in numbers"), and as JSON floats many times that in text to print, send and parse per token. Instead the patched server writes one safetensors
file per prompt into a RAM-backed folder (`target.sglang.dump_dir`, default /dev/shm/eagle3-sglang) and the
client reads it as tensors and deletes it. Both sides import only this module (no sglang import here), so the
CPU tests can play the server's part with the very same writer.

A file is named by a hash of the prompt's token ids, not by a request id: the capture point inside SGLang (the
logits processor) sees the batch's token ids but no request ids, and the client knows the ids it sent. A
prefill that did not cover the whole prompt (a radix-cache hit, a chunked prefill) hashes to a different name,
so an incomplete capture can never be mistaken for a complete one: the client finds no file and says why.

    <dump_dir>/<sha256 of int64 token ids>.safetensors
        aux       [T, 3H]  residual streams entering the three aux layers (eagle3 convention), concatenated
        final     [T, H]   last layer output after the final norm
        input_ids [T]      int64, checked against the prompt
        metadata: format, layer_ids (eagle3 convention), convention
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.layer_ids import LAYER_ID_CONVENTION
from eagle3.targets.base import Captured

DUMP_FORMAT = "eagle3-sglang-dump/1"
ENV_DUMP_DIR = "EAGLE3_SGLANG_DUMP_DIR"
"""Set in the server's environment: where the capture patch writes (inherited by SGLang's TP worker processes)."""
ENV_LAYER_IDS = "EAGLE3_SGLANG_LAYER_IDS"
"""JSON list of the aux layer ids in eagle3's convention (input of decoder layer k)."""
ENV_FAMILY = "EAGLE3_SGLANG_FAMILY"
"""`llama` or `deepseek`: how SGLang spells layer ids for this target (eagle3.layer_ids.to_engine_ids)."""
MARKER = ".eagle3-sglang-dump"
"""Present in every dump folder eagle3 created; cleanup refuses folders without it that hold other files."""

_DUMP_RE = re.compile(r"^[0-9a-f]{64}\.safetensors$")
_TMP_RE = re.compile(r"^\.[0-9a-f]{64}\.tmp-\d+$")


class DumpError(RuntimeError):
    """A dump is missing, truncated or does not belong to the prompt it was read for."""


def sequence_key(token_ids: list[int] | np.ndarray | torch.Tensor) -> str:
    """sha256 of the ids as little-endian int64: the same bytes on the server (a GPU tensor) and the client."""
    if isinstance(token_ids, torch.Tensor):
        arr = token_ids.detach().to(device="cpu", dtype=torch.int64).numpy()
    else:
        arr = np.asarray(token_ids, dtype=np.int64)
    return hashlib.sha256(arr.astype("<i8", copy=False).tobytes()).hexdigest()


def dump_path(dump_dir: str | Path, key: str) -> Path:
    return Path(dump_dir) / f"{key}.safetensors"


def ensure_dump_dir(dump_dir: str | Path) -> Path:
    """Create the folder (and its marker) if needed; the program creates its folders, not the user."""
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / MARKER).touch()
    return d


def write_dump(dump_dir: str | Path, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
               layer_ids: list[int]) -> Path:
    """Write one prompt's states atomically (temp file + rename): a reader never sees a half-written dump."""
    input_ids = input_ids.detach().to(device="cpu", dtype=torch.int64).reshape(-1).contiguous()
    key = sequence_key(input_ids)
    d = Path(dump_dir)
    tmp = d / f".{key}.tmp-{os.getpid()}"
    tensors = {
        "input_ids": input_ids,
        "aux": aux.detach().to("cpu").contiguous(),
        "final": final.detach().to("cpu").contiguous(),
    }
    meta = {"format": DUMP_FORMAT, "layer_ids": json.dumps(list(layer_ids)), "convention": LAYER_ID_CONVENTION}
    save_file(tensors, str(tmp), metadata=meta)
    out = dump_path(d, key)
    os.replace(tmp, out)
    return out


def read_dump(path: Path, token_ids: list[int], *, layer_ids: list[int], hidden_size: int, sample: str,
              dtype: torch.dtype | None = None) -> Captured:
    """Load and validate one dump against the prompt it must describe; every error names `sample`."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except FileNotFoundError:
        raise DumpError(f"sample {sample}: no hidden-state dump at {path}") from None
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise DumpError(f"sample {sample}: unreadable dump {path}: {e}") from None
    if meta.get("format") != DUMP_FORMAT:
        raise DumpError(f"sample {sample}: {path} has format {meta.get('format')!r}, expected {DUMP_FORMAT!r}")
    if meta.get("convention") != LAYER_ID_CONVENTION:
        raise DumpError(f"sample {sample}: dump layer-id convention {meta.get('convention')!r}, "
                        f"expected {LAYER_ID_CONVENTION!r}")
    got_ids = json.loads(meta.get("layer_ids", "null"))
    if got_ids != list(layer_ids):
        raise DumpError(
            f"sample {sample}: the server captured layers {got_ids} but this run uses target.aux_layer_ids "
            f"{list(layer_ids)}: restart the server from the same config"
        )
    missing = {"input_ids", "aux", "final"} - set(t)
    if missing:
        raise DumpError(f"sample {sample}: dump {path} lacks tensors {sorted(missing)}")
    n = len(token_ids)
    ids = t["input_ids"]
    if ids.numel() != n:
        raise DumpError(f"sample {sample}: the server returned states for {ids.numel()} tokens, the prompt has {n}")
    if not torch.equal(ids, torch.as_tensor(token_ids, dtype=torch.int64)):
        raise DumpError(f"sample {sample}: the dump's token ids differ from the prompt's (hash collision or a "
                        f"stale file in the dump folder)")
    aux, final = t["aux"], t["final"]
    if tuple(aux.shape) != (n, 3 * hidden_size):
        raise DumpError(f"sample {sample}: aux states have shape {tuple(aux.shape)}, expected ({n}, {3 * hidden_size}) "
                        f"(3 layers x hidden {hidden_size}); is aux capture enabled in the server?")
    if tuple(final.shape) != (n, hidden_size):
        raise DumpError(f"sample {sample}: final states have shape {tuple(final.shape)}, expected ({n}, {hidden_size})")
    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
        raise DumpError(f"sample {sample}: the dump holds NaN/inf values")
    if dtype is not None:
        aux, final = aux.to(dtype), final.to(dtype)
    return Captured(aux=aux, final=final)


def clean_dump_dir(dump_dir: str | Path) -> int:
    """Remove eagle3's dump and temp files (never anything else); return how many were removed.

    Called on client start (the server's warm-up request and a killed earlier run leave files) and on exit.
    """
    d = Path(dump_dir)
    if not d.is_dir():
        return 0
    removed = 0
    for p in d.iterdir():
        if p.is_file() and (_DUMP_RE.match(p.name) or _TMP_RE.match(p.name)):
            try:
                p.unlink()
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def remove_dump_dir(dump_dir: str | Path) -> None:
    """Remove the whole folder if it holds only eagle3 files (the marker and dumps); leave it otherwise."""
    d = Path(dump_dir)
    if not d.is_dir():
        return
    clean_dump_dir(d)
    if all(p.name == MARKER for p in d.iterdir()):
        shutil.rmtree(d, ignore_errors=True)
