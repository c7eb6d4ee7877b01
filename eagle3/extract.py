"""Offline extraction: prepared samples -> target hidden states -> the sharded Arrow cache (eagle3.cache).

    eagle3 extract --config configs/smollm2-135m.yaml
    accelerate launch --num_processes 8 extract.py --config configs/kimi-k2.5.yaml

Extraction of a big target runs for hours, so it is built to be killed:
- Work is cut into shards fixed in advance: rank r of W owns samples r, r+W, r+2W, ... of each split, and its
  shard i is items [i*S, (i+1)*S) of that list. A re-run recomputes exactly the missing shards, in the same
  batches, so the finished cache is byte-identical to an uninterrupted run's.
- A shard is streamed into `*.tmp` and renamed into place when whole; the rank's manifest is rewritten
  atomically only after that, so a SIGKILL at any moment leaves at most a stale .tmp (deleted on restart) or a
  shard the manifest does not list yet (recomputed, same bytes).
- Ranks share nothing but the cache folder: each writes its own shards and manifest; readers wait for all.
- Preflight before the long part: disk space for the estimated size, the target loads, one sample's states
  come back with the prompt's token count.

Everything about the cache's files (which shard holds which samples, meta.json, manifests, stale temporaries, the
disk estimate) is eagle3.cache's; this module runs the target over the work that is left and writes shards.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.compute as pc
import torch

from eagle3.cache import (
    SPLITS,
    CacheError,
    Manifest,
    ShardEntry,
    ShardWriter,
    clean_stale_tmp,
    expected_fingerprint,
    load_manifest,
    open_cache,
    payload_bytes_per_token,
    plan_rank,
    preflight_disk,
    remaining_tokens,
    shard_name,
)
from eagle3.data.prepared import check_prepared, load_prepared
from eagle3.locks import writes
from eagle3.logs import Progress, disk_full_error, setup_logging
from eagle3.process import this_process
from eagle3.targets.argmax import ArgmaxHead

if TYPE_CHECKING:
    from eagle3.config import Config, ExtractConfig

log = logging.getLogger("eagle3")

_DTYPE_NAMES = {"bfloat16", "float16", "float32"}


def sample_lengths(ds: Any) -> np.ndarray:
    """Token count of every row, straight from the Arrow column (no Python loop over 10K samples)."""
    if getattr(ds, "_indices", None) is None:
        return pc.list_value_length(ds.data.column("input_ids")).to_numpy().astype(np.int64)
    return np.array([len(x) for x in ds["input_ids"]], dtype=np.int64)


@dataclass
class Job:
    split: str
    shard: int
    rows: list[int]


def _check_backend(backend: Any, fp: dict[str, Any]) -> None:
    got = {"hidden_size": backend.hidden_size, "num_layers": backend.num_layers, "layer_ids": list(backend.layer_ids)}
    want = {k: fp[k] for k in got}
    if got != want:
        raise CacheError(f"the loaded target does not match its config.json: backend reports {got}, expected {want}")


def _preflight_sample(backend: Any, ids: list[int], hidden: int, images: list[str] | None = None) -> None:
    t0 = time.monotonic()
    c = backend.capture([ids])[0] if images is None else backend.capture([ids], [images])[0]
    if c.aux.shape != (len(ids), 3 * hidden) or c.final.shape != (len(ids), hidden):
        raise CacheError(f"preflight: a {len(ids)}-token prompt came back with states {tuple(c.aux.shape)} / "
                         f"{tuple(c.final.shape)}; expected ({len(ids)}, {3 * hidden}) / ({len(ids)}, {hidden}). "
                         "Missing tokens usually mean prefix caching or chunked prefill in the serving engine.")
    if not finite(c):
        log.warning("preflight: the target returned NaN/inf hidden states for the first sample; such samples are "
                    "skipped and counted (if most are, the target dtype overflows: try target.dtype=bfloat16)")
    log.info("preflight: one %d-token sample captured in %.2fs, token count matches", len(ids), time.monotonic() - t0)


def finite(c: Any) -> bool:
    """Whether one sample's captured states are all finite (a NaN/inf state must never be trained on)."""
    return bool(torch.isfinite(c.aux).all() and torch.isfinite(c.final).all())


def _disk_full(e: BaseException, path: Path, cache_dir: Path, tokens_left: int, hidden: int, dtype: str,
               committed: int, storage: str = "exact") -> CacheError:
    per_token = payload_bytes_per_token(hidden, dtype, storage)
    need = tokens_left * per_token
    try:
        free = f"{shutil.disk_usage(cache_dir).free / 1e9:.3f} GB"
    except OSError:
        free = "unknown"
    return CacheError(
        f"disk full while writing {path}: about {need / 1e9:.3f} GB is still needed for the {tokens_left} tokens "
        f"left to extract ({per_token} bytes/token), {free} free on {cache_dir}. "
        f"The {committed} shard(s) committed before are intact and the partial shard was removed; free space "
        f"(or set extract.cache_dir to a bigger disk) and re-run the same command: it resumes. ({e})")


@writes(lambda cfg, **_: cfg.cache_dir, "extract", per_rank=True)  # ranks share the cache, one part each
def run(cfg: Config, backend: Any = None) -> dict[str, Any]:
    """Extract this rank's missing shards of every prepared split into `cfg.cache_dir` (`backend`: a target
    already open, else the config's)."""
    work = plan(cfg)
    if not work.jobs:
        return {"rank": work.rank, "shards": 0, "samples": 0, "tokens": 0, "seconds": 0.0}
    return extract_all(work, open_target(work, backend))


@dataclass
class Work:
    """This rank's part of an extraction: what the cache lacks of it, and what it is checked against."""

    cfg: Config
    rank: int
    world: int
    data: dict[str, Any]
    """The prepared splits (datasets)."""
    lengths: dict[str, np.ndarray]
    fp: dict[str, Any]
    """The fingerprint the cache is extracted with (eagle3.cache.expected_fingerprint)."""
    jobs: list[Job]
    manifests: dict[str, Manifest]

    @property
    def cache_dir(self) -> Path:
        return self.cfg.cache_dir

    @property
    def images(self) -> bool:
        """The samples hold images (a prepared `images` column): the target runs its vision tower."""
        return "images" in self.data["train"].column_names

    @property
    def samples(self) -> int:
        return sum(len(j.rows) for j in self.jobs)

    @property
    def tokens(self) -> int:
        return sum(int(self.lengths[j.split][j.rows].sum()) for j in self.jobs)


def plan(cfg: Config) -> Work:
    """The cache opened (meta.json created, or checked against this config) and this rank's missing shards, with
    the disk they need checked before anything runs."""
    setup_logging()
    place = this_process()
    rank, world = place.rank, place.world
    if world > 1 and cfg.target.device == "cuda":
        cfg.target.device = f"cuda:{place.local_rank}"
    cache_dir = cfg.cache_dir
    prepared = load_prepared(cfg.prepared_dir)
    check_prepared(cfg.data, cfg.draft, cfg.target, cfg.prepared_dir, prepared.meta, "extract")
    fp = expected_fingerprint(cfg.target, cfg.extract.storage, prepared.meta)
    layout = {"world_size": world, "shard_samples": cfg.extract.shard_samples, "max_samples": cfg.extract.max_samples}
    open_cache(cache_dir, fp, layout, rank)
    data = {"train": prepared.train, "eval": prepared.eval}
    lengths = {split: sample_lengths(ds) for split, ds in data.items()}
    if cfg.extract.max_samples is not None:  # train only: the eval split is small and the trainer needs it whole
        lengths["train"] = lengths["train"][: cfg.extract.max_samples]
    jobs, manifests = _plan_jobs(cache_dir, lengths, fp, layout, rank)
    work = Work(cfg, rank, world, data, lengths, fp, jobs, manifests)
    if not jobs:
        log.info("rank %d/%d: cache %s already holds all its shards; nothing to do", rank, world, cache_dir)
    else:
        log.info("rank %d/%d: %d shard(s), %d samples, %d tokens to extract into %s", rank, world, len(jobs),
                 work.samples, work.tokens, cache_dir)
    if jobs and cfg.extract.preflight:
        preflight_disk(cache_dir, remaining_tokens(cache_dir, world, lengths, cfg.extract.shard_samples),
                       fp["hidden_size"], fp["dtype"], storage=fp["storage"])
    return work


def open_target(work: Work, backend: Any = None) -> Any:
    """The target backend (`backend`, or the config's), checked to be the one the fingerprint names, and (with
    extract.preflight) run on this rank's first sample before any shard is started."""
    if backend is None:
        from eagle3.targets import make_backend

        cfg = work.cfg
        backend = make_backend(cfg.target, cfg.extract, cfg.data.max_length, cfg.paths.logs_dir, images=work.images)
    _check_backend(backend, work.fp)
    if work.cfg.extract.preflight and work.jobs:
        first = work.jobs[0]
        row = work.data[first.split][first.rows[0]]
        _preflight_sample(backend, list(row["input_ids"]), work.fp["hidden_size"], row.get("images"))
    return backend


def extract_all(work: Work, backend: Any) -> dict[str, Any]:
    """Every planned shard, in order: the target's states and argmax written to a shard, its manifest saved after
    it (a kill loses at most the shard in progress); what was done, logged and returned."""
    cfg, fp, rank, world, cache_dir = work.cfg, work.fp, work.rank, work.world, work.cache_dir
    todo_samples, todo_tokens = work.samples, work.tokens
    done = _Done(time.monotonic())
    argmax = ArgmaxHead.for_backend(backend, cfg.target, cfg.extract.teacher_chunk)
    with Progress(todo_samples, f"extract rank {rank}/{world}", unit="samples") as prog:
        for job in work.jobs:
            tokens_at_start, committed = done.tokens, sum(len(m.shards) for m in work.manifests.values())
            try:
                entry = _extract_shard(cfg.extract, cache_dir, backend, argmax, work.data[job.split],
                                       work.lengths[job.split], job, fp, rank, world, done, prog)
            except BaseException as e:
                if disk_full_error(e) is not None:
                    path = cache_dir / job.split / shard_name(rank, world, job.shard)
                    raise _disk_full(e, path, cache_dir, todo_tokens - tokens_at_start, fp["hidden_size"],
                                     fp["dtype"], committed, fp["storage"]) from e
                raise
            work.manifests[job.split].shards.append(entry)
            work.manifests[job.split].save(cache_dir)
            done.nonfinite += len(entry.skipped_nonfinite)
    return _report(done, rank, world, todo_samples, len(work.jobs), cache_dir, fp)


@dataclass
class _Done:
    """What this rank's extraction has done so far (progress, rates)."""

    t0: float
    tokens: int = 0
    nonfinite: int = 0


def _plan_jobs(cache_dir: Path, lengths: dict[str, np.ndarray], fp: dict[str, Any], layout: dict[str, Any],
               rank: int) -> tuple[list[Job], dict[str, Manifest]]:
    """This rank's shards still missing from the cache, and its manifests (saved: a rank with nothing to do is
    complete right away)."""
    world = layout["world_size"]
    jobs: list[Job] = []
    manifests: dict[str, Manifest] = {}
    for split in SPLITS:
        split_dir = cache_dir / split
        split_dir.mkdir(exist_ok=True)
        clean_stale_tmp(split_dir, rank, world)
        plan = plan_rank(len(lengths[split]), rank, world, layout["shard_samples"])
        m = manifests[split] = load_manifest(cache_dir, split, rank, world, plan, fp, layout)
        m.save(cache_dir)
        done = {s.index for s in m.shards}
        jobs += [Job(split, i, rows) for i, rows in enumerate(plan) if i not in done]
    return jobs, manifests


def _extract_shard(ec: ExtractConfig, cache_dir: Path, backend: Any, argmax: Any, ds: Any, lens: np.ndarray, job: Job,
                   fp: dict[str, Any], rank: int, world: int, done: _Done, prog: Progress) -> ShardEntry:
    """One shard: the target over its planned batches, streamed into `*.tmp` and renamed into place when whole
    (removed if anything fails); NaN/inf samples skipped and listed."""
    from eagle3.batching import plan_batches

    name = shard_name(rank, world, job.shard)
    skipped: list[str] = []
    images = bool(fp.get("image_embeds"))
    writer = ShardWriter(cache_dir / job.split / name, fp["hidden_size"], backend.dtype, storage=fp["storage"],
                         images=images)
    try:
        for batch in plan_batches([int(lens[i]) for i in job.rows], ec.batch_tokens, ec.max_batch_size):
            rows = ds[[job.rows[b] for b in batch]]
            caps = backend.capture(rows["input_ids"], rows["images"]) if "images" in rows else backend.capture(
                rows["input_ids"])
            keep = []
            for sid, ids, mask, c in zip(rows["id"], rows["input_ids"], rows["loss_mask"], caps, strict=True):
                if finite(c):
                    keep.append({"sample_id": sid, "input_ids": ids, "loss_mask": mask, "aux": c.aux,
                                 "final": c.final, "target_argmax": argmax(c.final)})
                    if images:  # where the serving engine feeds the draft the pictures: those rows only
                        keep[-1] |= {"image_positions": np.flatnonzero(np.asarray(ids) == backend.vision.image_token_id),
                                     "image_embeds": c.image_embeds.to(backend.dtype), "positions": c.positions}
                else:  # skipped and counted; the manifest lists it, so `cache info` shows it
                    skipped.append(sid)
                    log.warning("%s sample %r: the target returned NaN/inf hidden states; skipped (not written to "
                                "the cache, never trained on)", job.split, sid)
            writer.write(keep)
            done.tokens += sum(len(x) for x in rows["input_ids"])
            prog.update(len(batch), tok_s=f"{done.tokens / max(time.monotonic() - done.t0, 1e-9):.0f}")
        return writer.commit(job.shard, skipped)
    except BaseException:
        writer.abort()
        raise


def _report(done: _Done, rank: int, world: int, todo_samples: int, shards: int, cache_dir: Path,
            fp: dict[str, Any]) -> dict[str, Any]:
    dt = time.monotonic() - done.t0
    log.info("rank %d/%d: extracted %d samples, %d tokens in %.1fs (%.0f tokens/s)", rank, world, todo_samples,
             done.tokens, dt, done.tokens / max(dt, 1e-9))
    if done.nonfinite:
        log.warning("rank %d/%d: %d of %d samples skipped because the target returned NaN/inf hidden states "
                    "(listed per shard in the manifests; `eagle3 cache info %s` counts them)", rank, world,
                    done.nonfinite, todo_samples, cache_dir)
        if done.nonfinite == todo_samples:
            raise CacheError(f"every sample gave NaN/inf hidden states: the target overflows in {fp['dtype']} "
                             "(try target.dtype=bfloat16 or float32) or its weights are broken")
    return {"rank": rank, "shards": shards, "samples": todo_samples, "tokens": done.tokens, "seconds": dt,
            "skipped_nonfinite": done.nonfinite}
