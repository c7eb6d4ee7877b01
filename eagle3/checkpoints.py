"""The trainer's checkpoint folder, `<output_dir>/checkpoints/`, and finding the draft to evaluate or export.

    checkpoints/step_N/    accelerate state (weights, optimizer, scheduler, RNG) + trainer_state.json (TrainState)
                           + vocab.safetensors + draft/ (the head as eagle3.formats saves it)
                           + checksums.json (every other file's size and SHA-256)
    checkpoints/best/      the head with the best held-out simulated acceptance (a draft folder)

A folder gets its final name only once whole (built in a hidden sibling and renamed), so a listed checkpoint is
always complete; a save killed half-way leaves a hidden leftover, removed at the next start, and so does a prune
of older checkpoints (each renamed aside before it is deleted: `_prune`). A checkpoint damaged
later (a truncated copy, a bad disk) fails its checksums: resume says so and falls back to the newest intact one
(the data plan is a function of the step, so the run still matches an uninterrupted one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.config import EvalConfig, TrainConfig
from eagle3.data.prepared import load_vocab, save_vocab
from eagle3.formats import CONFIG_NAME, save_draft
from eagle3.fsutil import damaged_files, file_records, remove_dir, remove_stale_in, replace_dir, tmp_sibling
from eagle3.logs import UserError, disk_full_error
from eagle3.model import SHAPE_FIELDS, Eagle3DraftConfig
from eagle3.paths import RunPaths

log = logging.getLogger("eagle3")

STATE_FILE = "trainer_state.json"
CHECKSUMS = "checksums.json"


@dataclass
class TrainState:
    """Where the loop is; saved with every checkpoint (the data position makes resume exact)."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    """Micro-batches of `epoch` already consumed by this rank's plan."""
    best_accept_len: float = -1.0
    best_step: int = -1
    world_size: int | None = None
    """Processes that wrote the checkpoint: each rank's `batch_index` is a place in a plan made for this many
    ranks, so another world size cannot resume it (None: written before eagle3 recorded it)."""
    sequence_parallel: int | None = None
    """train.sequence_parallel of the run that wrote it: the plan is made for world / sequence_parallel groups."""


_STEP_DIR = re.compile(r"^step_(\d+)$")


def _step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Every `step_N` folder, oldest (smallest N) first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _STEP_DIR.match(p.name)))


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first (a folder only gets its final name once fully written)."""
    return [(n, p) for n, p in _step_dirs(ckpt_dir) if (p / STATE_FILE).is_file()]


def _tmp_dir(final: Path) -> Path:
    """An empty hidden sibling of `final` to build it in; every rank writes its part of the accelerate state into
    it, so the name is fixed (`tmp_sibling`)."""
    tmp = tmp_sibling(final, "ckpt")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def save_checkpoint(accelerator, model, state: TrainState, d2t: torch.Tensor, t2d: torch.Tensor, ckpt_dir: Path,
                    keep: int) -> Path:
    """step_N/: accelerate state (weights, optimizer, scheduler, RNG) + trainer_state.json + vocab + draft/; the
    newest `keep` (train.keep_checkpoints) step folders are kept."""
    final = ckpt_dir / f"step_{state.step}"
    tmp = tmp_sibling(final, "ckpt")
    previous = list_checkpoints(ckpt_dir)
    try:
        if accelerator.is_main_process:
            _tmp_dir(final)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()  # every rank's part written before the main process checksums and renames
        sd = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            save_draft(accelerator.unwrap_model(model), tmp / "draft", state_dict=sd)
            save_vocab(tmp / "vocab.safetensors", d2t, t2d)
            (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
            (tmp / CHECKSUMS).write_text(json.dumps(file_records(tmp, skip=(CHECKSUMS,)), indent=1) + "\n")
            replace_dir(tmp, final)
            _prune(ckpt_dir, keep)
            log.info("checkpoint: %s", final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_if_disk_full(e, final, ckpt_dir, previous)
        raise
    accelerator.wait_for_everyone()
    return final


def _prune(ckpt_dir: Path, keep: int) -> None:
    """Delete every step folder older than the newest `keep` complete ones, each renamed aside first (`remove_dir`):
    a save killed mid-delete leaves a hidden leftover cleared at the next start, never a half-deleted `step_N` that
    no longer counts as a checkpoint and so is never pruned (it also catches such folders left by older versions)."""
    complete = list_checkpoints(ckpt_dir)
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep][0]
    for n, path in _step_dirs(ckpt_dir):
        if n < oldest_kept:
            try:
                remove_dir(path)
            except OSError as e:  # a full disk refuses even the rename's folder: the new checkpoint is saved anyway
                log.warning("could not move %s aside to delete it (%s); deleting it in place", path, e)
                shutil.rmtree(path, ignore_errors=True)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _raise_if_disk_full(e: BaseException, final: Path, ckpt_dir: Path, previous: list[tuple[int, Path]]) -> None:
    """torch.save / safetensors report a full disk without naming the folder; say which checkpoint and how much."""

    need = _dir_bytes(previous[-1][1]) if previous else 0
    try:
        free = shutil.disk_usage(ckpt_dir).free
    except OSError:
        free = -1
    if disk_full_error(e) is None and not (previous and 0 <= free < need):
        return
    intact = f"{previous[-1][1]} is intact" if previous else "no earlier checkpoint exists"
    raise UserError(
        f"disk full while writing checkpoint {final}: about {need / 2**20:.0f} MB needed, {max(free, 0) / 2**20:.0f} MB "
        f"free; {intact}; free space and re-run the same command (it resumes)") from e


def check_same_draft(path: Path, current: Eagle3DraftConfig) -> None:
    """Refuse to resume into a head of other dimensions (torch would fail with a bare size mismatch)."""
    saved_file = path / "draft" / CONFIG_NAME
    if not saved_file.is_file():
        return
    saved = json.loads(saved_file.read_text())
    now = current.to_json()
    defaults = {f.name: f.default for f in dataclasses.fields(Eagle3DraftConfig)}  # fields older heads lack
    for key in (*SHAPE_FIELDS, "draft_vocab_size", "aux_layer_ids"):
        if saved.get(key, defaults[key]) != now.get(key):
            raise ValueError(f"checkpoint {path} was trained with draft.{key}={saved.get(key)}, the config asks for "
                             f"{now.get(key)}; use a new output_dir or train.resume=false")


def save_best(accelerator, model, checkpoint_dir: Path) -> Path:
    best = checkpoint_dir / "best"
    sd = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        tmp = _tmp_dir(best)
        save_draft(accelerator.unwrap_model(model), tmp, state_dict=sd)
        replace_dir(tmp, best)
    accelerator.wait_for_everyone()
    return best


def resume(accelerator: Any, model: Any, paths: RunPaths, train: TrainConfig, d2t: torch.Tensor) -> TrainState:
    """Load the newest intact checkpoint into `model` and the accelerator's registered objects when `train.resume`
    and there is one (after checking it was trained with the same draft vocab and dimensions); the loop's state.
    A damaged checkpoint is named and skipped for the one before it; none intact is an error."""
    state = TrainState()
    ckpts = list_checkpoints(paths.checkpoint_dir)
    damaged: list[str] = []
    for _, path in reversed(ckpts if train.resume else []):
        problems = checkpoint_problems(path)
        if not problems:
            check_same_vocab(path, d2t, paths.prepared_dir)
            check_same_draft(path, accelerator.unwrap_model(model).config)
            check_same_world(path, accelerator.num_processes, train.sequence_parallel)
            try:
                accelerator.load_state(str(path))
                state = TrainState(**json.loads((path / STATE_FILE).read_text()))
            except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
                problems = [f"it does not load ({type(e).__name__}: {str(e)[:200]})"]
        if problems:
            damaged.append(f"{path.name}: {'; '.join(problems)}")
            log.warning("checkpoint %s is damaged (%s); trying the one before it", path, "; ".join(problems))
            continue
        log.info("resumed from %s (step %d, epoch %d, batch %d)", path, state.step, state.epoch, state.batch_index)
        break
    if damaged and state.step == 0:
        raise UserError(f"every checkpoint in {paths.checkpoint_dir} is damaged ({' | '.join(damaged)}): move them "
                        "aside to start over, or set train.resume=false")
    if accelerator.is_main_process and paths.checkpoint_dir.is_dir():  # leftovers of a save that was killed
        remove_stale_in(paths.checkpoint_dir)
    return state


def checkpoint_problems(path: Path) -> list[str]:
    """What is wrong with a step folder's files against its checksums.json (a folder without one: unchecked)."""
    records_file = path / CHECKSUMS
    if not records_file.is_file():
        return []
    try:
        records = json.loads(records_file.read_text())
    except ValueError as e:
        return [f"{CHECKSUMS} is not valid JSON ({e})"]
    return damaged_files(path, records)


def check_same_world(path: Path, world: int, sequence_parallel: int = 1) -> None:
    """Refuse a checkpoint written by another number of processes or sequence-parallel groups, before anything of
    it is loaded."""
    try:
        saved = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return  # unreadable: the load below names it
    written, written_sp = saved.get("world_size"), saved.get("sequence_parallel") or 1
    if written_sp != sequence_parallel:
        raise UserError(
            f"checkpoint {path} was written with train.sequence_parallel={written_sp} and "
            f"this run has {sequence_parallel}: the epoch's data plan is made for world / sequence_parallel groups, "
            "so resuming would train on other data than the run it continues. Resume it with the same "
            f"train.sequence_parallel, or start a new output_dir from its weights with "
            f"draft.init_from={path / 'draft'}")
    if written is not None and written != world:
        raise UserError(
            f"checkpoint {path} was written by {written} processes and this run has {world}: each rank's place in "
            "the epoch's data plan depends on the number of processes, so resuming would train on other data than "
            f"the run it continues. Resume it with {written} processes (accelerate launch --num_processes "
            f"{written} ...), or start a new output_dir from its weights with draft.init_from={path / 'draft'} "
            "(the optimizer and schedule start afresh)")


def check_same_vocab(path: Path, d2t: torch.Tensor, prepared_dir: Path) -> None:
    saved_d2t, _ = load_vocab(path / "vocab.safetensors")
    if not torch.equal(saved_d2t, d2t):
        raise ValueError(f"checkpoint {path} was trained with another draft vocab than {prepared_dir}; "
                         "use a new output_dir or train.resume=false")


# ------------------------------------------------------------------------------------------ the draft to use
class CheckpointError(ValueError):
    """No usable draft where one was asked for; the message names the folder."""


def resolve_draft_folder(checkpoint: str | Path) -> Path:
    """A draft folder, a training step folder (its `draft/`), or an existing export -> the folder to read."""
    p = Path(checkpoint)
    if not p.exists():
        raise CheckpointError(f"{p}: does not exist")
    if (p / CONFIG_NAME).is_file():
        return p
    if (p / "draft" / CONFIG_NAME).is_file():
        return p / "draft"
    raise CheckpointError(f"{p}: neither a draft folder (config.json + model.safetensors) nor a checkpoint with "
                          "draft/")


def resolve_checkpoint(ev: EvalConfig, paths: RunPaths) -> Path:
    """The draft to evaluate: eval.checkpoint, else the trainer's best head, else its newest step, else an SGLang
    export."""
    if ev.checkpoint:
        return resolve_draft_folder(ev.checkpoint)
    d = paths.checkpoint_dir
    tried = [d / "best", *[p for _, p in _step_dirs(d)][::-1], paths.export_dir / "sglang"]
    for cand in tried:
        if (cand / CONFIG_NAME).is_file() or (cand / "draft" / CONFIG_NAME).is_file():
            return resolve_draft_folder(cand)
    raise FileNotFoundError(
        "no draft to evaluate: set eval.checkpoint=<draft folder> or train first; looked in "
        + ", ".join(str(t) for t in tried[:3])
    )
