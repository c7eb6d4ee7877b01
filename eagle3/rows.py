"""Which positions each training-time-test (TTT) step computes and scores: the alignment of EAGLE-3.

Alignment (SpecForge / EAGLE-3 convention), for a sequence x_0..x_{T-1} with target features f_t (aux states
at position t, which has read x_0..x_t) and final states g_t (the target's logits l_t = lm_head(g_t) predict
x_{t+1}):

    step 0, position t: input (fc(f_t), token x_{t+1}), RoPE position t,   teacher softmax(l_{t+1}) -> x_{t+2}
    step j, position t: input (h^{j-1}_t, token x_{t+1+j}), position t+j,  teacher softmax(l_{t+1+j}) -> x_{t+2+j}

where h^{j-1}_t is the draft's own pre-norm output at step j-1. This is exactly inference: after verification
the target hands over the feature at the last accepted position p and the bonus token x_{p+1}; the draft then
predicts x_{p+2}, feeds its hidden back, and so on, each step one position further.

A position counts at step j when its *label* token x_{t+2+j} is an assistant token (loss_mask shifted WITH the
labels, so the first assistant token is learned too), exists (t+2+j < T), and, if `mask_out_of_vocab`, the
target's full-vocab argmax at t+1+j lies in the draft vocab. The loss of step j is averaged over its valid
positions (not over all positions; over those of the whole accumulation group on all ranks in training) and
weighted decay**j. Only those positions are computed at all (TTTPlan): the layer, norm, lm_head and teacher of a
step run on the rows that reach the loss, now or at a later step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def reach(steps: int) -> int:
    """How many positions past t the `steps` TTT steps at t read: step j's input token x_{t+1+j}, its teacher at
    t+1+j and its label x_{t+2+j}, so up to t+steps+1 (a sequence-parallel share needs that many of the next)."""
    return steps + 1


def shift_tokens(input_ids: Tensor, by: int) -> Tensor:
    """x_{t+by} at position t, zero-padded past the end (those positions are never valid)."""
    return F.pad(input_ids[:, by:], (0, by), value=0)


def valid_positions(loss_mask: Tensor, draft_target: Tensor, step: int, mask_out_of_vocab: bool) -> Tensor:
    """Bool [B, T]: position t counts at `step` (label x_{t+2+step} masked in, in-vocab teacher if asked)."""
    b, t = loss_mask.shape
    shift = 2 + step
    valid = torch.zeros(b, t, dtype=torch.bool, device=loss_mask.device)
    n = t - shift
    if n <= 0:
        return valid
    valid[:, :n] = loss_mask[:, shift:].bool()
    if mask_out_of_vocab:
        valid[:, :n] &= draft_target[:, 1 + step : 1 + step + n] >= 0
    return valid


@dataclass
class TTTPlan:
    """The positions each TTT step computes and scores, as indices into the flattened [B*T] batch.

    Only rows that reach the loss are worth a matmul: step j's lm_head and cross-entropy run on the positions
    scored at step j, and its layer on the positions step j or a later step still needs (a later step reads
    this step's hidden at the same position). Step 0's keys and values stay complete: every later query reads
    the causal prefix of them. The sets are nested (keep[j+1] within keep[j]), so each step gathers its inputs
    from the step before. Attention runs in the positions' own layout (`pack`/`unpack`: every position a query
    slot, the unkept ones zero), so its kernel is the causal one, whose memory is linear in T.

    Under sequence parallelism (eagle3.sequence_parallel) a plan covers one rank's share of the sequence: T
    positions starting at global position `start`, whose labels and teachers reach `window` - T positions past
    them (into the next rank's share), so `teacher_pos` indexes a [B, window] slice.
    """

    shape: tuple[int, int]
    keep: list[Tensor]
    """Step j: sorted flat positions whose step-j output hidden is needed."""
    parent: list[Tensor]
    """Step j >= 1: where each keep[j] position sits in keep[j-1] (parent[0] is unused)."""
    score: list[Tensor]
    """Step j: where each position scored at step j sits in keep[j]."""
    teacher_pos: Tensor
    """Sorted flat positions of the [B, window] batch whose teacher distribution some step needs (t+1+j of a
    scored (j, t))."""
    teacher_row: list[Tensor]
    """Step j: the row of teacher_pos holding each scored position's teacher."""
    counted: Tensor
    """[steps] float: positions with a masked-in label at step j, out-of-vocab teachers included (acc's denominator)."""
    window: int
    """Length of each row of the batch the labels and teachers come from: T, or more for a sequence-parallel
    rank's share (its window reaches into the next share)."""
    start: int = 0
    """Global position of the plan's position 0 (its RoPE position at step 0)."""

    @property
    def steps(self) -> int:
        return len(self.keep)

    def scored(self) -> Tensor:
        """[steps] float: the positions each step scores (the loss's denominators)."""
        return torch.tensor([float(x.numel()) for x in self.score])

    def to(self, device: torch.device | str) -> TTTPlan:
        def move(x: Any) -> Any:
            if isinstance(x, Tensor):
                return x.to(device, non_blocking=True)
            return [move(v) for v in x] if isinstance(x, list) else x

        return TTTPlan(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def within(self, i: int, j: int) -> Tensor:
        """Where each keep[j] position sits in keep[i], for i <= j."""
        idx = torch.arange(self.keep[j].numel(), device=self.keep[j].device)
        for step in range(j, i, -1):
            idx = self.parent[step][idx]
        return idx

    def pack(self, j: int, rows: Tensor) -> Tensor:
        """Rows [M_j, heads, D] of keep[j] -> [B, heads, T, D] at their positions, zeros elsewhere."""
        b, t = self.shape
        full = rows.new_zeros(b * t, *rows.shape[1:]).index_copy(0, self.keep[j], rows)
        return full.view(b, t, *rows.shape[1:]).transpose(1, 2)

    def unpack(self, j: int, out: Tensor) -> Tensor:
        """[B, heads, T, D] -> rows [M_j, heads * D] of keep[j]."""
        heads, d = out.shape[1], out.shape[3]
        return out.transpose(1, 2).reshape(self.shape[0] * self.shape[1], heads * d)[self.keep[j]]


def _rank_in(member: Tensor) -> Tensor:
    """For a flat bool mask, the index of each True element among the True ones (garbage elsewhere)."""
    return member.long().cumsum(0) - 1


def plan_rows(loss_mask: Tensor, draft_target: Tensor, steps: int, mask_out_of_vocab: bool,
              own: int | None = None, start: int = 0) -> TTTPlan:
    """The rows of a batch (see TTTPlan), from its loss mask and the teacher's argmax as draft ids (-1 = OOV).

    own: plan only the first `own` positions of each row (a sequence-parallel rank's share; the rest of the
    [B, W] inputs is the window its labels and teachers reach into), at global positions start, start + 1, ...
    """
    b, w = loss_mask.shape
    t = w if own is None else own
    valid = [valid_positions(loss_mask, draft_target, j, mask_out_of_vocab)[:, :t].flatten() for j in range(steps)]
    counted = torch.stack([valid_positions(loss_mask, draft_target, j, False)[:, :t].sum()
                           for j in range(steps)]).float()
    keep_masks: list[Tensor] = [valid[-1]]
    for j in range(steps - 2, -1, -1):
        keep_masks.insert(0, keep_masks[0] | valid[j])
    keep = [m.nonzero().squeeze(1) for m in keep_masks]
    parent = [keep[0]] + [_rank_in(keep_masks[j - 1])[keep[j]] for j in range(1, steps)]
    scored = [v.nonzero().squeeze(1) for v in valid]
    score = [_rank_in(keep_masks[j])[scored[j]] for j in range(steps)]
    # t+1+j < W for every scored position, so it stays in the same row of the window
    teacher_at = [(s // t) * w + s % t + 1 + j for j, s in enumerate(scored)]
    need = torch.zeros(b * w, dtype=torch.bool, device=loss_mask.device)
    for at in teacher_at:
        need[at] = True
    rank = _rank_in(need)
    teacher_row = [rank[at] for at in teacher_at]
    return TTTPlan((b, t), keep, parent, score, need.nonzero().squeeze(1), teacher_row, counted, w, start)

