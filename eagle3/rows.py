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
    from the step before.
    """

    shape: tuple[int, int]
    keep: list[Tensor]
    """Step j: sorted flat positions whose step-j output hidden is needed."""
    parent: list[Tensor]
    """Step j >= 1: where each keep[j] position sits in keep[j-1] (parent[0] is unused)."""
    score: list[Tensor]
    """Step j: where each position scored at step j sits in keep[j]."""
    teacher_pos: Tensor
    """Sorted flat positions whose teacher distribution some step needs (t+1+j of a scored (j, t))."""
    teacher_row: list[Tensor]
    """Step j: the row of teacher_pos holding each scored position's teacher."""
    counted: Tensor
    """[steps] float: positions with a masked-in label at step j, out-of-vocab teachers included (acc's denominator)."""
    slot: list[Tensor]
    """Step j: where each keep[j] position sits in the [B, width[j]] query layout of that step's attention (each
    batch row's kept positions packed to the left)."""
    width: list[int]
    q_pos: list[Tensor | None]
    """Step j: [B, width[j]] the position of each query slot (0 in unused slots); None when the slots are the
    positions 0..T-1 themselves (every row kept), so attention can use its causal kernel."""

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
        """Rows [M_j, heads, D] of keep[j] -> [B, heads, width[j], D] in step j's query layout, zeros elsewhere."""
        b = self.shape[0]
        full = rows.new_zeros(b * self.width[j], *rows.shape[1:]).index_copy(0, self.slot[j], rows)
        return full.view(b, self.width[j], *rows.shape[1:]).transpose(1, 2)

    def unpack(self, j: int, out: Tensor) -> Tensor:
        """[B, heads, width[j], D] -> rows [M_j, heads * D] of keep[j]."""
        heads, d = out.shape[1], out.shape[3]
        return out.transpose(1, 2).reshape(self.shape[0] * self.width[j], heads * d)[self.slot[j]]


def _rank_in(member: Tensor) -> Tensor:
    """For a flat bool mask, the index of each True element among the True ones (garbage elsewhere)."""
    return member.long().cumsum(0) - 1


def plan_rows(loss_mask: Tensor, draft_target: Tensor, steps: int, mask_out_of_vocab: bool) -> TTTPlan:
    """The rows of a batch (see TTTPlan), from its loss mask and the teacher's argmax as draft ids (-1 = OOV)."""
    b, t = loss_mask.shape
    valid = [valid_positions(loss_mask, draft_target, j, mask_out_of_vocab).flatten() for j in range(steps)]
    counted = torch.stack([valid_positions(loss_mask, draft_target, j, False).sum() for j in range(steps)]).float()
    keep_masks: list[Tensor] = [valid[-1]]
    for j in range(steps - 2, -1, -1):
        keep_masks.insert(0, keep_masks[0] | valid[j])
    keep = [m.nonzero().squeeze(1) for m in keep_masks]
    parent = [keep[0]] + [_rank_in(keep_masks[j - 1])[keep[j]] for j in range(1, steps)]
    scored = [v.nonzero().squeeze(1) for v in valid]
    score = [_rank_in(keep_masks[j])[scored[j]] for j in range(steps)]
    need = torch.zeros(b * t, dtype=torch.bool, device=loss_mask.device)
    for j in range(steps):
        need[scored[j] + 1 + j] = True  # t+1+j < T for every scored position, so it stays in the same row
    rank = _rank_in(need)
    teacher_row = [rank[scored[j] + 1 + j] for j in range(steps)]
    slot, width, q_pos = [], [], []
    for k in keep:
        row, pos = k // t, k % t
        counts = torch.bincount(row, minlength=b)
        w = int(counts.max()) if k.numel() else 0
        s = row * w + torch.arange(k.numel(), device=k.device) - (counts.cumsum(0) - counts)[row]
        slot.append(s)
        width.append(w)
        q_pos.append(torch.zeros(b * w, dtype=torch.int64, device=k.device).index_copy(0, s, pos).view(b, w))
    return TTTPlan((b, t), keep, parent, score, need.nonzero().squeeze(1), teacher_row, counted, slot, width, q_pos)


def every_row(b: int, t: int, steps: int, device: torch.device | str = "cpu") -> TTTPlan:
    """Every position computed and scored at every step (the reference unroll, and decode tests)."""
    all_ = torch.arange(b * t, device=device)
    return TTTPlan((b, t), [all_] * steps, [all_] * steps, [all_] * steps, all_, [all_] * steps,
                torch.full((steps,), float(b * t), device=device), [all_] * steps, [t] * steps, [None] * steps)
