"""The dump-folder protocol between eagle3's SGLang capture patch (server side) and `SGLangTarget` (client side).

Why files and not JSON: a token carries (3 aux + 1 final) x hidden bf16 values (Kimi-K2.5's size: docs/kimi-k2.5.md
"The target in numbers"), and as JSON floats many times that in text to print, send and parse per token. Instead the patched server writes one safetensors
file per prompt into a RAM-backed folder (`target.sglang.dump_dir`, default /dev/shm/eagle3-sglang) and the
client reads it as tensors and deletes it. Both sides import only this module (no sglang import here), so the
CPU tests can play the server's part with the very same writer.

A file is named by a hash of the prompt's token ids, not by a request id: the capture point inside SGLang (the
logits processor) sees the batch's token ids but no request ids, and the client knows the ids it sent. A
prefill that did not cover the whole prompt (a radix-cache hit, a chunked prefill) hashes to a different name,
so an incomplete capture can never be mistaken for a complete one: the client finds no file and says why. (A
prompt with images is named by its `served_ids`: SGLang's model holds a clamped pad id at each image position.)

    <dump_dir>/<sha256 of int64 token ids>.safetensors
        aux       [T, 3H]  residual streams entering the three aux layers (eagle3 convention), concatenated
        final     [T, H]   last layer output after the final norm
        input_ids [T]      int64, checked against the prompt (SGLang's ids: an image position holds `served_ids`' id)
        image_rows [n]     int64, for a prompt with images only: the rows that may be image positions (`image_parts`)
        image_embeds [n, H] the target's merged input embeddings at those rows (the vision projector's outputs)
        metadata: format, layer_ids (eagle3 convention), convention
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.layer_ids import LAYER_ID_CONVENTION
from eagle3.precision import all_finite
from eagle3.targets.base import Captured

DUMP_FORMAT = "eagle3-sglang-dump/1"
ENV_DUMP_DIR = "EAGLE3_SGLANG_DUMP_DIR"
"""Set in the server's environment: where the capture patch writes (inherited by SGLang's TP worker processes)."""
ENV_LAYER_IDS = "EAGLE3_SGLANG_LAYER_IDS"
"""JSON list of the aux layer ids in eagle3's convention (input of decoder layer k)."""
ENV_FAMILY = "EAGLE3_SGLANG_FAMILY"
"""`llama` or `deepseek`: how SGLang spells layer ids for this target (eagle3.layer_ids.to_engine_ids)."""
ENV_SEGMENT = "EAGLE3_MOONCAKE_SEGMENT"
"""Bytes the server lends the Mooncake Store (eagle3.targets.mooncake.segment_bytes), with EAGLE3_MOONCAKE_*."""
STORE_KEY_PREFIX = "eagle3/"
"""Requests whose rid starts so are handed over through the Mooncake Store, under the rid as its key:
`eagle3/<run>/r<rank>/<session>/<n>/<storage>` (`store_key`)."""
MARKER = ".eagle3-sglang-dump"
"""Present in every dump folder eagle3 created; cleanup refuses folders without it that hold other files."""

_DUMP_RE = re.compile(r"^[0-9a-f]{64}\.(safetensors|error)$")
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


def store_key(run: str, rank: int, session: str, n: int, storage: str) -> str:
    """The rid (and store key) of a request: the run and rank whose leftovers a later start removes
    (`store_key_prefix`), a session, a counter, and the storage kind its states travel in (a cache codec's name)."""
    storage_scaled(storage)  # a known kind
    return f"{store_key_prefix(run, rank)}{session}/{n}/{storage}"


def store_key_prefix(run: str, rank: int) -> str:
    """Every key of one run's rank."""
    return f"{STORE_KEY_PREFIX}{run}/r{rank}/"


def store_key_storage(key: str) -> str:
    """The storage kind a store key names (`store_key`)."""
    storage = key.rsplit("/", 1)[-1]
    storage_scaled(storage)
    return storage


def dump_path(dump_dir: str | Path, key: str) -> Path:
    return Path(dump_dir) / f"{key}.safetensors"


def error_path(dump_dir: str | Path, key: str) -> Path:
    """Where the server says why a prompt's dump is not coming (`write_error`), for the client to raise."""
    return Path(dump_dir) / f"{key}.error"


def write_error(dump_dir: str | Path, input_ids: torch.Tensor, why: str) -> None:
    """The server's reason for not writing a prompt's dump, under its name (atomically, as dumps are)."""
    key = sequence_key(input_ids)
    tmp = Path(dump_dir) / f".{key}.tmp-{os.getpid()}"
    tmp.write_text(why)
    os.replace(tmp, error_path(dump_dir, key))


def ensure_dump_dir(dump_dir: str | Path) -> Path:
    """Create the folder (and its marker) if needed; the program creates its folders, not the user."""
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / MARKER).touch()
    return d


def served_ids(token_ids: list[int], image_token_id: int | None, vocab_size: int) -> list[int]:
    """The ids SGLang 0.5.23's model holds for a prompt: at each image position the hash pad value it put there for
    the radix cache, clamped to vocab_size - 1 before the embedding (`managers/mm_utils.py`); others unchanged. The
    dump is named by and checked against these."""
    if image_token_id is None:
        return list(token_ids)
    return [vocab_size - 1 if t == image_token_id else t for t in token_ids]


def image_parts(input_ids: torch.Tensor, embeds: torch.Tensor, clamped_id: int) -> dict[str, torch.Tensor]:
    """Server side, a prompt of an image batch: its rows holding `clamped_id` (every image position, and any text
    token of that id, which the client leaves out) and the merged input embeddings there."""
    rows = torch.nonzero(input_ids.reshape(-1) == clamped_id).flatten()
    return {"image_rows": rows.to(torch.int64), "image_embeds": embeds[rows].detach()}


def write_dump(dump_dir: str | Path, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
               layer_ids: list[int], image: dict[str, torch.Tensor] | None = None) -> Path:
    """Write one prompt's states atomically (temp file + rename): a reader never sees a half-written dump.
    `image`: its `image_parts`, for a prompt of a batch with images."""
    input_ids = input_ids.detach().to(device="cpu", dtype=torch.int64).reshape(-1).contiguous()
    key = sequence_key(input_ids)
    d = Path(dump_dir)
    tmp = d / f".{key}.tmp-{os.getpid()}"
    tensors = {
        "input_ids": input_ids,
        "aux": aux.detach().to("cpu").contiguous(),
        "final": final.detach().to("cpu").contiguous(),
        **{k: v.to("cpu").contiguous() for k, v in (image or {}).items()},
    }
    meta = {"format": DUMP_FORMAT, "layer_ids": json.dumps(list(layer_ids)), "convention": LAYER_ID_CONVENTION}
    save_file(tensors, str(tmp), metadata=meta)
    out = dump_path(d, key)
    os.replace(tmp, out)
    return out


def read_dump(path: Path, token_ids: list[int], *, layer_ids: list[int], hidden_size: int, sample: str,
              dtype: torch.dtype | None = None, image_positions: list[int] | None = None) -> Captured:
    """Load and validate one dump against the prompt it must describe (`served_ids`, `image_positions` for a
    prompt with images: check_states); every error names `sample`."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except FileNotFoundError:
        raise DumpError(f"sample {sample}: no hidden-state dump at {path}") from None
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise DumpError(f"sample {sample}: unreadable dump {path}: {e}") from None
    return check_states(t, meta, token_ids, layer_ids=layer_ids, hidden_size=hidden_size, sample=sample,
                        where=str(path), dtype=dtype, image_positions=image_positions)


def check_states(t: dict[str, torch.Tensor], meta: dict[str, str], token_ids: list[int], *, layer_ids: list[int],
                 hidden_size: int, sample: str, where: str, dtype: torch.dtype | None = None,
                 image_positions: list[int] | None = None) -> Captured:
    """One prompt's states as the server handed them over (a dump file or a store object), checked against the
    prompt they must describe: format, layer ids, token ids, shapes, finite values. fp8 states (a `storage` in the
    metadata other than exact) come back quantised, their scales beside them, as an fp8 cache holds them.
    `image_positions` (a prompt with images): the merged input embeddings at those positions, in order, become
    `image_embeds`; each must be among the dump's image rows."""
    if meta.get("format") != DUMP_FORMAT:
        raise DumpError(f"sample {sample}: {where} has format {meta.get('format')!r}, expected {DUMP_FORMAT!r}")
    if meta.get("convention") != LAYER_ID_CONVENTION:
        raise DumpError(f"sample {sample}: dump layer-id convention {meta.get('convention')!r}, "
                        f"expected {LAYER_ID_CONVENTION!r}")
    got_ids = json.loads(meta.get("layer_ids", "null"))
    if got_ids != list(layer_ids):
        raise DumpError(
            f"sample {sample}: the server captured layers {got_ids} but this run uses target.aux_layer_ids "
            f"{list(layer_ids)}: restart the server from the same config"
        )
    storage = meta.get("storage", "exact")
    scaled = {s for s in STATE_PARTS if f"{s}_scale" in t}
    missing = {"input_ids", "aux", "final"} - set(t)
    if missing:
        raise DumpError(f"sample {sample}: dump {where} lacks tensors {sorted(missing)}")
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
    scales = {}
    for state in scaled:
        sc = t[f"{state}_scale"]
        if tuple(sc.shape) != (n, STATE_PARTS[state]) or t[state].dtype != FP8_DTYPE:
            raise DumpError(f"sample {sample}: {where} holds {state} as {t[state].dtype} with scales "
                            f"{tuple(sc.shape)}, expected float8_e4m3fn with ({n}, {STATE_PARTS[state]})")
        if not all_finite(sc) or not all_finite(t[state]):
            raise DumpError(f"sample {sample}: the dump holds NaN/inf values")
        scales[state] = sc
    if storage_scaled(storage) != scaled:
        raise DumpError(f"sample {sample}: {where} says storage {storage!r} but holds fp8 states {sorted(scaled)}")
    exact = [x for s, x in (("aux", aux), ("final", final)) if s not in scaled]
    if not all(all_finite(x) for x in exact):
        raise DumpError(f"sample {sample}: the dump holds NaN/inf values")
    if dtype is not None:
        aux = aux if "aux" in scaled else aux.to(dtype)
        final = final if "final" in scaled else final.to(dtype)
    embeds = None if image_positions is None else _image_embeds(t, image_positions, hidden_size, sample, where)
    if embeds is not None and dtype is not None:
        embeds = embeds.to(dtype)
    return Captured(aux=aux, final=final, aux_scale=scales.get("aux"), final_scale=scales.get("final"),
                    image_embeds=embeds)


def _image_embeds(t: dict[str, torch.Tensor], positions: list[int], hidden_size: int, sample: str,
                  where: str) -> torch.Tensor:
    """The merged input embeddings at `positions` (the prompt's image tokens), from the dump's image rows."""
    if not positions:  # a text prompt among image samples: none, as the HF backend gives
        return torch.empty(0, hidden_size, dtype=t["final"].dtype)
    if "image_rows" not in t or "image_embeds" not in t:
        raise DumpError(f"sample {sample}: {where} holds no image embeddings, but the prompt has {len(positions)} "
                        "image tokens: did the server get the pictures (a multimodal target, image_data sent)?")
    rows, embeds = t["image_rows"].tolist(), t["image_embeds"]
    if tuple(embeds.shape) != (len(rows), hidden_size):
        raise DumpError(f"sample {sample}: {where} holds image embeddings of shape {tuple(embeds.shape)} for "
                        f"{len(rows)} rows, expected ({len(rows)}, {hidden_size})")
    at = {r: i for i, r in enumerate(rows)}
    missing = [p for p in positions if p not in at]
    if missing:
        raise DumpError(f"sample {sample}: the server merged no picture at image positions {missing[:8]} (its "
                        f"image rows: {rows[:8]}...)")
    picked = embeds[[at[p] for p in positions]]
    if not all_finite(picked):
        raise DumpError(f"sample {sample}: the dump holds NaN/inf image embeddings")
    return picked


# --------------------------------------------------------------------------- one prompt's states as one object
STATE_PARTS = {"aux": 3, "final": 1}
"""The states of a prompt, each with the hidden-size parts it holds (as eagle3.cache.codec.STATES)."""
FP8_DTYPE = torch.float8_e4m3fn
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", FP8_DTYPE: "F8_E4M3"}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def storage_scaled(storage: str) -> set[str]:
    """The states a storage kind keeps in fp8 (eagle3.cache.codec.CODECS, without importing pyarrow here)."""
    return {"exact": set(), "fp8": {"aux", "final"}, "fp8-aux": {"aux"}}[storage]


def prompt_states(input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, layer_ids: list[int],
                  storage: str = "exact", image: dict[str, torch.Tensor] | None = None,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of one prompt's dump, its states encoded by the cache's own codec (`storage`),
    on whatever device they are (a server quantises on its GPU before copying half the bytes to the host);
    `image`: its `image_parts` (kept exact, as a cache keeps them)."""
    tensors = {"input_ids": input_ids.detach().to(dtype=torch.int64).reshape(-1)}
    for name, x in (("aux", aux), ("final", final)):
        if name in storage_scaled(storage):
            from eagle3.cache.codec import quantize

            tensors[name], tensors[f"{name}_scale"] = quantize(x.detach(), STATE_PARTS[name])
        else:
            tensors[name] = x.detach()
    tensors.update(image or {})
    meta = {"format": DUMP_FORMAT, "layer_ids": json.dumps(list(layer_ids)), "convention": LAYER_ID_CONVENTION,
            "storage": storage}
    return tensors, meta


def pack(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[torch.Tensor]]:
    """The safetensors layout of `tensors` as (header, the tensors to write after it in order): the header says
    where each tensor's bytes lie, so a reader views them in place, and `safetensors.torch.load(blob)` reads the
    same object. The tensors are not copied here (the caller writes them where they go, from any device)."""
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    parts, offset = [], 0
    for name, x in tensors.items():
        if x.dtype not in _ST_DTYPES:
            raise DumpError(f"cannot hand over a {x.dtype} tensor ({name})")
        n = x.numel() * x.element_size()
        entries[name] = {"dtype": _ST_DTYPES[x.dtype], "shape": list(x.shape), "data_offsets": [offset, offset + n]}
        parts.append(x.contiguous())
        offset += n
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors aligns the data to 8 bytes
    return len(header).to_bytes(8, "little") + header, parts


def unpack(blob: memoryview | bytes, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`pack`'s object back as tensors viewing `blob` (copy them before the buffer is reused) and its metadata."""
    view = memoryview(blob).cast("B")
    try:
        n = int.from_bytes(view[:8], "little")
        entries = json.loads(bytes(view[8:8 + n]))
        meta = entries.pop("__metadata__", {})
        body = view[8 + n:]
        out = {}
        for name, e in entries.items():
            start, end = e["data_offsets"]
            if not 0 <= start <= end <= len(body):
                raise ValueError(f"{name} lies past the object's end")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only blob: views the caller copies, never writes
                raw = torch.frombuffer(body[start:end], dtype=torch.uint8) if end > start else torch.empty(0, dtype=torch.uint8)
            out[name] = raw.view(_ST_NAMES[e["dtype"]]).view(e["shape"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise DumpError(f"{what}: not an eagle3 states object ({e})") from None
    return out, meta


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
