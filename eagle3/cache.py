"""The on-disk hidden-state cache: sharded Arrow files, read back zero-copy.

    eagle3 cache info runs/smollm2-135m/cache

Layout (one folder per prepared split; every rank of a scaled-out extraction writes only its own files):

    <cache>/meta.json                                    fingerprint + layout (world size, samples per shard)
    <cache>/<split>/rank-00000-of-00002.json             that rank's manifest: committed shards, complete flag
    <cache>/<split>/rank-00000-of-00002-shard-00000.arrow

Each shard is an Arrow IPC stream (what `datasets.Dataset.from_file` reads) with columns sample_id (string),
input_ids (list<int32>), loss_mask (list<int8>), num_tokens (int32), aux (list<fixed_size_list<H3>>), final
(list<fixed_size_list<H>>) and target_argmax (list<int32>: the target's full-vocab argmax at each position, so
the trainer never reads the whole lm_head).

`extract.storage` (eagle3.storage) decides how states are kept. `exact`: bf16/fp16 states as their raw 16-bit
patterns (uint16), so they round-trip bit-exactly (subnormals, -0.0, inf included) through a format that has no
bfloat16 type; float32 stays float32. `fp8` / `fp8-aux`: the fp8 states as their bytes (uint8) with an
`aux_scale` (list<fixed_size_list<float32, 3>>) / `final_scale` (<..., 1>) column beside them. The storage is part
of the fingerprint and of every shard's schema metadata, so shards of two storages are never read as one cache.

A cache is only valid for the exact target weights, dtype, layer ids (and their meaning) and prepared data it was
extracted from; `meta.json` records all of them and `check_fingerprint` refuses a mismatch instead of letting a
trainer learn from the wrong states (the seed's drafter trained on mismatched states reached 15% acceptance).

Integrity: every manifest entry records its shard's size, row count and SHA-256. Reading a cache always checks
size and rows (free); `verify_cache(full=True)` hashes every shard (`eagle3 cache info --verify`, the trainer
before it starts, extraction before it trusts the shards it resumes from). A damaged shard is named, and
re-running `eagle3 extract` re-extracts it. Caches of format 1 (no stored argmax, no checksums) are refused with
the one command that upgrades them in place: `eagle3 cache upgrade`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import torch

from eagle3.fsutil import file_problem, replace_dir, sha256_file, tmp_sibling, write_json_atomic
from eagle3.layer_ids import LAYER_ID_CONVENTION
from eagle3.locks import writes
from eagle3.logs import UserError
from eagle3.precision import DTYPES
from eagle3.storage import fp8_states, quantize, state_bytes_per_token
from eagle3.targets.info import read_target_info, weights_id

if TYPE_CHECKING:
    from eagle3.config import Config

log = logging.getLogger("eagle3")

FORMAT_VERSION = 2
SPLITS = ("train", "eval")

# Storage type per target dtype: 16-bit floats keep their bit patterns in uint16.
_STORAGE = {torch.bfloat16: pa.uint16(), torch.float16: pa.uint16(), torch.float32: pa.float32()}
_LABELS = {
    "layer_ids": "layer ids", "layer_id_convention": "layer-id convention", "dtype": "target dtype",
    "weights_id": "target weights id", "target_path": "target path", "revision": "target revision",
    "prepared_fingerprint": "prepared samples fingerprint", "max_length": "max_length", "hidden_size": "hidden size",
    "num_layers": "number of target layers", "architectures": "target architectures", "format": "cache format",
    "storage": "storage (extract.storage)",
}


class CacheError(UserError, RuntimeError):
    """A cache that cannot be used as asked (wrong fingerprint, incomplete, corrupt), phrased for the user."""


# ------------------------------------------------------------------------------------------------ fingerprint
def expected_fingerprint(cfg: Config, prepared_meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a cache for `cfg` must have been extracted with; computed from config.json and the weight file
    listing, without loading the model (the trainer calls this before training)."""
    from eagle3.bundled import resolve_target_path

    folder = resolve_target_path(cfg.target.path)
    info = read_target_info(folder)
    num_layers = info.num_layers
    if prepared_meta is None:  # the samples the states belong to: never guessed (a missing file is an error)
        from eagle3.data.prepared import read_prepared_meta

        prepared_meta = read_prepared_meta(cfg.prepared_dir, check_files=False)
    return {
        "format": FORMAT_VERSION,
        "target_path": cfg.target.path,
        "revision": cfg.target.revision,
        "weights_id": weights_id(folder, cfg.target.revision),
        "architectures": info.architectures,
        "num_layers": num_layers,
        "hidden_size": info.hidden_size,
        "dtype": cfg.target.dtype,
        "layer_ids": cfg.layer_ids(num_layers),
        "layer_id_convention": LAYER_ID_CONVENTION,
        # The samples, not the draft vocab: states do not depend on it.
        "prepared_fingerprint": prepared_meta.get("samples_fingerprint"),
        "max_length": prepared_meta["max_length"],
        "storage": cfg.extract.storage,
    }


def fingerprint_diff(found: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """One readable line per differing field."""
    out = []
    for key in sorted(set(found) | set(expected)):
        if found.get(key) != expected.get(key):
            label = _LABELS.get(key, key)
            out.append(f"was extracted with {label} {found.get(key)!r} but the config asks for {expected.get(key)!r}")
    return out


def read_meta(cache_dir: str | Path, upgraded: bool = True) -> dict[str, Any]:
    """meta.json; a format-1 cache is refused (with the command that upgrades it) unless `upgraded` is False."""
    path = Path(cache_dir) / "meta.json"
    if not path.is_file():
        raise CacheError(f"{cache_dir} is not a hidden-state cache (no meta.json): run `eagle3 extract` first")
    try:
        meta = json.loads(path.read_text())
        version = meta["fingerprint"].get("format")
    except (ValueError, KeyError, AttributeError) as e:
        raise CacheError(f"{path} is damaged ({e}); delete it and re-run `eagle3 extract --config ...`: it is "
                         "rebuilt from the manifests' record of what the shards hold") from e
    if upgraded and version != FORMAT_VERSION:
        raise CacheError(f"cache {cache_dir} is format {version}; this eagle3 reads format {FORMAT_VERSION} (the "
                         "target's argmax stored with every sample, a checksum for every shard). Upgrade it in place "
                         f"once: eagle3 cache upgrade {cache_dir} --config <your config>")
    return meta


def check_fingerprint(cache_dir: str | Path, expected: dict[str, Any]) -> None:
    """Raise CacheError naming every field where the cache differs from what the config asks for."""
    found = read_meta(cache_dir)["fingerprint"]
    diff = fingerprint_diff(found, expected)
    if diff:
        lines = "\n".join(f"  cache {diff_line}" for diff_line in diff)
        raise CacheError(
            f"hidden-state cache {cache_dir} does not match the config:\n{lines}\n"
            f"Use a new extract.cache_dir, or delete {cache_dir} and extract again."
        )


# --------------------------------------------------------------------------------------------------- layout
def rank_stem(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}"


def shard_name(rank: int, world_size: int, index: int) -> str:
    return f"{rank_stem(rank, world_size)}-shard-{index:05d}.arrow"


@dataclass
class ShardEntry:
    index: int
    file: str
    num_samples: int
    num_tokens: int
    bytes: int
    skipped_nonfinite: list[str] = field(default_factory=list)
    """Sample ids of this shard's plan left out because the target gave NaN/inf states (never trained on)."""
    sha256: str = ""
    """The shard file's SHA-256 (hex), checked by verify_cache(full=True)."""


@dataclass
class Manifest:
    """What one rank has committed for one split. Updated atomically, only after the shard file is in place."""

    split: str
    rank: int
    world_size: int
    planned_samples: int
    planned_shards: int
    shards: list[ShardEntry] = field(default_factory=list)
    fingerprint: dict[str, Any] | None = None
    """What the shards were extracted with (meta.json's), so a lost meta.json is rebuilt from the shards' own
    record, never from a config; None in manifests written before it was recorded."""
    layout: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return {s.index for s in self.shards} == set(range(self.planned_shards))

    @staticmethod
    def path(cache_dir: Path, split: str, rank: int, world_size: int) -> Path:
        return Path(cache_dir) / split / f"{rank_stem(rank, world_size)}.json"

    @classmethod
    def load(cls, path: Path) -> Manifest:
        d = json.loads(path.read_text())
        shards = [ShardEntry(**s) for s in d.pop("shards")]
        d.pop("complete", None)
        return cls(**d, shards=shards)

    def save(self, cache_dir: Path) -> None:
        data = {"split": self.split, "rank": self.rank, "world_size": self.world_size,
                "planned_samples": self.planned_samples, "planned_shards": self.planned_shards,
                "shards": [s.__dict__ for s in sorted(self.shards, key=lambda s: s.index)], "complete": self.complete,
                "fingerprint": self.fingerprint, "layout": self.layout}
        write_json_atomic(self.path(cache_dir, self.split, self.rank, self.world_size), data)


# ---------------------------------------------------------------------------------------------------- writing
def storage_type(dtype: torch.dtype) -> pa.DataType:
    if dtype not in _STORAGE:
        raise CacheError(f"cannot store hidden states of dtype {dtype}; supported: bfloat16, float16, float32")
    return _STORAGE[dtype]


def schema(hidden_size: int, dtype: torch.dtype, storage: str = "exact") -> pa.Schema:
    st = storage_type(dtype)
    aux8, final8 = fp8_states(storage)
    fields = [
        ("sample_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("aux", pa.list_(pa.list_(pa.uint8() if aux8 else st, 3 * hidden_size))),
        ("final", pa.list_(pa.list_(pa.uint8() if final8 else st, hidden_size))),
    ]
    if aux8:
        fields.append(("aux_scale", pa.list_(pa.list_(pa.float32(), 3))))
    if final8:
        fields.append(("final_scale", pa.list_(pa.list_(pa.float32(), 1))))
    fields.append(("target_argmax", pa.list_(pa.int32())))
    meta = {"eagle3_dtype": str(dtype).removeprefix("torch."), "eagle3_storage": storage}
    return pa.schema(fields, metadata=meta)


def _to_storage_np(t: torch.Tensor) -> np.ndarray:
    """A tensor's bits as a flat numpy array of the storage type (no float conversion ever happens)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().reshape(-1)
    if t.dtype == torch.float32:
        return t.numpy().reshape(-1)
    raise CacheError(f"cannot store hidden states of dtype {t.dtype}")


def record_batch(rows: list[dict[str, Any]], hidden_size: int, dtype: torch.dtype,
                 storage: str = "exact") -> pa.RecordBatch:
    """Rows {sample_id, input_ids, loss_mask, aux [T,3H], final [T,H], target_argmax [T]} -> one Arrow record
    batch, the states quantised here when `storage` asks for fp8. target_argmax is the target's full-vocab argmax
    at each position (a target token id)."""
    sch = schema(hidden_size, dtype, storage)
    aux8, final8 = fp8_states(storage)
    lengths = np.array([len(r["input_ids"]) for r in rows], dtype=np.int32)
    for r, t in zip(rows, lengths, strict=True):
        if tuple(r["aux"].shape) != (t, 3 * hidden_size) or tuple(r["final"].shape) != (t, hidden_size):
            raise CacheError(f"sample {r['sample_id']}: states {tuple(r['aux'].shape)}/{tuple(r['final'].shape)} "
                             f"do not match {t} tokens x hidden {hidden_size}")
        if r["aux"].dtype != dtype or r["final"].dtype != dtype:
            raise CacheError(f"sample {r['sample_id']}: states are {r['aux'].dtype}, the cache stores {dtype}")
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    st = storage_type(dtype)
    scales: dict[str, list[torch.Tensor]] = {"aux": [], "final": []}

    def flat(key: str, fp8: bool, parts: int) -> np.ndarray:
        out = []
        for r in rows:
            x = r[key]
            if fp8:
                try:
                    x, scale = quantize(x, parts)
                except ValueError as e:
                    raise CacheError(f"sample {r['sample_id']}: {e}") from e
                scales[key].append(scale)
            out.append(_to_storage_np(x))
        return np.concatenate(out)

    def nested(values: np.ndarray, typ: pa.DataType, width: int) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(pa.array(values, type=typ), width))

    ids = np.concatenate([np.asarray(r["input_ids"], dtype=np.int32) for r in rows])
    mask = np.concatenate([np.asarray(r["loss_mask"], dtype=np.int8) for r in rows])
    cols = [
        pa.array([str(r["sample_id"]) for r in rows], type=pa.string()),
        pa.ListArray.from_arrays(offsets, pa.array(ids, type=pa.int32())),
        pa.ListArray.from_arrays(offsets, pa.array(mask, type=pa.int8())),
        pa.array(lengths, type=pa.int32()),
        nested(flat("aux", aux8, 3), pa.uint8() if aux8 else st, 3 * hidden_size),
        nested(flat("final", final8, 1), pa.uint8() if final8 else st, hidden_size),
    ]
    for key, parts in (("aux", 3), ("final", 1)):
        if scales[key]:
            cols.append(nested(torch.cat(scales[key]).numpy().reshape(-1), pa.float32(), parts))
    for r, t in zip(rows, lengths, strict=True):
        if len(r["target_argmax"]) != t:
            raise CacheError(f"sample {r['sample_id']}: {len(r['target_argmax'])} argmax ids for {t} tokens")
    argmax = np.concatenate([np.asarray(r["target_argmax"], dtype=np.int32) for r in rows])
    cols.append(pa.ListArray.from_arrays(offsets, pa.array(argmax, type=pa.int32())))
    return pa.RecordBatch.from_arrays(cols, schema=sch)


class ShardWriter:
    """Streams record batches into `<final>.tmp` and renames it into place on `commit()`, so a shard file that
    exists is always whole (a kill at any moment leaves at most a stale .tmp, removed on restart)."""

    def __init__(self, path: Path, hidden_size: int, dtype: torch.dtype, storage: str = "exact"):
        self.path, self.hidden_size, self.dtype, self.storage = path, hidden_size, dtype, storage
        self.tmp = path.with_name(path.name + ".tmp")
        self._sink = pa.OSFile(str(self.tmp), "wb")
        self.schema = schema(hidden_size, dtype, storage)
        self._writer = pa.ipc.new_stream(self._sink, self.schema)
        self.num_samples = 0
        self.num_tokens = 0

    def write(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.write_batch(record_batch(rows, self.hidden_size, self.dtype, self.storage))

    def write_batch(self, rb: pa.RecordBatch) -> None:
        """A record batch already in this shard's schema (`upgrade` adds a column to an old shard's batches)."""
        self._writer.write_batch(rb)
        self.num_samples += rb.num_rows
        self.num_tokens += int(pa.compute.sum(rb.column("num_tokens")).as_py() or 0)

    def commit(self, index: int, skipped_nonfinite: list[str] | None = None) -> ShardEntry:
        """Close the stream, hash it and rename it into place: the manifest entry of shard `index`."""
        self._writer.close()
        self._sink.flush()
        os.fsync(self._sink.fileno())
        self._sink.close()
        digest = sha256_file(self.tmp)
        os.replace(self.tmp, self.path)
        return ShardEntry(index, self.path.name, self.num_samples, self.num_tokens, self.path.stat().st_size,
                          list(skipped_nonfinite or []), digest)

    def abort(self) -> None:
        """Drop the half-written shard. Best effort on close: after a full disk, closing the stream tries to
        write its end marker and fails again, and that error must not hide the first one or keep the .tmp."""
        for close in (self._writer.close, self._sink.close):
            try:
                close()
            except (OSError, pa.ArrowException):
                pass
        self.tmp.unlink(missing_ok=True)


# -------------------------------------------------------------------------------------------------- integrity
def shard_problem(path: Path, entry: ShardEntry, full: bool) -> str | None:
    """What is wrong with one listed shard (fsutil.file_problem against its manifest entry), or None; the
    SHA-256 only when `full`."""
    return file_problem(path, entry.bytes, entry.sha256 if full else None, "the manifest")


def damaged_shards(cache_dir: Path, split: str, entries: list[ShardEntry], full: bool = True,
                   label: str = "") -> dict[str, str]:
    """{file: problem} of `entries` of one split. Hashed in threads (hashlib releases the GIL), with progress:
    hashing a Kimi-sized cache reads every byte of it once."""
    from concurrent.futures import ThreadPoolExecutor

    from eagle3.logs import Progress

    out: dict[str, str] = {}
    if not entries:
        return out
    total = sum(e.bytes for e in entries) if full else len(entries)
    with Progress(total, label or f"verify {split}", unit="B" if full else "shard",
                  disable=not full or total < 1e9) as prog, \
            ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        checks = [(e, pool.submit(shard_problem, Path(cache_dir) / split / e.file, e, full)) for e in entries]
        for e, fut in checks:
            problem = fut.result()
            if problem is not None:
                out[e.file] = problem
            prog.update(e.bytes if full else 1)
    return out


def verify_cache(cache_dir: str | Path, full: bool = True, part: tuple[int, int] = (0, 1)) -> list[str]:
    """'<split>/<file>: <problem>' for every listed shard of the cache that is missing, cut short or (`full`)
    damaged. `part` (i, n) checks every n-th shard from the i-th: ranks of a trainer share the work."""
    cache_dir = Path(cache_dir)
    out = []
    for split in SPLITS:
        found, _ = manifests(cache_dir, split)
        entries = sorted((s for m in found for s in m.shards), key=lambda s: s.file)[part[0]::part[1]]
        out += [f"{split}/{f}: {p}" for f, p in damaged_shards(cache_dir, split, entries, full).items()]
    return out


def damaged_error(cache_dir: Path, problems: list[str]) -> CacheError:
    listed = "\n".join(f"  {p}" for p in problems[:20]) + (f"\n  ... {len(problems) - 20} more" if len(problems) > 20
                                                          else "")
    return CacheError(f"cache {cache_dir}: {len(problems)} shard(s) are missing or damaged:\n{listed}\nRe-run the "
                      "same `eagle3 extract --config ...` command: it re-extracts exactly those shards.")


# ----------------------------------------------------------------------------------------- opening, resuming
# What extraction needs of the layout: which samples each rank's shards hold, meta.json created or checked (or
# rebuilt from the manifests), a rank's manifest loaded, its stale temporaries removed, the work left to do.
def plan_rank(num_samples: int, rank: int, world: int, shard_samples: int) -> list[list[int]]:
    """This rank's shards as lists of sample indices (see the module docstring)."""
    mine = list(range(rank, num_samples, world))
    return [mine[i: i + shard_samples] for i in range(0, len(mine), shard_samples)]


def open_cache(cache_dir: Path, fingerprint: dict[str, Any], layout: dict[str, Any], rank: int) -> None:
    """Create the cache's meta.json, or check that an existing cache was made for the same job."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta_path = cache_dir / "meta.json"
    if not meta_path.is_file() and sorted(cache_dir.glob("*/rank-*.json")):
        rebuild_meta(cache_dir, fingerprint, layout, rank)
    if meta_path.is_file():
        meta = read_meta(cache_dir)
        diff = fingerprint_diff(meta["fingerprint"], fingerprint)
        if diff:
            raise CacheError(
                f"refusing to add to hidden-state cache {cache_dir}: it\n"
                + "\n".join(f"  {d}" for d in diff)
                + f"\nUse a new extract.cache_dir=..., or delete {cache_dir} to extract again from scratch."
            )
        if meta["layout"] != layout:
            raise CacheError(
                f"refusing to resume cache {cache_dir}: it was started with layout {meta['layout']} and this run "
                f"has {layout} (world size, samples per shard and max_samples decide which sample goes to which "
                f"shard). Re-run with the original settings, or use a new extract.cache_dir."
            )
        return
    write_json_atomic(meta_path, {"format": "eagle3-hidden-states", "fingerprint": fingerprint, "layout": layout},
                      tmp_tag=f".{rank}")


def rebuild_meta(cache_dir: Path, fingerprint: dict[str, Any], layout: dict[str, Any], rank: int) -> None:
    """meta.json is gone but shards are there: rebuild it from what the manifests say the shards were extracted
    with, and only if that is what this run would extract; a config never vouches for shards it did not write."""
    found = sorted(cache_dir.glob("*/rank-*.json"))
    records = {p: Manifest.load(p) for p in found}
    unknown = [str(p) for p, m in records.items() if m.fingerprint is None or m.layout is None]
    if unknown:
        raise CacheError(f"{cache_dir / 'meta.json'} is missing and the manifests ({', '.join(unknown)}) do not "
                         "record what their shards were extracted with, so nothing can vouch for them: restore "
                         f"meta.json, or extract into a new extract.cache_dir (or delete {cache_dir})")
    for p, m in records.items():
        diff = fingerprint_diff(m.fingerprint or {}, fingerprint)
        if diff or m.layout != layout:
            what = "\n".join(f"  {d}" for d in diff) if diff else f"  layout {m.layout}, this run {layout}"
            raise CacheError(f"{cache_dir / 'meta.json'} is missing, and the shards listed in {p} were extracted "
                             f"for another job than this config's:\n{what}\nRe-run with the settings they were "
                             f"made with, or use a new extract.cache_dir (or delete {cache_dir})")
    write_json_atomic(cache_dir / "meta.json", {"format": "eagle3-hidden-states", "fingerprint": fingerprint,
                                                "layout": layout}, tmp_tag=f".{rank}")
    log.warning("%s was missing: rebuilt from the %d manifests, whose recorded fingerprint is this config's",
                cache_dir / "meta.json", len(records))


def load_manifest(cache_dir: Path, split: str, rank: int, world: int, plan: list[list[int]],
                   fingerprint: dict[str, Any], layout: dict[str, Any]) -> Manifest:
    path = Manifest.path(cache_dir, split, rank, world)
    fresh = Manifest(split, rank, world, planned_samples=sum(map(len, plan)), planned_shards=len(plan),
                     fingerprint=fingerprint, layout=layout)
    if not path.is_file():
        return fresh
    m = Manifest.load(path)
    if m.fingerprint is not None and fingerprint_diff(m.fingerprint, fingerprint):
        raise CacheError(f"{path}: its shards were extracted with {fingerprint_diff(m.fingerprint, fingerprint)}; "
                         "the cache mixes two jobs: extract into a new extract.cache_dir")
    m.fingerprint, m.layout = fingerprint, layout  # an older manifest learns them (open_cache checked meta.json)
    if (m.planned_samples, m.planned_shards) != (fresh.planned_samples, fresh.planned_shards):
        raise CacheError(f"{path}: planned {m.planned_samples} samples in {m.planned_shards} shards, this run plans "
                         f"{fresh.planned_samples} in {fresh.planned_shards}: the prepared data changed")
    # Checked in full before they are trusted: a damaged shard is dropped here and re-extracted by this run.
    bad = damaged_shards(cache_dir, split, m.shards, full=True, label=f"verify {split} shards of rank {rank}")
    for file, problem in bad.items():
        log.warning("%s/%s: %s; it will be extracted again", split, file, problem)
        (cache_dir / split / file).unlink(missing_ok=True)
    m.shards = [s for s in m.shards if s.file not in bad]
    return m


def clean_stale_tmp(split_dir: Path, rank: int, world: int) -> None:
    """Remove this rank's leftovers from a killed run (never another rank's: it may be writing right now)."""
    for p in split_dir.glob(f"{rank_stem(rank, world)}*.tmp"):
        log.info("removing stale temporary file %s from an interrupted run", p)
        p.unlink(missing_ok=True)


def remaining_tokens(cache_dir: Path, world: int, lengths: dict[str, np.ndarray], shard_samples: int) -> int:
    """Tokens not yet committed by any rank (ranks usually share the disk, so check for the whole job)."""
    total = 0
    for split, lens in lengths.items():
        for r in range(world):
            plan = plan_rank(len(lens), r, world, shard_samples)
            path = Manifest.path(cache_dir, split, r, world)
            done = {s.index for s in Manifest.load(path).shards} if path.is_file() else set()
            total += sum(int(lens[rows].sum()) for i, rows in enumerate(plan) if i not in done)
    return total


def preflight_disk(cache_dir: Path, tokens: int, hidden_size: int, dtype: str, margin: float = 0.10,
                   storage: str = "exact") -> None:
    per_token = payload_bytes_per_token(hidden_size, dtype, storage)
    need = tokens * per_token
    free = shutil.disk_usage(cache_dir).free
    log.info("preflight: %d tokens to extract, about %.2f GB; %.2f GB free on %s", tokens, need / 1e9, free / 1e9,
             cache_dir)
    if need * (1 + margin) > free:
        raise CacheError(
            f"not enough disk for the hidden-state cache: about {need / 1e9:.2f} GB needed (+{margin:.0%} margin) "
            f"for {tokens} tokens x {per_token} bytes/token ({storage} storage), but only "
            f"{free / 1e9:.2f} GB is free on {cache_dir}. Point extract.cache_dir at a bigger disk, extract fewer "
            f"samples (extract.max_samples=N), store fp8 (extract.storage=fp8: ~0.5x), or use extract.mode=online."
        )


# ---------------------------------------------------------------------------------------------------- reading
def manifests(cache_dir: str | Path, split: str) -> tuple[list[Manifest], list[int]]:
    """The manifests of all ranks for a split, and the ranks that are missing or incomplete."""
    meta = read_meta(cache_dir)
    world = int(meta["layout"]["world_size"])
    found, incomplete = [], []
    for r in range(world):
        p = Manifest.path(Path(cache_dir), split, r, world)
        if not p.is_file():
            incomplete.append(r)
            continue
        m = Manifest.load(p)
        found.append(m)
        if not m.complete:
            incomplete.append(r)
    return found, incomplete


def _np(arr: pa.Array) -> np.ndarray:
    if arr.offset != 0:
        raise CacheError("unexpected sliced Arrow array in a cache shard")
    return arr.to_numpy(zero_copy_only=True)


def shard_storage(sch: pa.Schema) -> tuple[str, str | None]:
    """(storage, dtype) a shard's schema metadata says it holds (shards from before `storage` are exact)."""
    meta = {k.decode(): v.decode() for k, v in (sch.metadata or {}).items()}
    return meta.get("eagle3_storage", "exact"), meta.get("eagle3_dtype")


class _Batch:
    """Zero-copy numpy views of one record batch's columns (offsets + flat values)."""

    def __init__(self, rb: pa.RecordBatch, torch_dtype: torch.dtype):
        self.rb = rb
        self.offsets = _np(rb.column("input_ids").offsets)
        self.ids = _np(rb.column("input_ids").values)
        self.mask = _np(rb.column("loss_mask").values)
        self.aux = _np(rb.column("aux").values.values)
        self.final = _np(rb.column("final").values.values)
        self.width_aux = rb.schema.field("aux").type.value_type.list_size
        self.width_final = rb.schema.field("final").type.value_type.list_size
        self.dtype = torch_dtype
        self.sample_ids = rb.column("sample_id")
        self.argmax = _np(rb.column("target_argmax").values)
        names = rb.schema.names
        self.scales = {k: _np(rb.column(f"{k}_scale").values.values) for k in ("aux", "final") if f"{k}_scale" in names}

    def item(self, r: int) -> dict[str, Any]:
        """Row `r` as tensors viewing the mapped record batch (see HiddenStateDataset)."""
        s, e = int(self.offsets[r]), int(self.offsets[r + 1])
        t = e - s
        item = {
            "sample_id": self.sample_ids[r].as_py(),
            "input_ids": torch.from_numpy(self.ids[s:e].astype(np.int64)),
            "loss_mask": _tensor(self.mask[s:e], torch.int8),
            "aux": _tensor(self.aux[s * self.width_aux:e * self.width_aux], self.dtype).view(t, self.width_aux),
            "final": _tensor(self.final[s * self.width_final:e * self.width_final], self.dtype).view(t, self.width_final),
        }
        for key, flat in self.scales.items():
            parts = 3 if key == "aux" else 1
            item[f"{key}_scale"] = torch.from_numpy(flat[s * parts:e * parts]).view(t, parts)
        item["target_argmax"] = torch.from_numpy(self.argmax[s:e].astype(np.int64))
        return item


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap: the tensors are views, never written
        if a.dtype == np.uint8:  # fp8 storage: the bytes of float8_e4m3fn values
            return torch.from_numpy(a).view(torch.float8_e4m3fn)
        if dtype in (torch.bfloat16, torch.float16):
            return torch.from_numpy(a.view(np.int16)).view(dtype)
        return torch.from_numpy(a)


class HiddenStateDataset(torch.utils.data.Dataset):
    """One split of a cache as a torch Dataset; items are zero-copy views of the memory-mapped shards.

    `item["aux"]` is [T, 3H] and `item["final"]` [T, H] in the target dtype; `input_ids` int64 [T];
    `loss_mask` int8 [T]; `target_argmax` int64 [T] (the target's full-vocab argmax, a target token id). In an fp8 cache the fp8 states come as float8_e4m3fn with `aux_scale` [T, 3] / `final_scale`
    [T, 1] float32 beside them: `eagle3.storage.dense(item, ds.dtype)` dequantises (the trainer does it on its
    device, after collation). The tensors share memory with the file mapping: copy before writing into them.
    """

    def __init__(self, cache_dir: str | Path, split: str = "train", allow_incomplete: bool = False,
                 expected: dict[str, Any] | None = None):
        self.cache_dir = Path(cache_dir)
        self.meta = read_meta(cache_dir)
        if expected is not None:
            check_fingerprint(cache_dir, expected)
        self.fingerprint = self.meta["fingerprint"]
        self.dtype = DTYPES[self.fingerprint["dtype"]]
        self.hidden_size = int(self.fingerprint["hidden_size"])
        self.layer_ids = list(self.fingerprint["layer_ids"])
        self.storage = self.fingerprint["storage"]
        found, incomplete = manifests(cache_dir, split)
        if incomplete and not allow_incomplete:
            raise CacheError(f"cache {cache_dir} split {split!r} is incomplete: rank(s) {incomplete} have not "
                             f"finished; re-run the same extract command (it resumes) or pass allow_incomplete")
        self._batches: list[_Batch] = []
        self._maps: list[pa.MemoryMappedFile] = []
        where_b, where_r, lengths = [], [], []
        for m in sorted(found, key=lambda m: m.rank):
            if m.fingerprint is not None and fingerprint_diff(m.fingerprint, self.fingerprint):
                raise CacheError(f"{Manifest.path(self.cache_dir, split, m.rank, m.world_size)}: its shards were "
                                 f"extracted with {fingerprint_diff(m.fingerprint, self.fingerprint)} against "
                                 f"{self.cache_dir / 'meta.json'}; the cache mixes two jobs: extract into a new folder")
            for s in sorted(m.shards, key=lambda s: s.index):
                for rb in self._open_shard(split, s):
                    self._batches.append(_Batch(rb, self.dtype))
                    n = rb.num_rows
                    where_b.append(np.full(n, len(self._batches) - 1, dtype=np.int64))
                    where_r.append(np.arange(n, dtype=np.int64))
                    lengths.append(_np(rb.column("num_tokens")))
        def cat(xs: list[np.ndarray], dt: type) -> np.ndarray:
            return np.concatenate(xs) if xs else np.zeros(0, dtype=dt)

        self._where_b, self._where_r = cat(where_b, np.int64), cat(where_r, np.int64)
        self.num_tokens: np.ndarray = cat(lengths, np.int32)

    def _open_shard(self, split: str, entry: ShardEntry) -> list[pa.RecordBatch]:
        """One shard's record batches, mapped; its size and row count checked against the manifest (free, unlike
        the checksum), and a shard Arrow cannot read named instead of surfacing as a pyarrow traceback."""
        path = self.cache_dir / split / entry.file
        problem = shard_problem(path, entry, full=False)
        try:
            if problem is None:
                mm = pa.memory_map(str(path), "r")
                self._maps.append(mm)
                stream = pa.ipc.open_stream(mm)
                self._check_shard(split, entry.file, stream.schema)
                batches = list(stream)
                rows = sum(rb.num_rows for rb in batches)
                if rows != entry.num_samples:
                    problem = f"{rows} samples where the manifest records {entry.num_samples}"
        except (pa.ArrowException, OSError) as e:
            problem = f"unreadable ({e})"
        if problem is not None:
            raise damaged_error(self.cache_dir, [f"{split}/{entry.file}: {problem}"])
        return batches

    def _check_shard(self, split: str, file: str, sch: pa.Schema) -> None:
        """Every shard must hold what meta.json says: a shard copied in from a cache of another storage or dtype
        would otherwise be read with the wrong layout or trained on beside states of another precision."""
        storage, dtype = shard_storage(sch)
        want = str(self.dtype).removeprefix("torch.")
        if storage != self.storage or (dtype is not None and dtype != want):
            raise CacheError(f"cache {self.cache_dir}: shard {split}/{file} stores {dtype} states as {storage!r}, but "
                             f"the cache (meta.json) is {want} as {self.storage!r}; shards of different storage or "
                             "dtype are never mixed: extract it again into its own extract.cache_dir")

    def __len__(self) -> int:
        return len(self._where_b)

    @property
    def lengths(self) -> list[int]:
        """Token count of every item (for token-budget batching), in index order."""
        return self.num_tokens.tolist()

    @property
    def sample_ids(self) -> list[str]:
        """Every item's prepared sample id, in index order (extraction stores shards by rank and length, and skips a
        sample with NaN states: index i is not the prepared split's row i)."""
        return [sid for b in self._batches for sid in b.sample_ids.to_pylist()]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for a cache split of {len(self)} samples")
        return self._batches[int(self._where_b[i])].item(int(self._where_r[i]))

    def iter_collated(self, index_batches: list[list[int]], pin: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Collated batches of `index_batches`, prefetched in a thread (`pin`: pinned for a CUDA copy)."""
        from eagle3.batching import iter_batches

        return iter_batches(self, index_batches, pin=pin)


# ---------------------------------------------------------------------------------------------------- convert
@writes(lambda dst, **_: dst, "cache convert")
def convert(src: str | Path, dst: str | Path, storage: str) -> dict[str, Any]:
    """Re-store a complete exact cache as `storage` into a new folder, shard by shard and record batch by record
    batch, so the result is byte-identical to extracting with `extract.storage=<storage>` (same batches, same
    quantiser) without running the target again. Built in a hidden sibling and renamed into place when whole.

        eagle3 cache convert runs/smollm2-135m/cache runs/smollm2-135m/cache-fp8 --storage fp8
    """
    src, dst = Path(src), Path(dst)
    meta = read_meta(src)
    fp = meta["fingerprint"]
    problems = verify_cache(src)
    if problems:  # converting a damaged shard would pass its damage on under a fresh checksum
        raise damaged_error(src, problems)
    if fp["storage"] != "exact":
        raise CacheError(f"cache {src} is stored as {fp['storage']!r}; only an exact cache can be converted (a "
                         "lossy one would pass its rounding off as the target's states)")
    fp8_states(storage)
    if dst.exists():
        raise CacheError(f"{dst} already exists: convert writes a new cache folder")
    dtype, hidden = DTYPES[fp["dtype"]], int(fp["hidden_size"])
    tmp = tmp_sibling(dst, "convert")
    shutil.rmtree(tmp, ignore_errors=True)
    tokens = 0
    try:
        for split in SPLITS:
            found, incomplete = manifests(src, split)
            if incomplete:
                raise CacheError(f"cache {src} split {split!r} is incomplete (ranks {incomplete}): finish the "
                                 "extraction first")
            (tmp / split).mkdir(parents=True)
            for m in found:
                entries = []
                for e in sorted(m.shards, key=lambda s: s.index):
                    with pa.memory_map(str(src / split / e.file), "r") as mm:
                        w = ShardWriter(tmp / split / e.file, hidden, dtype, storage=storage)
                        for rb in pa.ipc.open_stream(mm):
                            b = _Batch(rb, dtype)
                            w.write([b.item(r) for r in range(rb.num_rows)])
                        entries.append(w.commit(e.index, e.skipped_nonfinite))
                    tokens += w.num_tokens
                Manifest(split, m.rank, m.world_size, m.planned_samples, m.planned_shards, entries,
                         fingerprint={**fp, "storage": storage}, layout=meta["layout"]).save(tmp)
        write_json_atomic(tmp / "meta.json", {**meta, "fingerprint": {**fp, "storage": storage}})
        replace_dir(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"tokens": tokens, "bytes": sum(p.stat().st_size for p in dst.rglob("*.arrow"))}


# ---------------------------------------------------------------------------------------------------- upgrade
_ARGMAX_SOURCE = ("weights_id", "dtype", "hidden_size", "architectures")
"""The fingerprint fields that decide the target's argmax: an upgrade must read the lm_head the states came from."""


@writes(lambda cache_dir, **_: cache_dir, "cache upgrade")  # extract refuses format 1: no rank parts to meet
def upgrade(cache_dir: str | Path, argmax: Any, expected: dict[str, Any]) -> int:
    """Upgrade a format-1 cache to format 2 in place: each shard gains its `target_argmax` column (computed once
    here with `argmax`, an eagle3.loss.ArgmaxHead of the cache's target) and a checksum; every other byte of its
    record batches is kept. Shard by shard, each renamed into place whole and its manifest saved after it, so a
    killed upgrade resumes where it stopped; meta.json says format 2 only at the very end. Returns the number of
    shards rewritten.

        eagle3 cache upgrade runs/smollm2-135m/cache --config configs/smollm2-135m.yaml
    """
    cache_dir = Path(cache_dir)
    meta = read_meta(cache_dir, upgraded=False)
    fp = {"storage": "exact", **meta["fingerprint"], "format": FORMAT_VERSION}  # format 1 predates `storage`
    if meta["fingerprint"].get("format") == FORMAT_VERSION:
        return 0
    diff = fingerprint_diff({k: fp.get(k) for k in _ARGMAX_SOURCE}, {k: expected.get(k) for k in _ARGMAX_SOURCE})
    if diff:
        raise CacheError(f"cannot upgrade cache {cache_dir} with this config's target: the cache "
                         + "; ".join(diff) + ". The argmax must come from the target the states came from.")
    world, rewritten = int(meta["layout"]["world_size"]), 0
    for split in SPLITS:
        for rank in range(world):
            path = Manifest.path(cache_dir, split, rank, world)
            if not path.is_file():
                continue
            m = Manifest.load(path)
            for i, e in enumerate(m.shards):
                if not e.sha256:  # else upgraded by an earlier, interrupted run
                    m.shards[i], did = _upgrade_shard(cache_dir / split, e, fp, argmax)
                    rewritten += did
                    m.save(cache_dir)
            m.fingerprint, m.layout = fp, meta["layout"]
            m.save(cache_dir)
    write_json_atomic(cache_dir / "meta.json", {**meta, "fingerprint": fp})
    return rewritten


def _upgrade_shard(split_dir: Path, entry: ShardEntry, fp: dict[str, Any], argmax: Any) -> tuple[ShardEntry, bool]:
    from eagle3.storage import dense

    path = split_dir / entry.file
    problem = shard_problem(path, entry, full=False)
    if problem is not None:  # left for extract to redo: its checksum will not match
        log.warning("%s: %s; not upgraded: re-run `eagle3 extract` after the upgrade to re-extract it", path, problem)
        return entry, False
    dtype, hidden, storage = DTYPES[fp["dtype"]], int(fp["hidden_size"]), fp["storage"]
    with pa.memory_map(str(path), "r") as mm:
        stream = pa.ipc.open_stream(mm)
        if "target_argmax" in stream.schema.names:  # rewritten before a kill hit the manifest save
            return ShardEntry(**{**entry.__dict__, "bytes": path.stat().st_size, "sha256": sha256_file(path)}), False
        w = ShardWriter(path, hidden, dtype, storage=storage)
        try:
            for rb in stream:
                offsets = _np(rb.column("final").offsets)
                finals = _np(rb.column("final").values.values)
                scales = _np(rb.column("final_scale").values.values) if "final_scale" in rb.schema.names else None
                ids = []
                for r in range(rb.num_rows):
                    s, e = int(offsets[r]), int(offsets[r + 1])
                    item = {"final": _tensor(finals[s * hidden:e * hidden], dtype).view(e - s, hidden)}
                    if scales is not None:  # fp8: the argmax of what the trainer reads
                        item["final_scale"] = torch.from_numpy(scales[s:e])[:, None]
                    ids.append(argmax(dense(item, dtype)["final"]).numpy().astype(np.int32))
                column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(ids), type=pa.int32()))
                w.write_batch(pa.RecordBatch.from_arrays([*rb.columns, column], schema=w.schema))
            return w.commit(entry.index, entry.skipped_nonfinite), True
        except BaseException:
            w.abort()
            raise


# ------------------------------------------------------------------------------------------------------- info
def payload_bytes_per_token(hidden_size: int, dtype: str, storage: str = "exact") -> int:
    """The least a cache of `storage` can take per token: aux + final states (with their fp8 scales), an int32
    id and an int8 mask."""
    item = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    return state_bytes_per_token(hidden_size, item, storage) + 4 + 1


def summary(cache_dir: str | Path) -> dict[str, Any]:
    meta = read_meta(cache_dir)
    out: dict[str, Any] = {"fingerprint": meta["fingerprint"], "layout": meta["layout"], "splits": {}}
    for split in SPLITS:
        found, incomplete = manifests(cache_dir, split)
        shards = [s for m in found for s in m.shards]
        out["splits"][split] = {
            "samples": sum(s.num_samples for s in shards), "tokens": sum(s.num_tokens for s in shards),
            "skipped_nonfinite": sum(len(s.skipped_nonfinite) for s in shards),
            "bytes": sum(s.bytes for s in shards), "shards": len(shards),
            "planned_samples": sum(m.planned_samples for m in found), "incomplete_ranks": incomplete,
        }
    return out


def print_info(cache_dir: str | Path, verify: bool = False) -> int:
    """Print the cache's summary and check its shards: present at their recorded sizes (free), and with `verify`
    their SHA-256 (reads the whole cache). A missing or damaged shard is a CacheError naming it."""
    s = summary(cache_dir)
    fp = s["fingerprint"]
    storage = fp["storage"]
    payload = payload_bytes_per_token(fp["hidden_size"], fp["dtype"], storage)
    exact = payload_bytes_per_token(fp["hidden_size"], fp["dtype"])
    print(f"cache {cache_dir}")
    print(f"  storage: {storage} ({fp['dtype']} target; payload {payload} bytes/token = {payload / exact:.3f}x the "
          f"exact {fp['dtype']} payload of {exact})")
    for split, d in s["splits"].items():
        bpt = d["bytes"] / d["tokens"] if d["tokens"] else 0.0
        state = "complete" if not d["incomplete_ranks"] else f"INCOMPLETE (ranks {d['incomplete_ranks']} not done)"
        print(f"  {split}: {d['samples']} samples, {d['tokens']} tokens, {d['bytes'] / 1e6:.1f} MB in "
              f"{d['shards']} shards, {bpt:.1f} bytes/token (payload minimum {payload}: "
              f"{bpt / payload if payload else 0:.3f}x"
              + (f"; {bpt / exact:.3f}x the exact {fp['dtype']} payload" if storage != "exact" else "")
              + f"), {state}"
              + (f", {d['skipped_nonfinite']} samples skipped (non-finite states)" if d["skipped_nonfinite"] else ""))
    print(f"  layer ids: {fp['layer_ids']} ({fp['layer_id_convention']}: id k = input of decoder layer k)")
    print(f"  layout: {s['layout']}")
    print("  fingerprint:")
    for k, v in fp.items():
        print(f"    {k}: {v}")
    problems = verify_cache(cache_dir, full=verify)  # without `verify`: every shard there, at its recorded size
    if problems:
        raise damaged_error(Path(cache_dir), problems)
    shards = sum(d["shards"] for d in s["splits"].values())
    print(f"  integrity: all {shards} shards intact ("
          + ("size and SHA-256 as the manifests record)" if verify else
             "present at their recorded sizes; `--verify` checks their SHA-256 too)"))
    return 0
