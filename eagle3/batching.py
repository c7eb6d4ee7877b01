"""Token-budget batches with length bucketing: deterministic, resumable by position, padding measured.

A batch holds as many sequences as fit `batch_tokens` counted WITH padding (count x longest). Samples are
shuffled with (seed, epoch), cut into buckets of ~`bucket_batches` batches' worth, sorted by length inside a
bucket (so neighbours have similar lengths and little padding), packed greedily, and the batch order is shuffled
again. The plan of an epoch is a pure function of (lengths, batch_tokens, seed, epoch), so a resumed run
rebuilds the same plan and skips to the saved batch index. Under data parallelism rank r takes batches
r, r+W, r+2W, ... and the tail that does not divide evenly is dropped, so every rank runs the same number of
steps (a rank that ran out would hang the others in the gradient all-reduce).

A weighted mixture (`data.sources[].weight`, `Mixture`) replaces the epoch's permutation of every sample by a draw
from the same (seed, epoch) generator: each source gets its share of the split's tokens, repeating a small source
and subsampling a big one; the rest of the plan is unchanged, so exact resume still holds.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eagle3.logs import UserError


@dataclass
class EpochPlan:
    batches: list[list[int]]
    """Dataset indices of each batch this rank runs, in order."""
    real_tokens: int
    padded_tokens: int
    """Token slots including padding (count x longest, summed over batches)."""
    source_tokens: dict[str, int] | None = None
    """With a mixture: the epoch's drawn tokens per source, every rank's batches together (None without)."""

    @property
    def padding_share(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


@dataclass
class Mixture:
    """A weighted mixture of sources over one split: which source each sample is from, and each source's weight.

    `draw` picks an epoch's samples so that source g gets weights[g] / sum(weights) of the split's natural token
    count (the tokens one pass over every sample holds), counted in TOKENS, not samples: sources differ in sample
    length by several times (code answers are long, chat turns short). A source needing more tokens than it has takes
    whole passes (each a fresh permutation, so every sample repeats k or k+1 times) and then a random part; one
    needing fewer takes a random part; a part stops at the sample boundary nearest its token target. A source with no
    sample in the split has no share: the others are drawn by their weights among themselves.

    `order` ranks the samples canonically (their row in the prepared split): the draw walks each source's samples in
    that order, so a cache that stores them in another order (extraction writes shards by rank and length) draws the
    same samples as prepare's summary predicts."""

    groups: np.ndarray
    """int64 [n]: each sample's source, an index into `names`."""
    weights: list[float]
    names: list[str]
    order: np.ndarray | None = None
    """int64 [n]: each sample's canonical rank (None: its index)."""

    @classmethod
    def of(cls, sources: list[str | None], weights: dict[str, float], order: Any = None) -> Mixture:
        """The mixture of samples from `sources` (each sample's source name) with {name: weight}; a sample from a
        source without a weight is an error (prepared data older than the config's sources)."""
        names = list(weights)
        index = {n: i for i, n in enumerate(names)}
        stray = sorted({str(s) for s in sources if s not in index})
        if stray:
            raise UserError(f"the prepared samples come from source(s) {stray} that data.sources does not weight "
                            f"({names}): re-run `eagle3 prepare --config ...` with this config")
        return cls(np.array([index[s] for s in sources], dtype=np.int64), [weights[n] for n in names], names,
                   None if order is None else np.asarray(order, dtype=np.int64))

    def natural_tokens(self, lengths: Any) -> np.ndarray:
        """float [G]: each source's tokens in one pass over the split."""
        return np.bincount(self.groups, weights=np.asarray(lengths, dtype=np.float64), minlength=len(self.names))

    def target_tokens(self, lengths: Any) -> np.ndarray:
        """float [G]: each source's tokens in a drawn epoch (its weight's share of the split's natural total)."""
        natural = self.natural_tokens(lengths)
        w = np.where(natural > 0, np.asarray(self.weights, dtype=np.float64), 0.0)
        return w / w.sum() * natural.sum() if w.sum() > 0 else np.zeros_like(natural)

    def repeat_factors(self, lengths: Any) -> np.ndarray:
        """float [G]: expected times each of a source's tokens is seen per epoch (target / natural; 0 for none)."""
        natural = self.natural_tokens(lengths)
        return np.divide(self.target_tokens(lengths), natural, out=np.zeros_like(natural), where=natural > 0)

    def draw(self, lengths: Any, rng: np.random.Generator) -> np.ndarray:
        """One epoch's sample indices (with repeats), source by source in `names` order (`plan_epoch` shuffles)."""
        lens = np.asarray(lengths, dtype=np.int64)
        canon = np.argsort(self.order, kind="stable") if self.order is not None else np.arange(len(lens))
        natural, target = self.natural_tokens(lens), self.target_tokens(lens)
        out: list[np.ndarray] = []
        for g in range(len(self.names)):
            members = canon[self.groups[canon] == g]
            if natural[g] == 0:
                continue
            left = target[g]
            while left >= natural[g]:  # whole passes
                out.append(rng.permutation(members))
                left -= natural[g]
            perm = rng.permutation(members)
            cum = np.cumsum(lens[perm])
            k = int(np.searchsorted(cum, left))  # k samples stay below `left`, k + 1 reach it
            below = cum[k - 1] if k > 0 else 0
            if k < len(cum) and cum[k] - left < left - below:
                k += 1
            out.append(perm[:k])
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def tokens(self, lengths: Any, indices: Any) -> dict[str, int]:
        """{source: tokens} of the samples `indices` (a draw)."""
        lens = np.asarray(lengths, dtype=np.int64)
        idx = np.asarray(indices, dtype=np.int64)
        per = np.bincount(self.groups[idx], weights=lens[idx], minlength=len(self.names))
        return {n: int(t) for n, t in zip(self.names, per, strict=True)}


def plan_batches(lengths: list[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group sequence indices by length so padding stays small: sort longest first, and fill a batch while
    `longest * count` (padding included) fits `batch_tokens` and count <= max_batch_size. A sequence longer
    than the budget gets a batch of its own. Deterministic (stable sort), so a resumed run re-forms the same
    batches and writes the same bytes."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (longest * (len(cur) + 1) > batch_tokens or len(cur) >= max_batch_size):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def check_fits(lengths: list[int] | np.ndarray, batch_tokens: int, sequence_parallel: int, split: str) -> None:
    """Refuse, before training starts, a sample longer than one rank holds: plan_batches would give it a batch of
    its own, and that batch would run out of memory in the middle of an epoch. With sequence parallelism a rank
    holds a 1/N share of each sample's positions."""
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0 or -(-int(lens.max()) // sequence_parallel) <= batch_tokens:
        return
    i, longest = int(lens.argmax()), int(lens.max())
    sp = sequence_parallel
    share = f" (a 1/{sp} share of each sample with train.sequence_parallel={sp})" if sp > 1 else ""
    raise UserError(
        f"{split} sample {i} has {longest} tokens, more than one rank holds: train.batch_tokens={batch_tokens} per "
        f"rank{share}, and a sample is never cut between micro-batches. Set train.batch_tokens={-(-longest // sp)} "
        f"if a rank's memory holds that many (train.activation_checkpointing=true keeps most of it free), "
        f"train.sequence_parallel={-(-longest // batch_tokens)} to split each sample over that many ranks, or "
        f"data.max_length={batch_tokens * sp} (then re-run prepare and extract)")


def plan_epoch(lengths: list[int] | np.ndarray, batch_tokens: int, seed: int, epoch: int, rank: int = 0,
               world_size: int = 1, bucket_batches: int = 64, shuffle: bool = True,
               mixture: Mixture | None = None) -> EpochPlan:
    """This rank's batches of one epoch, every rank the same number: training ranks step in lockstep, so the
    last len % world_size batches wait for the next epoch's shuffle. With a `mixture` the epoch's samples are its
    draw (repeats included), shuffled, instead of every sample once."""
    lens = np.asarray(lengths, dtype=np.int64)
    n = len(lens)
    if n == 0:
        return EpochPlan([], 0, 0)
    rng = np.random.default_rng([seed, epoch])
    drawn = None
    if mixture is not None:
        drawn = mixture.draw(lens, rng)
        order = drawn[rng.permutation(len(drawn))]
        n = len(order)
        mean = float(lens[order].mean()) if n else 1.0
    else:
        order = rng.permutation(n) if shuffle else np.arange(n)
        mean = float(lens.mean())
    bucket = max(1, int(bucket_batches * batch_tokens / max(1.0, mean)))
    batches: list[list[int]] = []
    for b0 in range(0, n, bucket):
        chunk = order[b0 : b0 + bucket]
        batches += [chunk[b].tolist() for b in plan_batches(lens[chunk].tolist(), batch_tokens, len(chunk))]
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    per_rank = len(batches) // world_size if world_size > 1 else len(batches)
    mine = batches[rank::world_size][:per_rank]
    real = sum(int(lens[b].sum()) for b in mine)
    padded = sum(int(lens[b].max()) * len(b) for b in mine)
    return EpochPlan(mine, real, padded, None if drawn is None else mixture.tokens(lens, drawn))


def plan_eval(lengths: list[int] | np.ndarray, batch_tokens: int, seed: int, rank: int = 0, world_size: int = 1,
              ) -> tuple[list[list[int]], int]:
    """(this rank's eval batches, how many of them count): every batch of the split counts on exactly one rank,
    and every rank runs as many forwards as the busiest one, because an FSDP forward gathers the weights from all
    ranks and a rank that stopped early would leave the others waiting: a rank short of batches repeats one that
    does not count."""
    every = plan_epoch(lengths, batch_tokens, seed, 0, shuffle=False).batches
    mine = every[rank::world_size]
    rounds = -(-len(every) // world_size)
    return mine + [every[0]] * (rounds - len(mine)), len(mine)


def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest item: ids 0, loss_mask 0, states 0 (padded positions are never valid and,
    being to the right, never attended to by real positions under causal attention). fp8 states stay fp8 with
    their scales (padded with scale 0); the trainer dequantises them on its device (eagle3.cache.codec). Items of
    image samples add `image_embeds`/`image_rank` (`_image_rows`) and, where some hold positions off the token index
    (an M-RoPE target's), `position_ids` [B, T] (the index for the others and the padding)."""
    t = max(len(it["input_ids"]) for it in items)
    b = len(items)
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.int64),
        "loss_mask": torch.zeros(b, t, dtype=torch.int64),
        "lengths": torch.tensor([len(it["input_ids"]) for it in items], dtype=torch.int64),
    }
    states = [k for k in ("aux", "final", "aux_scale", "final_scale") if k in items[0]]
    for k in states:
        out[k] = torch.zeros(b, t, items[0][k].shape[-1], dtype=items[0][k].dtype)
    if all("target_argmax" in it for it in items):  # stored at extraction, or kept by the trainer
        out["target_argmax"] = torch.zeros(b, t, dtype=torch.int64)
        for i, it in enumerate(items):
            out["target_argmax"][i, : len(it["input_ids"])] = it["target_argmax"]
    for i, it in enumerate(items):
        n = len(it["input_ids"])
        out["input_ids"][i, :n] = it["input_ids"]
        out["loss_mask"][i, :n] = torch.as_tensor(it["loss_mask"]).to(torch.int64)
        for k in states:
            out[k][i, :n] = it[k]
    if "image_embeds" in items[0]:
        out |= _image_rows(items, b, t)
    if any("positions" in it for it in items):  # an M-RoPE target's image samples: the index elsewhere
        out["position_ids"] = torch.arange(t).repeat(b, 1)
        for i, it in enumerate(items):
            if "positions" in it:
                out["position_ids"][i, : len(it["positions"])] = it["positions"]
    return out


def _image_rows(items: list[dict[str, Any]], b: int, t: int) -> dict[str, torch.Tensor]:
    """The batch's image embeddings [N, H] (its items' in order) and `image_rank` [B, T]: at an image position the
    row of its embedding, -1 elsewhere (eagle3.objective feeds them to the draft under target-embeddings)."""
    rank = torch.full((b, t), -1, dtype=torch.int64)
    k = 0
    for i, it in enumerate(items):
        pos = it["image_positions"]
        rank[i, pos] = torch.arange(k, k + len(pos))
        k += len(pos)
    return {"image_embeds": torch.cat([it["image_embeds"] for it in items]), "image_rank": rank}


class Prefetch:
    """Run an iterator in a background thread, `depth` items ahead (collation copies and target forwards
    release the GIL), so the training step does not wait on data. Exceptions in the producer are re-raised in
    the consumer.

    `close()` stops the producer and *joins* it; `with Prefetch(...)` closes on any exit. A producer thread still
    inside a torch op when the interpreter shuts down is stopped there, in the middle of C++ code, and the process
    aborts after its work is done ("terminate called without an active exception", SIGABRT). So no stage may
    return with a producer running; an atexit hook closes any prefetcher a crash left open, before Python stops
    its threads.
    """

    _END = object()

    def __init__(self, it: Iterable[Any], depth: int = 2, name: str = "eagle3-prefetch"):
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iter(it),), name=name, daemon=True)
        _OPEN.add(self)
        self._thread.start()

    def _put(self, x: Any) -> bool:
        """Queue `x` unless asked to stop first (never blocks past a `close()`)."""
        while not self._stop.is_set():
            try:
                self._q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, it: Iterator[Any]) -> None:
        try:
            for x in it:
                if not self._put(x):
                    return
            self._put(self._END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)

    def __iter__(self) -> Iterator[Any]:
        while True:
            x = self._q.get()
            if x is self._END:
                return
            if isinstance(x, BaseException):
                raise x
            yield x

    def close(self) -> None:
        """Stop the producer, drop what it queued, and wait for its thread (it finishes the item in hand)."""
        self._stop.set()
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join()
        _OPEN.discard(self)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OPEN: set[Prefetch] = set()


@atexit.register
def _close_open_prefetchers() -> None:
    for pf in list(_OPEN):
        pf.close()


def pinned(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch in page-locked host memory, so its copy to a GPU runs asynchronously (non_blocking=True)."""
    return {k: v.pin_memory() for k, v in batch.items()}


def iter_batches(dataset: Any, batches: list[list[int]], prefetch: int = 2,
                 pin: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Collated batches of `dataset` in plan order (prefetched in a thread when prefetch > 0; pinned there when
    `pin`, for a CUDA trainer)."""
    gen = ((pinned if pin else dict)(collate([dataset[i] for i in b])) for b in batches)
    if prefetch <= 0:
        yield from gen
        return
    with Prefetch(gen, prefetch) as pf:
        yield from pf
