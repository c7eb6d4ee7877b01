"""The EAGLE-3 training loop, written out; accelerate owns devices, DDP/FSDP, mixed precision and checkpoint state.

    eagle3 train --config configs/smollm2-135m.yaml                      # one process
    accelerate launch train.py --config configs/smollm2-135m.yaml        # any accelerate setup

Flow of `run(cfg)`: vocab (prepared once, never recounted) -> target embeddings + lm_head (read by name from
the shards) -> data (offline cache, fingerprint-checked; or online from the target) -> draft (fresh, lm_head
from the target's draft-vocab rows, and `draft.copy_init`'s copy circuit; or `draft.init_from`) -> resume from
the newest checkpoint -> loop:
token-budget batches, TTT forward, soft-CE vs the chunked teacher, AdamW + warmup/cosine + clipping ->
metrics, eval (acc_j, simulated acceptance length), checkpoints (atomic), best draft, SGLang export.

Exact resume: the data plan (with `data.sources[].weight`, the epoch's weighted draw of samples too: eagle3.batching
.Mixture) is a pure function of (seed, epoch) and the checkpoint stores (epoch, batch index)
next to accelerate's model/optimizer/scheduler/RNG state, so a killed run re-launched with the same command
continues with the same losses an uninterrupted run would have had.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import closing, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from eagle3 import threads
from eagle3.batching import EpochPlan, Mixture, check_fits, plan_epoch, plan_eval
from eagle3.checkpoints import TrainState, list_checkpoints, resume, save_best, save_checkpoint
from eagle3.config import Config, DraftConfig, ExtractConfig, SourceConfig, TargetConfig, TrackingConfig, TrainConfig
from eagle3.data.prepared import check_prepared, load_prepared, load_vocab, read_prepared_meta
from eagle3.formats import load_draft
from eagle3.layer_ids import ArchFamily, sglang_family
from eagle3.locks import writes
from eagle3.logs import Progress, UserError, setup_logging
from eagle3.loss import StepStats, Teacher, summarise
from eagle3.model import SHAPE_FIELDS, Eagle3Draft, Eagle3DraftConfig
from eagle3.objective import Objective
from eagle3.online import OnlineSource
from eagle3.paths import RunPaths
from eagle3.precision import DTYPES, prepare_like_ddp
from eagle3.precision import resolve_mixed_precision as resolve_for_device
from eagle3.process import gather_after, this_process
from eagle3.sequence_parallel import SequenceParallel, data_place, describe
from eagle3.targets.argmax import ArgmaxHead
from eagle3.targets.info import TargetInfo, read_target_info
from eagle3.targets.weights import load_target_head
from eagle3.tracking import Tracker, accelerator_tracking

log = logging.getLogger("eagle3")

# ---------------------------------------------------------------------------------------------------- setup
def resolve_mixed_precision(train: TrainConfig) -> str:
    """train.mixed_precision with `auto` resolved for the device accelerate will train on (eagle3.precision)."""
    return resolve_for_device(train.mixed_precision, "cuda" if torch.cuda.is_available() else "cpu")


def make_accelerator(train: TrainConfig, tracking: TrackingConfig, paths: RunPaths):
    from accelerate import Accelerator, DistributedDataParallelKwargs

    # broadcast_buffers=False: the buffers (frozen embeddings, d2t, t2d) are identical on every rank and
    # never change; DDP would otherwise re-broadcast the 2.3 GB Kimi embedding every step.
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
    return Accelerator(
        mixed_precision=resolve_mixed_precision(train),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[ddp],
        **accelerator_tracking(tracking, paths),
    )


def _pin(accelerator: Any) -> bool:
    """Pinned host batches copy to a CUDA device asynchronously."""
    return accelerator.device.type == "cuda"


def open_datasets(target: TargetConfig, extract: ExtractConfig, paths: RunPaths, max_length: int,
                  verify_cache: bool, request_tokens: int | None = None) -> tuple[Any, Any]:
    """(train, eval): cache splits (HiddenStateDataset) or, in online mode, OnlineSource over the prepared data.
    Both have `.lengths` and `iter_collated(index_batches, pin)`, whose batches hold the same keys (eagle3.batching
    .collate): the only place the trainer tells the two modes apart is here. max_length: data.max_length (an online
    SGLang target's prompts); verify_cache: train.verify_cache; request_tokens: the tokens of one micro-batch (an
    online SGLang target's largest request; default extract.batch_tokens)."""
    cache_dir = paths.cache_dir
    if extract.mode == "online":
        from eagle3.targets import make_backend

        prepared = load_prepared(paths.prepared_dir)
        backend = make_backend(target, extract, max_length, paths.logs_dir,
                               request=(request_tokens or extract.batch_tokens, extract.storage),
                               images="images" in prepared.train.column_names)
        argmax = ArgmaxHead.for_backend(backend, target, extract.teacher_chunk)
        storage = extract.storage
        evald = OnlineSource(backend, prepared.eval, extract.prefetch, argmax, storage) if len(prepared.eval) else None
        return OnlineSource(backend, prepared.train, extract.prefetch, argmax, storage), evald
    from eagle3.cache import HiddenStateDataset, check_fingerprint, expected_fingerprint

    if not (cache_dir / "meta.json").is_file():
        raise FileNotFoundError(f"no hidden-state cache at {cache_dir}: run `eagle3 extract --config ...` first "
                                "(or set extract.mode=online)")
    # Refuse a cache extracted from another target / dtype / layer ids / prepared data before any work.
    check_fingerprint(cache_dir, expected_fingerprint(target, extract.storage, paths.prepared_dir))
    if verify_cache:
        verify_before_training(cache_dir)
    train = HiddenStateDataset(cache_dir, "train")
    evald = HiddenStateDataset(cache_dir, "eval")  # a damaged eval shard is an error, never a skipped eval
    if len(evald) == 0:
        log.warning("the eval split of %s is empty (data.eval_size=0?): eval metrics are skipped and `best` is the "
                    "last step's head", cache_dir)
        evald = None
    if len(train) == 0:
        raise ValueError(f"cache {cache_dir}: the train split is empty")
    return train, evald


def train_mixture(sources: list[SourceConfig], paths: RunPaths, train_ds: Any) -> Mixture | None:
    """The weighted mixture of `data.sources` over the train split (None without weights): each item's source comes
    from the prepared train split's `source` column, found by sample id (a cache's item i is not prepared row i:
    extraction stores shards by rank and length, skips NaN samples, and `extract.max_samples` keeps a prefix), and
    the draw walks the items in prepared-row order, so a whole cache draws what prepare's summary printed."""
    from eagle3.data.sources import source_weights

    weights = source_weights(sources)
    if weights is None:
        return None
    from datasets import load_from_disk

    online = isinstance(train_ds, OnlineSource)
    prepared = train_ds.split if online else load_from_disk(str(paths.prepared_dir / "train"))
    if "source" not in prepared.column_names:
        raise UserError(f"the prepared data in {paths.prepared_dir} records no source per sample (made by an older "
                        "eagle3): data.sources[].weight needs it; re-run `eagle3 prepare --config ...`")
    sources = prepared["source"]
    if online:  # the prepared rows themselves
        rows = list(range(len(sources)))
    else:
        row_of = {sid: i for i, sid in enumerate(prepared["id"])}
        stray = [sid for sid in train_ds.sample_ids if sid not in row_of]
        if stray:
            raise UserError(f"cache {paths.cache_dir} holds sample(s) {stray[:3]} that the prepared train split in "
                            f"{paths.prepared_dir} does not: extract again from this prepared data")
        rows = [row_of[sid] for sid in train_ds.sample_ids]
    return Mixture.of([sources[r] for r in rows], weights, order=rows)


def describe_mixture(mixture: Mixture, lengths: list[int]) -> str:
    """The mixture's sources with their natural tokens, expected repeat factor and weight (a line for the log)."""
    natural, factor = mixture.natural_tokens(lengths), mixture.repeat_factors(lengths)
    parts = [f"{n} {int(t)} tokens x{f:.2f} (weight {w:g})" if t else f"{n}: NO train sample (weight {w:g}; the "
             "others share its tokens by their weights)"
             for n, t, f, w in zip(mixture.names, natural, factor, mixture.weights, strict=True)]
    return f"mixture over {int(natural.sum())} train tokens per epoch: " + ", ".join(parts)


def _rank_world(train: TrainConfig) -> tuple[int, int]:
    """This process's place in the data plan: (data-parallel rank, world), the ranks of a sequence-parallel group
    sharing one (eagle3.sequence_parallel)."""
    place = this_process()
    return data_place(place.rank, place.world, train.sequence_parallel)


def _budget(train: TrainConfig) -> int:
    """Tokens of one micro-batch, padding included, over the ranks that share it."""
    return train.batch_tokens * train.sequence_parallel


VERIFY_TIMEOUT = timedelta(hours=2)
"""How long a rank that has checked its share of the cache waits for the slowest. Kimi-K2.5's 1.2 TB cache is 150 GB
a rank on 8: 2.5 min at 1 GB/s (a local NVMe shared by 8 ranks), 20 min at 125 MB/s (a 1 GB/s network volume
shared by 8), so one rank can finish 10+ minutes after another (NCCL's watchdog); 2 h covers 6 times that."""


def verify_before_training(cache_dir: Path) -> None:
    """Every shard's checksum, each rank hashing its share; all ranks stop together when one finds damage. The ranks
    meet over a gloo group of their own that waits VERIFY_TIMEOUT (eagle3.process.gather_after)."""
    from eagle3.cache import damaged_error, verify_cache

    place = this_process()
    try:
        parts = gather_after(lambda: verify_cache(cache_dir, part=(place.rank, place.world)), VERIFY_TIMEOUT,
                             "checking their share of the cache's checksums")
    except TimeoutError as e:
        raise UserError(f"{e} (train.verify_cache). Check the cache once outside training (`eagle3 cache info "
                        f"{cache_dir} --verify`), then train with train.verify_cache=false") from e
    problems = [p for part in parts for p in part]
    if problems:
        raise damaged_error(cache_dir, sorted(problems))
    log.info("cache %s: every shard's checksum matches its manifest", cache_dir)


def build_draft(dc: DraftConfig, target: TargetConfig, seed: int, hf_config: dict[str, Any], d2t: torch.Tensor,
                t2d: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor) -> Eagle3Draft:
    torch.manual_seed(seed)
    dcfg = Eagle3DraftConfig.from_target(dc, target, hf_config, draft_vocab_size=int(d2t.shape[0]))
    if dc.init_from:
        return fine_tune_start(dc.init_from, dcfg, embed, d2t, TargetInfo.of(hf_config).family)
    draft = Eagle3Draft(dcfg)
    draft.set_vocab(d2t, t2d)
    draft.init_from_target(lm_head, embed)
    return draft


def copy_init(draft: Eagle3Draft, groups: int, train_ds: Any, embed: torch.Tensor, samples: int = 64) -> None:
    """`draft.copy_init`: the copy circuit (eagle3.induction), its token readouts fitted on the cache's first samples.
    Only for a run that starts fresh: a resumed one loads its checkpoint over every init, and at Kimi-K2.5's width the
    fit solves a 21,504-square system (3H) on every rank."""
    from eagle3.cache import HiddenStateDataset
    from eagle3.cache.codec import dense
    from eagle3.induction import fit_readouts, write_copy_circuit

    if not isinstance(train_ds, HiddenStateDataset):
        raise UserError("draft.copy_init fits its token readouts on the target's states in an offline cache; "
                        "extract one (extract.mode=offline) or set draft.copy_init=0")
    rows = [dense(train_ds[i], train_ds.dtype) for i in range(min(samples, len(train_ds)))]  # fp8: scaled back
    readouts = fit_readouts([r["aux"] for r in rows], [r["input_ids"] for r in rows], embed)
    try:
        write_copy_circuit(draft, readouts, embed, groups, torch.cat([r["aux"] for r in rows[:16]]))
    except ValueError as e:
        raise UserError(str(e)) from None


def fine_tune_start(folder: str, want: Eagle3DraftConfig, embed: torch.Tensor, d2t: torch.Tensor,
                    family: ArchFamily) -> Eagle3Draft:
    """`draft.init_from`: a head in any format eagle3.formats reads (a published one included), checked to be the
    head this config would build, on the same features and draft vocab; it takes over this run's target record."""
    draft = load_draft(folder, embed_weight=embed, engine="sglang", family=family)
    have = draft.config
    for key in SHAPE_FIELDS:
        if getattr(have, key) != getattr(want, key):
            raise UserError(f"draft.init_from={folder}: the head has {key}={getattr(have, key)}, this config builds "
                            f"{getattr(want, key)}; set draft.{key} (or the target) to match the head")
    if have.aux_layer_ids and list(have.aux_layer_ids) != list(want.aux_layer_ids or []):
        raise UserError(f"draft.init_from={folder}: the head was trained on aux layer ids {have.aux_layer_ids} "
                        f"(eagle3 convention), this config extracts {want.aux_layer_ids}; set target.aux_layer_ids")
    if have.draft_vocab_size != d2t.shape[0] or not torch.equal(draft.d2t.cpu(), d2t.long()):
        raise UserError(f"draft.init_from={folder}: its draft vocab (d2t, {have.draft_vocab_size} tokens) differs "
                        f"from the prepared vocab ({d2t.shape[0]} tokens); fine-tuning needs the same mapping (a "
                        "full-vocab head: draft.vocab_size = the target's vocab size)")
    have.aux_layer_ids, have.target, have.features = want.aux_layer_ids, want.target, want.features
    return draft


def sglang_spelling_problem(target: TargetConfig) -> str | None:
    """Why the SGLang export at the end would be refused (a target outside eagle3's table of layer-id spellings
    and no target.layer_id_family), else None. Said before training and again at the end, where the export is
    skipped: the checkpoints and a vLLM export do not need it."""
    info = read_target_info(target.path)
    try:
        sglang_family(info.architectures, info.model_type, target.layer_id_family)
    except ValueError as e:
        return f"no SGLang export of the best head will be written: {e}"
    return None


def export_best(target: TargetConfig, paths: RunPaths, best: Path, image_inputs: str | None = None) -> None:
    """The best head exported for SGLang, the default engine; a head trained with vLLM's image inputs
    (draft.image_inputs=placeholder) for vLLM instead, which serves what it was trained on."""
    from eagle3.export import export

    if image_inputs == "placeholder":
        out = paths.export_dir / "vllm"
        export(best, out, to="vllm", paths=paths)
        log.info("exported the best draft for vLLM (trained with its image inputs): %s", out)
        return
    if problem := sglang_spelling_problem(target):
        log.warning("%s; the best head stays in %s", problem, best)
        return
    out = paths.export_dir / "sglang"
    export(best, out, to="sglang", target_family=target.layer_id_family, paths=paths)
    log.info("exported the best draft for SGLang: %s", out)


def refuse_non_finite(loss: torch.Tensor, grad_norm: torch.Tensor, step: int, samples: list[list[int]]) -> None:
    """Stop before a non-finite loss or gradient reaches the weights: a NaN step would otherwise train on
    silently, and its head be saved as `best` and exported. The gradient norm is all-reduced, so every rank
    stops at the same step."""
    if bool(torch.isfinite(grad_norm)) and bool(torch.isfinite(loss)):
        return
    raise UserError(
        f"step {step}: the loss ({float(loss):.4g}) or gradient norm ({float(grad_norm):.4g}) is not finite; the "
        f"step was not applied and every checkpoint so far is intact. Its micro-batches hold train samples "
        f"{samples} (indices into the cache's train split). A damaged cache shard or NaN hidden states are the "
        "usual cause (check them with `eagle3 verify-extraction --config ... --source cache`); else lower train.lr")


def _reduce(accelerator, stats: StepStats) -> StepStats:
    return StepStats(*accelerator.reduce(stats.packed(), reduction="sum"))


@torch.no_grad()
def evaluate(accelerator, model, objective: Objective, dataset: Any, train: TrainConfig) -> dict[str, float]:
    """acc_j, loss_j and the simulated acceptance length over the eval split (sharded across ranks)."""
    n = len(dataset)
    if train.eval_max_samples:
        n = min(n, train.eval_max_samples)
    plan, counted = plan_eval(dataset.lengths[:n], _budget(train), train.seed, *_rank_world(train))
    total = StepStats.zeros(train.ttt_steps, accelerator.device)
    model.eval()
    with closing(dataset.iter_collated(plan, pin=_pin(accelerator))) as batches:
        for i, batch in enumerate(batches):
            _, st = objective.loss(model, objective.plan(batch))
            if i < counted:
                total = total + st
    model.train()
    stats = _reduce(accelerator, total)
    if float(stats.counted.sum()) == 0:
        log.warning("eval: no position of the eval split's %d sample(s) was scored; its metrics say nothing", n)
    return summarise(stats)


# -------------------------------------------------------------------------------------------------- the loop
@writes(lambda cfg, **_: cfg.checkpoint_dir, "train", per_rank=True)  # also covers train_log.jsonl, the export
def run(cfg: Config) -> dict[str, Any]:
    """Train; return the final metrics (also written to <output_dir>/train_log.jsonl, one line per step)."""
    setup_logging()
    session = set_up(cfg)
    metrics = train_loop(session)
    finish(session)
    return metrics


@dataclass
class Session:
    """What one training run holds from set-up to finish."""

    cfg: Config
    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    objective: Objective
    train_ds: Any
    eval_ds: Any
    state: TrainState
    tracker: Tracker
    d2t: torch.Tensor
    t2d: torch.Tensor
    total_steps: int
    mixture: Mixture | None = None
    """The weighted mixture each epoch's samples are drawn from (`data.sources[].weight`); None: every sample once."""


def set_up(cfg: Config) -> Session:
    """Data, head, teacher, optimizer and schedule, wrapped by accelerate and resumed from the newest checkpoint."""
    from accelerate.utils import set_seed
    from transformers import get_cosine_schedule_with_warmup

    accelerator = make_accelerator(cfg.train, cfg.tracking, cfg.paths)
    set_seed(cfg.train.seed)
    tc = cfg.train
    check_prepared(cfg.data, cfg.draft, cfg.target, cfg.prepared_dir, read_prepared_meta(cfg.prepared_dir),
                   "train")
    if problem := sglang_spelling_problem(cfg.target):
        log.warning(problem)
    d2t, t2d = load_vocab(cfg.prepared_dir / "vocab.safetensors")
    embed, lm_head, hf_config = load_target_head(cfg.target.path)
    train_ds, eval_ds = open_datasets(cfg.target, cfg.extract, cfg.paths, cfg.data.max_length, tc.verify_cache,
                                      request_tokens=_budget(tc))
    for split, ds in (("train", train_ds), ("eval", eval_ds)):
        if ds is not None:
            check_fits(ds.lengths, tc.batch_tokens, tc.sequence_parallel, split)
    sp = SequenceParallel.join(tc.sequence_parallel, this_process())
    draft = build_draft(cfg.draft, cfg.target, tc.seed, hf_config, d2t, t2d, embed, lm_head)
    if cfg.draft.copy_init and not (tc.resume and list_checkpoints(cfg.paths.checkpoint_dir)):
        copy_init(draft, cfg.draft.copy_init, train_ds, embed)
    # The teacher multiplies in the dtype the target is served in, whatever dtype the checkpoint stores it in.
    teacher = Teacher(lm_head.to(DTYPES[cfg.target.dtype]), d2t, t2d).to(accelerator.device)
    objective = Objective(teacher, tc, sp, cfg.draft.image_inputs)
    del embed, lm_head

    rank, world = _rank_world(tc)
    mixture = train_mixture(cfg.data.sources, cfg.paths, train_ds)
    first = plan_epoch(train_ds.lengths, _budget(tc), tc.seed, 0, rank, world, mixture=mixture)
    steps_per_epoch = len(first.batches) // tc.grad_accum
    if steps_per_epoch == 0:
        raise ValueError(f"the train split gives {len(first.batches)} micro-batches per rank, fewer than "
                         f"train.grad_accum={tc.grad_accum} x processes; use more data or a smaller train.batch_tokens")
    total_steps = tc.max_steps or tc.epochs * steps_per_epoch
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(tc.warmup_ratio * total_steps), total_steps)
    model, optimizer = prepare_like_ddp(accelerator, draft, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    state = resume(accelerator, model, cfg.paths, tc, d2t)
    state.world_size, state.sequence_parallel = this_process().world, tc.sequence_parallel
    tracker = Tracker(accelerator, cfg.tracking, cfg.paths, cfg.model_dump(mode="json"))
    tracker.info("train: %d samples, %d steps (%d per epoch), %d process(es)%s, mixed precision %s, padding %.1f%%",
                 len(train_ds), total_steps, steps_per_epoch, this_process().world,
                 describe(sp, this_process().world), accelerator.mixed_precision, 100 * first.padding_share)
    if mixture is not None:
        tracker.info("%s", describe_mixture(mixture, train_ds.lengths))
    tracker.info("metrics: acc_j = draft argmax == target argmax at TTT step j (out-of-vocab = miss); "
                 "sim_accept_len = 1 + sum_k prod_{j<=k} chain_acc_j, chain_acc_j = step j's hit rate given "
                 "steps < j hit, on text the target agrees with (counts the bonus token, like SGLang/vLLM)")
    return Session(cfg, accelerator, model, optimizer, scheduler, objective, train_ds, eval_ds, state, tracker,
                   d2t, t2d, total_steps, mixture)


def train_loop(s: Session) -> dict[str, Any]:
    """Epochs of planned batches, one optimizer step per accumulation group, until `total_steps`."""
    tc, state = s.cfg.train, s.state
    rank, world = _rank_world(tc)
    progress = Progress(s.total_steps, "train", unit="step", initial=state.step, disable=not s.tracker.main)
    metrics: dict[str, Any] = {}
    s.model.train()
    while state.step < s.total_steps:
        plan = plan_epoch(s.train_ds.lengths, _budget(tc), tc.seed, state.epoch, rank, world, mixture=s.mixture)
        usable = (len(plan.batches) // tc.grad_accum) * tc.grad_accum
        if state.batch_index + tc.grad_accum > usable:
            state.epoch, state.batch_index = state.epoch + 1, 0
            continue
        if plan.source_tokens is not None:  # once per epoch (a resumed one again): the mixture as drawn
            log_mixture(s.tracker, state.epoch, plan.source_tokens)
        # Only the batches this run will train: online, a batch past the last step would cost target forwards and
        # store traffic for nothing. closing() stops and joins the prefetch thread however the loop ends.
        end = min(usable, state.batch_index + (s.total_steps - state.step) * tc.grad_accum)
        with closing(s.train_ds.iter_collated(plan.batches[state.batch_index:end], _pin(s.accelerator))) as batches:
            while state.step < s.total_steps and state.batch_index + tc.grad_accum <= usable:
                threads.adjust()
                metrics = train_step(s, batches, plan)
                progress.update(1, loss=f"{metrics['loss']:.4f}", acc0=f"{metrics['acc_0']:.3f}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
                after_step(s, metrics)
    progress.close()
    return metrics


def log_mixture(tracker: Tracker, epoch: int, tokens: dict[str, int]) -> None:
    """One epoch's drawn tokens per source, every rank's together (a rank's tail batches wait for the next epoch)."""
    total = sum(tokens.values()) or 1
    tracker.info("epoch %d mixture: %s", epoch, ", ".join(f"{n} {t} tokens ({100 * t / total:.1f}%)"
                                                         for n, t in tokens.items()))


def train_step(s: Session, batches: Any, plan: EpochPlan) -> dict[str, Any]:
    """One optimizer step over the next accumulation group of `batches`; the step's metrics."""
    tc, state, accelerator = s.cfg.train, s.state, s.accelerator
    world = this_process().world
    t0 = time.perf_counter()
    wait = 0.0
    tokens = 0
    stats = StepStats.zeros(tc.ttt_steps, accelerator.device)
    loss_total = torch.zeros((), device=accelerator.device)
    group = []
    for _ in range(tc.grad_accum):
        tw = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - tw
        group.append(s.objective.plan(batch))
        tokens += int(group[-1].batch["lengths"].sum())  # this rank's share of them
    # Each step's loss is a mean over the scored positions of the whole group on every rank; DDP averages
    # gradients over ranks, hence the factor `world`.
    denominators = accelerator.reduce(sum(m.scored() for m in group).to(accelerator.device), "sum")
    for i, planned in enumerate(group):
        sync = i == tc.grad_accum - 1
        # Gradients are all-reduced only on the last micro-batch of an accumulation group.
        with accelerator.no_sync(s.model) if not sync else nullcontext():
            loss, st = s.objective.loss(s.model, planned, denominators)
            accelerator.backward(loss * world)
        loss_total += loss.detach()  # no host sync per micro-batch: one at the step's end
        stats = stats + st
    grad_norm = accelerator.clip_grad_norm_(s.model.parameters(), tc.grad_clip)
    refuse_non_finite(loss_total, grad_norm, state.step + 1,
                      plan.batches[state.batch_index:state.batch_index + tc.grad_accum])
    s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    state.batch_index += tc.grad_accum
    dt = time.perf_counter() - t0

    loss_mean = float(accelerator.reduce(loss_total, "sum"))
    tok_all = int(accelerator.reduce(torch.tensor(tokens, device=accelerator.device), "sum"))
    metrics = {"step": state.step, "loss": loss_mean, **summarise(_reduce(accelerator, stats)),
               "lr": s.scheduler.get_last_lr()[0], "grad_norm": float(grad_norm), "tokens_per_s": tok_all / dt,
               "step_s": dt, "data_wait_share": wait / dt, "padding_share": plan.padding_share, "epoch": state.epoch}
    s.tracker.record(metrics)
    return metrics


def after_step(s: Session, metrics: dict[str, Any]) -> None:
    """Log the step, evaluate (keeping the best head) and checkpoint, each on its schedule."""
    tc, state, tracker = s.cfg.train, s.state, s.tracker
    last = state.step == s.total_steps
    if state.step % tc.log_every == 0 or last:
        tracker.log({f"train/{k}": v for k, v in metrics.items() if k != "step"}, step=state.step)
        accs = " ".join(f"{metrics[f'acc_{j}']:.3f}" for j in range(tc.ttt_steps))
        tracker.info("step %d/%d loss %.4f acc_j [%s] sim_accept_len %.3f lr %.2e grad_norm %.3f "
                     "%.0f tok/s data wait %.1f%% padding %.1f%%", state.step, s.total_steps, metrics["loss"], accs,
                     metrics["sim_accept_len"], metrics["lr"], metrics["grad_norm"], metrics["tokens_per_s"],
                     100 * metrics["data_wait_share"], 100 * metrics["padding_share"])
    if s.eval_ds is not None and len(s.eval_ds) and (state.step % tc.eval_every == 0 or last):
        ev = evaluate(s.accelerator, s.model, s.objective, s.eval_ds, s.cfg.train)
        tracker.log({f"eval/{k}": v for k, v in ev.items()}, step=state.step)
        tracker.info("eval @ step %d: sim_accept_len %.3f (teacher-forced %.3f), %s", state.step,
                     ev["sim_accept_len"], ev["sim_accept_len_tf"],
                     " ".join(f"acc_{j}={ev[f'acc_{j}']:.3f}" for j in range(tc.ttt_steps)))
        tracker.record({"step": state.step, "eval": ev})
        if ev["sim_accept_len"] > state.best_accept_len:
            state.best_accept_len, state.best_step = ev["sim_accept_len"], state.step
            save_best(s.accelerator, s.model, s.cfg.checkpoint_dir)
        metrics["eval"] = ev
    if state.step % tc.save_every == 0 or last:
        save_checkpoint(s.accelerator, s.model, state, s.d2t, s.t2d, s.cfg.checkpoint_dir, s.cfg.train.keep_checkpoints)


def finish(s: Session) -> None:
    """The best head saved (the last weights when nothing was evaluated) and exported for SGLang."""
    best = s.cfg.checkpoint_dir / "best"
    if not (best / "config.json").is_file():
        save_best(s.accelerator, s.model, s.cfg.checkpoint_dir)  # no eval split: the last weights are the best we know
    if s.tracker.main:
        export_best(s.cfg.target, s.cfg.paths, best, s.cfg.draft.image_inputs)
    s.accelerator.wait_for_everyone()
    s.accelerator.end_training()
