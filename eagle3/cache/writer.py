"""Writing the cache: a shard streamed into a temporary file and renamed into place whole, and what extraction needs
of the layout (which samples each rank's shards hold, meta.json created, checked or rebuilt, a rank's manifest
loaded with its shards verified, stale temporaries removed, the work and the disk left)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import torch

from eagle3.cache.codec import CacheError, payload_bytes_per_token, record_batch, schema
from eagle3.cache.layout import (
    Manifest,
    ShardEntry,
    damaged_shards,
    fingerprint_diff,
    rank_stem,
    read_meta,
)
from eagle3.fsutil import sha256_file, write_json_atomic

log = logging.getLogger("eagle3")


class ShardWriter:
    """Streams record batches into `<final>.tmp` and renames it into place on `commit()`, so a shard file that
    exists is always whole (a kill at any moment leaves at most a stale .tmp, removed on restart)."""

    def __init__(self, path: Path, hidden_size: int, dtype: torch.dtype, storage: str = "exact",
                 images: bool = False):
        self.path, self.hidden_size, self.dtype, self.storage = path, hidden_size, dtype, storage
        self.images = images
        self.tmp = path.with_name(path.name + ".tmp")
        self._sink = pa.OSFile(str(self.tmp), "wb")
        self.schema = schema(hidden_size, dtype, storage, images)
        self._writer = pa.ipc.new_stream(self._sink, self.schema)
        self.num_samples = 0
        self.num_tokens = 0

    def write(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.write_batch(record_batch(rows, self.hidden_size, self.dtype, self.storage, self.images))

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

