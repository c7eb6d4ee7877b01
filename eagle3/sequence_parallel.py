"""One sample across several ranks (`train.sequence_parallel: N`): Ulysses attention, the all-to-all over heads
of DeepSpeed-Ulysses that SpecForge's USP and NeMo's context parallelism use.

The world's ranks form groups of N consecutive ranks (on 8 GPUs with N = 8: one node, whose links carry the
all-to-alls). A group trains one micro-batch: rank r of it holds the positions [r*S, (r+1)*S) of every row,
S = ceil(T / N) (the last share padded), and data parallelism runs over the world / N groups (`data_place`).
Everything of the training-time test but attention works per position, so a rank runs its share's layer, norm,
lm_head and loss on its own; a position's labels and teachers lie up to `rows.reach(steps)` positions ahead, so
each rank also holds that much of the next share (its window, TTTPlan.window). Attention: an all-to-all turns
[B, heads, S, D] (every head, a share of the positions) into [B, heads / N, N*S, D] (a share of the heads, every
position); the rank runs the causal kernel (eagle3.ttt.causal_attention) on its heads; a second all-to-all
brings the outputs home. Heads that do not divide by N are padded with zero heads, and GQA's key heads are
repeated to one per query head first where they do not divide.

Gradients: the all-to-alls are differentiable (the backward of one is the reverse all-to-all), every rank's
loss is its share's sum over the global denominators, and the DDP / FSDP average over the whole world (of the
loss times the world, as the trainer scales it) is the gradient of the whole sample's loss. Every rank of a
group runs the same steps on the same shapes whatever its share scores, so the collectives always pair up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from eagle3.logs import UserError
from eagle3.process import Place
from eagle3.rows import reach
from eagle3.ttt import LocalAttention, causal_attention, repeat_kv

SHARED_KEYS = ("aux", "aux_scale")
"""Batch keys a rank needs at its own positions only (the features); every other [B, T, ...] key it needs over its
window (tokens, loss mask, target argmax and final states: the inputs, labels and teachers of its positions)."""


def data_place(rank: int, world: int, size: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel world) of a process: the index of its sequence-parallel group, and how
    many groups there are. The data plan (eagle3.batching) is made for these."""
    return rank // size, world // size


def _slice(x: Tensor, start: int, n: int) -> Tensor:
    """x[:, start:start+n], zero-padded to n positions."""
    part = x[:, start : start + n]
    if part.shape[1] == n:
        return part
    pad = [0, 0] * (x.dim() - 2) + [0, n - part.shape[1]]
    return F.pad(part, pad)


@dataclass
class SequenceParallel(LocalAttention):
    """This rank's place in its sequence-parallel group, and the group's Ulysses attention."""

    size: int
    rank: int
    """Place within the group: which share of the positions this rank holds."""
    group: Any
    """The group's torch.distributed process group."""

    @classmethod
    def join(cls, size: int, place: Place) -> SequenceParallel | None:
        """This process's group (None for size 1). Every process calls it at the same point: making the groups is
        a collective."""
        if size == 1:
            return None
        if place.world % size:
            raise UserError(f"train.sequence_parallel={size} splits each micro-batch over {size} ranks, but this "
                            f"run has {place.world} process(es): launch a multiple of {size} (accelerate launch "
                            f"--num_processes {size * max(1, place.world // size)} ...), or set "
                            f"train.sequence_parallel to a divisor of {place.world}")
        import torch.distributed as dist

        if not dist.is_initialized():
            raise UserError(f"train.sequence_parallel={size} needs {size} processes launched together "
                            f"(accelerate launch --num_processes {size} train.py ...); this is a single process")
        group, _ = dist.new_subgroups(group_size=size)
        return cls(size, place.rank % size, group)

    # ------------------------------------------------------------------------------------------ the batch
    def share(self, t: int) -> tuple[int, int]:
        """(first position, positions) of this rank's share of a T-position batch."""
        own = -(-t // self.size)
        return self.rank * own, own

    def shard(self, batch: dict[str, Tensor], steps: int) -> tuple[dict[str, Tensor], int, int]:
        """(this rank's part of a collated batch, its positions, the global position of the first): the features
        at its own positions, everything else over its window (own positions + reach(steps)), zero-padded past
        the end; `lengths` becomes the real tokens of its share."""
        start, own = self.share(batch["input_ids"].shape[1])
        window = own + reach(steps)
        out: dict[str, Tensor] = {}
        for key, x in batch.items():
            if key == "lengths":
                out[key] = (x - start).clamp(0, own)
            else:
                out[key] = _slice(x, start, own if key in SHARED_KEYS else window)
        return out, own, start

    # -------------------------------------------------------------------------------------- attention
    def _padded(self, heads: int) -> int:
        return -(-heads // self.size) * self.size

    def _to_heads(self, x: Tensor, heads: int) -> Tensor:
        """[B, H, S, D] (this rank's positions) -> [B, heads / N, N*S, D] (its heads, every position), heads >= H
        (zero heads added)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        b, h, s, d = x.shape
        n = self.size
        if heads > h:
            x = F.pad(x, (0, 0, 0, 0, 0, heads - h))
        x = x.reshape(b, n, heads // n, s, d).transpose(0, 1).contiguous()  # chunk i: rank i's heads
        x = all_to_all_single_autograd(x, None, None, self.group)  # chunk i: rank i's positions of my heads
        return x.permute(1, 2, 0, 3, 4).reshape(b, heads // n, n * s, d)

    def _to_tokens(self, x: Tensor, heads: int) -> Tensor:
        """The inverse of _to_heads, without the padded heads: [B, heads', N*S, D] -> [B, heads, S, D]."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        b, hn, ns, d = x.shape
        n = self.size
        x = x.view(b, hn, n, ns // n, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk i: rank i's positions
        x = all_to_all_single_autograd(x, None, None, self.group)  # chunk i: head chunk i at my positions
        return x.transpose(0, 1).reshape(b, n * hn, ns // n, d)[:, :heads]

    def keys(self, k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
        """Step 0's keys and values [B, nkv, S, D] as the group's attention takes them: each rank its heads (the
        ones its query heads read) at every position."""
        nkv = k.shape[1]
        if nkv % self.size == 0:
            return self._to_heads(k, nkv), self._to_heads(v, nkv)
        k, v = repeat_kv(k, heads // nkv), repeat_kv(v, heads // nkv)
        return self._to_heads(k, self._padded(heads)), self._to_heads(v, self._padded(heads))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float, sinks: Tensor | None = None) -> Tensor:
        """Causal attention of q [B, heads, S, D] (this rank's positions) over the whole sequence's keys (`keys`),
        the sinks included: [B, heads, S, D]."""
        heads = q.shape[1]
        out = causal_attention(self._to_heads(q, self._padded(heads)), k, v, scale, sinks)
        return self._to_tokens(out, heads)


def describe(sp: SequenceParallel | None, world: int) -> str:
    """How the world is split, for the training log."""
    if sp is None:
        return ""
    return f" (sequence parallel {sp.size}: {world // sp.size} data-parallel group(s) of {sp.size} ranks)"

