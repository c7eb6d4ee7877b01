"""How a cache row's states are kept on disk, one codec per `extract.storage`, and their Arrow encoding.

    extract:
      storage: fp8          # exact (default) | fp8 | fp8-aux

- `exact`: the target's own bits (bf16/fp16 as uint16 patterns, float32 as float32): lossless, through a format
  that has no bfloat16 type (subnormals, -0.0, inf included).
- `fp8`: every state (low/mid/high aux and the final) as float8_e4m3fn with scale = amax / 448 per token and
  state, so a token costs 4H + 16 bytes of states instead of 8H (bf16): ~0.5x for any H >= 576.
- `fp8-aux`: the three aux states in fp8, the final state (the teacher's input) exact: 5H + 12 bytes.

A new storage kind is one `Codec` in CODECS and its name in eagle3.config.Storage (checked at import).

Scales are float32, not bf16: 16 bytes per token (0.06% of Kimi's 28 KB) buys scales that are exactly amax / 448,
so the largest element of every token maps to +-448 and no quantised value can land above the fp8 range after a
second rounding of its scale. e4m3 (3 mantissa bits) rather than e5m2: a per-token scale already covers the
range, and the extra mantissa bit halves the error (BENCHMARKS.md "fp8 cache").

Dequantisation is left to the consumer, on the device the states are used on (eagle3.objective): the host never
holds a second, dequantised copy of a shard, and a GPU reads half the bytes over PCIe.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np
import pyarrow as pa
import torch

from eagle3.config import Storage
from eagle3.logs import UserError
from eagle3.precision import DTYPES

STATES: dict[str, int] = {"aux": 3, "final": 1}
"""The states of a cache row, each with the hidden-size parts it holds: low/mid/high aux, the final state."""
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_BYTES = 4
# Storage type per target dtype: 16-bit floats keep their bit patterns in uint16.
_EXACT = {torch.bfloat16: pa.uint16(), torch.float16: pa.uint16(), torch.float32: pa.float32()}


class CacheError(UserError, RuntimeError):
    """A cache that cannot be used as asked (wrong fingerprint, incomplete, corrupt), phrased for the user."""


# ---------------------------------------------------------------------------------------------------- codecs
@dataclass(frozen=True)
class Codec:
    """One `extract.storage`: the states it keeps as fp8, each with a float32 scale per token and part; the others
    keep the target's own bits."""

    name: str
    fp8: frozenset[str] = frozenset()

    def column_type(self, state: str, dtype: torch.dtype) -> pa.DataType:
        return pa.uint8() if state in self.fp8 else exact_type(dtype)

    def encode(self, state: str, x: torch.Tensor) -> tuple[np.ndarray, torch.Tensor | None]:
        """One sample's [T, parts*H] state -> (its stored values, flat; its [T, parts] scales, or None)."""
        if state not in self.fp8:
            return _bits(x), None
        q, scale = quantize(x, STATES[state])
        return _bits(q), scale

    def bytes_per_token(self, hidden_size: int, item_size: int) -> int:
        """Bytes the states of one token take (`item_size`: the target dtype's element size)."""
        return sum(parts * (hidden_size + SCALE_BYTES) if state in self.fp8 else parts * hidden_size * item_size
                   for state, parts in STATES.items())


CODECS: dict[str, Codec] = {c.name: c for c in (Codec("exact"), Codec("fp8", frozenset(STATES)),
                                                Codec("fp8-aux", frozenset({"aux"})))}
STORAGES: tuple[Storage, ...] = get_args(Storage)
if set(CODECS) != set(STORAGES):
    raise RuntimeError(f"eagle3.config.Storage {STORAGES} and the cache codecs {tuple(CODECS)} must name the same kinds")


def codec_for(storage: str) -> Codec:
    if storage not in CODECS:
        raise ValueError(f"unknown cache storage {storage!r}; expected one of {', '.join(CODECS)}")
    return CODECS[storage]


def exact_type(dtype: torch.dtype) -> pa.DataType:
    if dtype not in _EXACT:
        raise CacheError(f"cannot store hidden states of dtype {dtype}; supported: bfloat16, float16, float32")
    return _EXACT[dtype]


def payload_bytes_per_token(hidden_size: int, dtype: str, storage: str = "exact") -> int:
    """The least a cache of `storage` can take per token: aux + final states (with their fp8 scales), an int32
    id and an int8 mask."""
    item = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    return codec_for(storage).bytes_per_token(hidden_size, item) + 4 + 1


# ------------------------------------------------------------------------------------------------------- fp8
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
    for name in STATES:
        scale = states.get(f"{name}_scale")
        if scale is not None:
            out[name] = dequantize(states[name], scale, dtype)
    return out


# ------------------------------------------------------------------------------------------------- encoding
def schema(hidden_size: int, dtype: torch.dtype, storage: str = "exact", images: bool = False) -> pa.Schema:
    c = codec_for(storage)
    fields = [("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
              ("num_tokens", pa.int32())]
    fields += [(s, pa.list_(pa.list_(c.column_type(s, dtype), parts * hidden_size))) for s, parts in STATES.items()]
    fields += [(f"{s}_scale", pa.list_(pa.list_(pa.float32(), parts))) for s, parts in STATES.items() if s in c.fp8]
    fields.append(("target_argmax", pa.list_(pa.int32())))
    if images:  # each row's image token positions and the target's merged input embeddings there (the vision
        # projector's outputs), in the target's own bits whatever the storage (draft.image_inputs=target-embeddings)
        # and, for an M-RoPE target, the temporal row of its positions (vLLM's draft positions; empty: the index)
        fields += [("image_positions", pa.list_(pa.int32())),
                   ("image_embeds", pa.list_(pa.list_(exact_type(dtype), hidden_size))),
                   ("positions", pa.list_(pa.int32()))]
    meta = {"eagle3_dtype": str(dtype).removeprefix("torch."), "eagle3_storage": storage}
    return pa.schema(fields, metadata=meta)


def _bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's bits as a flat numpy array of the storage type (no float conversion ever happens)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    if t.dtype == FP8:
        return t.view(torch.uint8).numpy().reshape(-1)
    if t.dtype == torch.float32:
        return t.numpy().reshape(-1)
    raise CacheError(f"cannot store hidden states of dtype {t.dtype}")


def record_batch(rows: list[dict[str, Any]], hidden_size: int, dtype: torch.dtype,
                 storage: str = "exact", images: bool = False) -> pa.RecordBatch:
    """Rows {sample_id, input_ids, loss_mask, aux [T,3H], final [T,H], target_argmax [T]} -> one Arrow record
    batch, the states encoded by the storage's codec (quantised here for fp8). target_argmax is the target's
    full-vocab argmax at each position (a target token id). `images`: each row also has `image_positions` [N] and
    `image_embeds` [N, H], and `positions` [T] where they are not the token index (`schema`)."""
    sch, c = schema(hidden_size, dtype, storage, images), codec_for(storage)
    lengths = np.array([len(r["input_ids"]) for r in rows], dtype=np.int32)
    for r, t in zip(rows, lengths, strict=True):
        if tuple(r["aux"].shape) != (t, 3 * hidden_size) or tuple(r["final"].shape) != (t, hidden_size):
            raise CacheError(f"sample {r['sample_id']}: states {tuple(r['aux'].shape)}/{tuple(r['final'].shape)} "
                             f"do not match {t} tokens x hidden {hidden_size}")
        if r["aux"].dtype != dtype or r["final"].dtype != dtype:
            raise CacheError(f"sample {r['sample_id']}: states are {r['aux'].dtype}, the cache stores {dtype}")
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))

    def nested(values: np.ndarray, typ: pa.DataType, width: int) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(pa.array(values, type=typ), width))

    def flat(key: str, dt: type) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([np.asarray(r[key], dtype=dt) for r in rows])))

    cols = [pa.array([str(r["sample_id"]) for r in rows], type=pa.string()), flat("input_ids", np.int32),
            flat("loss_mask", np.int8), pa.array(lengths, type=pa.int32())]
    scales: list[pa.Array] = []
    for state, parts in STATES.items():
        values, state_scales = [], []
        for r in rows:
            try:
                v, s = c.encode(state, r[state])
            except ValueError as e:
                raise CacheError(f"sample {r['sample_id']}: {e}") from e
            values.append(v)
            state_scales += [] if s is None else [s]
        cols.append(nested(np.concatenate(values), c.column_type(state, dtype), parts * hidden_size))
        if state_scales:
            scales.append(nested(torch.cat(state_scales).numpy().reshape(-1), pa.float32(), parts))
    for r, t in zip(rows, lengths, strict=True):
        if len(r["target_argmax"]) != t:
            raise CacheError(f"sample {r['sample_id']}: {len(r['target_argmax'])} argmax ids for {t} tokens")
    cols += [*scales, flat("target_argmax", np.int32)]
    if images:
        cols += _image_columns(rows, hidden_size, dtype)
    return pa.RecordBatch.from_arrays(cols, schema=sch)


def _image_columns(rows: list[dict[str, Any]], hidden_size: int, dtype: torch.dtype) -> list[pa.Array]:
    counts = np.array([len(r["image_positions"]) for r in rows], dtype=np.int32)
    for r, n in zip(rows, counts, strict=True):
        if tuple(r["image_embeds"].shape) != (n, hidden_size) or r["image_embeds"].dtype != dtype:
            raise CacheError(f"sample {r['sample_id']}: image embeddings {tuple(r['image_embeds'].shape)} "
                             f"{r['image_embeds'].dtype} for {n} image positions (hidden {hidden_size}, {dtype})")
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    positions = np.concatenate([np.asarray(r["image_positions"], dtype=np.int32) for r in rows])
    embeds = np.concatenate([_bits(r["image_embeds"]) for r in rows])
    draft_positions = [np.asarray(r["positions"] if r.get("positions") is not None else [], dtype=np.int32)
                       for r in rows]
    for r, p in zip(rows, draft_positions, strict=True):
        if len(p) not in (0, len(r["input_ids"])):
            raise CacheError(f"sample {r['sample_id']}: {len(p)} positions for {len(r['input_ids'])} tokens")
    lengths = np.array([len(p) for p in draft_positions], dtype=np.int32)
    return [pa.ListArray.from_arrays(offsets, pa.array(positions, type=pa.int32())),
            pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(
                pa.array(embeds, type=exact_type(dtype)), hidden_size)),
            pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
                                     pa.array(np.concatenate(draft_positions), type=pa.int32()))]


# ------------------------------------------------------------------------------------------------- decoding
def shard_storage(sch: pa.Schema) -> tuple[str, str | None]:
    """(storage, dtype) a shard's schema metadata says it holds (shards from before `storage` are exact)."""
    meta = {k.decode(): v.decode() for k, v in (sch.metadata or {}).items()}
    return meta.get("eagle3_storage", "exact"), meta.get("eagle3_dtype")


def column_np(arr: pa.Array) -> np.ndarray:
    if arr.offset != 0:
        raise CacheError("unexpected sliced Arrow array in a cache shard")
    return arr.to_numpy(zero_copy_only=True)


def state_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Stored state values as a tensor viewing them: fp8 bytes as float8_e4m3fn, 16-bit patterns as `dtype`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap: the tensors are views, never written
        if a.dtype == np.uint8:  # fp8 storage: the bytes of float8_e4m3fn values
            return torch.from_numpy(a).view(FP8)
        if dtype in (torch.bfloat16, torch.float16):
            return torch.from_numpy(a.view(np.int16)).view(dtype)
        return torch.from_numpy(a)


class DecodedBatch:
    """Zero-copy numpy views of one record batch's columns (offsets + flat values)."""

    def __init__(self, rb: pa.RecordBatch, torch_dtype: torch.dtype):
        self.rb = rb
        self.offsets = column_np(rb.column("input_ids").offsets)
        self.ids = column_np(rb.column("input_ids").values)
        self.mask = column_np(rb.column("loss_mask").values)
        self.states = {s: column_np(rb.column(s).values.values) for s in STATES}
        self.widths = {s: rb.schema.field(s).type.value_type.list_size for s in STATES}
        self.dtype = torch_dtype
        self.sample_ids = rb.column("sample_id")
        self.argmax = column_np(rb.column("target_argmax").values)
        names = rb.schema.names
        self.scales = {s: column_np(rb.column(f"{s}_scale").values.values) for s in STATES if f"{s}_scale" in names}
        self.images = None
        if "image_embeds" in names:
            col = rb.column("image_positions")
            self.images = (column_np(col.offsets), column_np(col.values),
                           column_np(rb.column("image_embeds").values.values))
        self.positions = None  # image caches written before the column: the token index
        if "positions" in names:
            col = rb.column("positions")
            self.positions = (column_np(col.offsets), column_np(col.values))

    def item(self, r: int) -> dict[str, Any]:
        """Row `r` as tensors viewing the mapped record batch (see HiddenStateDataset)."""
        s, e = int(self.offsets[r]), int(self.offsets[r + 1])
        t = e - s
        item: dict[str, Any] = {"sample_id": self.sample_ids[r].as_py(),
                                "input_ids": torch.from_numpy(self.ids[s:e].astype(np.int64)),
                                "loss_mask": state_tensor(self.mask[s:e], torch.int8)}
        for state, flat in self.states.items():
            w = self.widths[state]
            item[state] = state_tensor(flat[s * w:e * w], self.dtype).view(t, w)
        for state, flat in self.scales.items():
            parts = STATES[state]
            item[f"{state}_scale"] = torch.from_numpy(flat[s * parts:e * parts]).view(t, parts)
        item["target_argmax"] = torch.from_numpy(self.argmax[s:e].astype(np.int64))
        if self.images is not None:
            offsets, positions, embeds = self.images
            a, b = int(offsets[r]), int(offsets[r + 1])
            h = self.widths["final"]
            item["image_positions"] = torch.from_numpy(positions[a:b].astype(np.int64))
            item["image_embeds"] = state_tensor(embeds[a * h:b * h], self.dtype).view(b - a, h)
        if self.positions is not None:
            offsets, values = self.positions
            a, b = int(offsets[r]), int(offsets[r + 1])
            if b > a:
                item["positions"] = torch.from_numpy(values[a:b].astype(np.int64))
        return item
