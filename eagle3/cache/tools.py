"""The cache's maintenance tools: re-store an exact cache as fp8 (`convert`), bring a format-1 cache to format 2 in
place (`upgrade`), and what `eagle3 cache info` prints (`summary`, `print_info`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from eagle3.cache.codec import (
    CacheError,
    DecodedBatch,
    codec_for,
    column_np,
    dense,
    payload_bytes_per_token,
    state_tensor,
)
from eagle3.cache.layout import (
    FORMAT_VERSION,
    SPLITS,
    Manifest,
    ShardEntry,
    damaged_error,
    fingerprint_diff,
    manifests,
    read_meta,
    shard_problem,
    verify_cache,
)
from eagle3.cache.writer import ShardWriter
from eagle3.fsutil import replace_dir, sha256_file, tmp_sibling, write_json_atomic
from eagle3.locks import writes
from eagle3.precision import DTYPES

log = logging.getLogger("eagle3")


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
    codec_for(storage)  # an unknown storage is refused before anything is written
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
                        w = ShardWriter(tmp / split / e.file, hidden, dtype, storage=storage,
                                        images=bool(fp.get("image_embeds")))
                        for rb in pa.ipc.open_stream(mm):
                            b = DecodedBatch(rb, dtype)
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
    here with `argmax`, an eagle3.targets.argmax.ArgmaxHead of the cache's target) and a checksum; every other byte of its
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
                offsets = column_np(rb.column("final").offsets)
                finals = column_np(rb.column("final").values.values)
                scales = column_np(rb.column("final_scale").values.values) if "final_scale" in rb.schema.names else None
                ids = []
                for r in range(rb.num_rows):
                    s, e = int(offsets[r]), int(offsets[r + 1])
                    item = {"final": state_tensor(finals[s * hidden:e * hidden], dtype).view(e - s, hidden)}
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