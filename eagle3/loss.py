"""The teacher, the loss and the metrics of EAGLE-3's training-time test.

The positions each step scores are eagle3.rows (the alignment is explained there); the head's unrolled forward
is eagle3.ttt (`ttt_unroll_rows`). Here: the target's distribution over the draft vocab on those rows
(Teacher), the draft's lm_head fused with the decayed soft cross-entropy averaged over each step's scored rows
(SoftCE, which the draft's forward calls; `ttt_loss` adds the per-step sums), and the accuracies and the
simulated acceptance length the trainer logs and selects checkpoints by.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor

from eagle3.rows import TTTPlan, shift_tokens, valid_positions
from eagle3.targets.argmax import row_max


# -------------------------------------------------------------------------------------------------- teacher
class Teacher:
    """The frozen target lm_head's draft-vocab rows, applied to stored final states: the target's distribution over
    the draft vocab, at the positions the loss scores. The full-vocab argmax the trainer also needs reads every row
    of the lm_head; it is computed once, where the states are captured (ArgmaxHead), so only the draft vocab's rows
    are kept here (Kimi-K2.5: 32000 of 163840 rows on the device).
    """

    def __init__(self, lm_head_weight: Tensor, d2t: Tensor, t2d: Tensor):
        v = t2d.shape[0]
        if lm_head_weight.shape[0] != v:
            raise ValueError(f"target lm_head has {lm_head_weight.shape[0]} rows but t2d covers {v} target ids")
        target_ids = torch.arange(d2t.shape[0]) + d2t.cpu().long()
        to_draft = torch.full((v,), -1, dtype=torch.int64)
        to_draft[target_ids] = torch.arange(d2t.shape[0])
        self.to_draft_host = to_draft  # batches are planned on the host (no device syncs in the step)
        self.to_draft = to_draft.to(lm_head_weight.device)
        """[V] the draft id of each target id, -1 outside the draft vocab."""
        self.draft_weight = lm_head_weight.detach()[target_ids.to(lm_head_weight.device)].clone()
        """[draft_vocab, H] in draft id order, in the dtype the target is served in (its logits are the ones the
        engine verifies against)."""
        self.draft_vocab = d2t.shape[0]

    @property
    def device(self) -> torch.device:
        return self.draft_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.draft_weight.dtype

    def to(self, device: torch.device | str) -> Teacher:
        self.to_draft, self.draft_weight = self.to_draft.to(device), self.draft_weight.to(device)
        return self

    @torch.no_grad()
    def probs(self, final: Tensor) -> Tensor:
        """[..., draft_vocab] float32: softmax of the target's logits over the draft vocab, in draft id order."""
        lead = final.shape[:-1]
        x = final.reshape(-1, final.shape[-1]).to(self.dtype)
        p = (x @ self.draft_weight.T).float()
        p -= p.amax(dim=-1, keepdim=True)
        p.exp_()
        p /= p.sum(dim=-1, keepdim=True)
        return p.view(*lead, self.draft_vocab)


# ----------------------------------------------------------------------------------------------------- loss
@dataclass
class StepStats:
    """Sums (not means) so that batches and ranks aggregate exactly."""

    loss_sum: Tensor  # [steps] soft-CE summed over the positions in the loss (detached)
    correct: Tensor  # [steps] draft argmax == target argmax (as draft id), over the positions in the loss
    valid: Tensor  # [steps] positions in the loss (the loss's denominator)
    counted: Tensor  # [steps] positions with a masked-in label, out-of-vocab teachers included (acc's denominator)
    chain_alive: Tensor  # [steps] positions whose draft chain reaches step j on greedy tokens (see greedy_chain)
    chain_hit: Tensor  # [steps] ...of which step j's draft token is the target's

    @classmethod
    def zeros(cls, steps: int, device: torch.device | str) -> StepStats:
        return cls(*(torch.zeros(steps, device=device) for _ in fields(cls)))

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def packed(self) -> Tensor:
        """[fields, steps]: one tensor for one all-reduce (StepStats(*packed) rebuilds it)."""
        return torch.stack([getattr(self, f.name) for f in fields(self)])


def greedy_chain(rows: TTTPlan, hits: list[Tensor], input_ids: Tensor, target_argmax: Tensor,
                 loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """([steps] alive, [steps] hit): the draft chains of the batch as an engine runs them on greedy text.

    An engine drafts from a context the target produced: the bonus token is the target's argmax, and step j
    is fed the draft's own token of step j-1, which equals the target's argmax when that step was accepted.
    Training text (ShareGPT's answers) often is not what the target would have said; at such a position the
    teacher-forced acc_j measures a context no engine sees. Here a position t starts a chain (alive at step 0)
    where its label is counted and its bonus token x_{t+1} is the target's argmax at t; it stays alive at step
    j where steps 0..j-1 hit and the token fed at step j (x_{t+1+j}) is the target's argmax at t+j, i.e. what
    the accepted draft token was. hit_j / alive_j is then the engine's acceptance rate of step j given the
    earlier ones, over the contexts where the text agrees with the target.
    """
    b, t = rows.shape  # the plan's positions: the first t of the [B, rows.window] inputs
    steps = rows.steps
    alive_n = torch.zeros(steps, device=input_ids.device)
    hit_n = torch.zeros(steps, device=input_ids.device)
    live = torch.ones(b * t, dtype=torch.bool, device=input_ids.device)
    for j in range(steps):
        hit = torch.zeros(b * t, dtype=torch.bool, device=input_ids.device)
        hit[rows.keep[j][rows.score[j]]] = hits[j]
        fed = shift_tokens(input_ids, 1 + j) == shift_tokens(target_argmax, j)  # x_{t+1+j} == argmax at t+j
        valid = valid_positions(loss_mask, target_argmax, j, False)
        live = live & fed[:, :t].flatten() & valid[:, :t].flatten()
        alive_n[j] = live.sum()
        live = live & hit
        hit_n[j] = live.sum()
    return alive_n, hit_n


class HeadOut(NamedTuple):
    """What the fused lm_head + soft cross-entropy (SoftCE) gives the trainer for one micro-batch."""

    loss: Tensor
    """sum_j scale_j * (soft-CE summed over step j's scored rows): the micro-batch's share of the loss."""
    ce_sum: Tensor
    """[steps] soft-CE summed over each step's scored rows (detached)."""
    argmax: tuple[Tensor, ...]
    """[len(score[j])] int64 per step: the draft's argmax at its scored rows."""


class _LinearSoftCE(torch.autograd.Function):
    """lm_head + soft cross-entropy of every TTT step in one pass, chunked over rows, gradients made on the way.

    A step's logits [rows, draft_vocab] exist one chunk of rows at a time: in that chunk the forward takes the
    row max and argmax, the softmax's normaliser and the cross-entropy against the teacher, then turns the logits
    in place into their gradient (softmax * sum(p) - p, times the step's scale) and multiplies it out into the
    gradients of the rows and of the lm_head weight. The backward only scales those by the incoming gradient:
    the loss is a scalar, so that gradient is one number. Nothing of [rows, draft_vocab] is kept for the backward
    (unfused, autograd keeps each step's log-softmax output), and the weight's gradient of all steps is one buffer.
    """

    @staticmethod
    def forward(ctx: Any, weight: Tensor, probs: Tensor, index: list[Tensor], scales: Tensor, chunk: int,
                want_grad: bool, *xs: Tensor) -> tuple[Tensor, ...]:
        dev = weight.device.type
        cd = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype  # the matmuls
        acc = torch.promote_types(cd, torch.float32)  # the softmax
        # The weight's gradient is summed over every chunk and step in float32 at least, and handed to autograd in
        # the weight's dtype: one rounding where bf16 weights (no autocast) would round at every chunk and step.
        gw_dtype = torch.promote_types(weight.dtype, acc)
        with torch.autocast(dev, enabled=False):
            w = weight.to(cd)
            grad_w = torch.zeros(weight.shape, dtype=gw_dtype, device=weight.device) if want_grad else None
            ce_sum = torch.zeros(len(xs), dtype=acc, device=weight.device)
            grads_x, argmaxes = [], []
            for j, x in enumerate(xs):
                am = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
                gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if want_grad else None
                for c0 in range(0, x.shape[0], chunk):
                    xc = x[c0 : c0 + chunk].to(cd)
                    z = (xc @ w.T).to(acc)
                    p = probs.index_select(0, index[j][c0 : c0 + chunk]).to(acc)
                    m, am[c0 : c0 + chunk] = row_max(z)
                    # soft-CE of a row = sum_v p_v (lse - z_v) = psum * log(s) - p . (z - m), s = sum_v exp(z_v - m):
                    # one exp pass, kept for the gradient, and no [c, V] log-softmax (passes: BENCHMARKS.md
                    # "Training speed"). Row dots, then their sum: one float32 sum over all c * V products lost 4 digits.
                    z.sub_(m[:, None])
                    psum = p.sum(-1)
                    pz = torch.linalg.vecdot(p, z)
                    s = z.exp_().sum(-1)
                    ce_sum[j] += (psum * s.log() - pz).sum()
                    if grad_w is None:
                        continue
                    # d loss / d logits = scale * (psum * softmax - p), in place
                    z.mul_((psum * scales[j] / s)[:, None]).addcmul_(p, -scales[j].to(acc))
                    g = z.to(cd)
                    gx[c0 : c0 + chunk] = g @ w
                    if gw_dtype == cd:
                        grad_w.addmm_(g.T, xc)
                    else:  # bf16 matmuls (autocast, or bf16 weights): a bf16 product added into the fp32 sum
                        grad_w.add_(g.T @ xc)
                argmaxes.append(am)
                grads_x.append(gx)
        total = (ce_sum * scales).sum()
        ctx.mark_non_differentiable(ce_sum, *argmaxes)
        ctx.grads, ctx.weight_dtype = (grad_w, grads_x), weight.dtype
        return (total, ce_sum, *argmaxes)

    @staticmethod
    def backward(ctx: Any, g: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.grads is None:
            raise RuntimeError("SoftCE's backward runs once per forward: it scales, in place, the gradients its "
                               "forward made (a [draft_vocab, H] copy would cost as much as the logits it saves)")
        grad_w, grads_x = ctx.grads
        ctx.grads = None
        if grad_w is None:
            raise RuntimeError("SoftCE ran without gradients (under no_grad or on frozen inputs)")
        return (grad_w.mul_(g).to(ctx.weight_dtype), None, None, None, None, None,
                *(gx.mul_(g.to(gx.dtype)) for gx in grads_x))


class SoftCE:
    """The draft's lm_head and the decayed soft cross-entropy of one micro-batch, fused and chunked.

    The draft calls it inside its forward (`Eagle3Draft.forward(..., head=)`) with each step's final-normed
    scored rows and its lm_head weight, so a DDP/FSDP wrapper sees the weight used within its forward. Step j's
    rows weigh scale_j = decay**j / denominators[j]; denominators [steps] counts the scored positions of the whole accumulation
    group on all ranks, so every position weighs the same whichever micro-batch or rank it fell in (None: this
    batch's own, a mean per step). probs [len(rows.teacher_pos), draft_vocab]: the teacher at rows.teacher_pos.
    `chunk` rows of logits are computed at a time (train.loss_chunk_rows).
    """

    def __init__(self, probs: Tensor, rows: TTTPlan, decay: float, denominators: Tensor | None = None,
                 chunk: int = 4096):
        counts = (rows.scored().to(probs.device) if denominators is None
                  else denominators.to(probs.device, torch.float32))
        decays = torch.tensor([decay**j for j in range(rows.steps)], device=probs.device)
        self.probs, self.rows, self.chunk = probs, rows, chunk
        self.scales = decays / counts.clamp(min=1)

    def __call__(self, xs: list[Tensor], weight: Tensor) -> HeadOut:
        index = [r.to(self.probs.device) for r in self.rows.teacher_row]
        return linear_soft_ce(xs, weight, self.probs, index, self.scales, self.chunk)


def linear_soft_ce(xs: list[Tensor], weight: Tensor, probs: Tensor, index: list[Tensor], scales: Tensor,
                   chunk: int) -> HeadOut:
    """sum_j scales[j] * sum_rows soft-CE(probs[index[j]], xs[j] @ weight.T), fused and chunked (_LinearSoftCE);
    the matmuls in the autocast dtype where autocast is on, the softmax in float32 (or float64 inputs' float64)."""
    want_grad = torch.is_grad_enabled() and (weight.requires_grad or any(x.requires_grad for x in xs))
    total, ce_sum, *am = _LinearSoftCE.apply(weight, probs, index, scales, chunk, want_grad, *xs)
    return HeadOut(total, ce_sum, tuple(am))


def ttt_loss(out: HeadOut, draft_target: Tensor, rows: TTTPlan, greedy: tuple[Tensor, Tensor, Tensor] | None = None,
             ) -> tuple[Tensor, StepStats]:
    """The micro-batch's loss (SoftCE: sum_j decay**j * soft-CE(teacher, draft) over step j's scored rows / denominator_j)
    and its per-step sums. draft_target [len(teacher_pos)]: the teacher's argmax as a draft id at
    rows.teacher_pos. greedy: (input_ids, target_argmax, loss_mask) [B, T] of the batch, for the chain counts
    of greedy_chain (zeros without)."""
    steps = rows.steps
    device = out.ce_sum.device
    hits = [am == draft_target[rows.teacher_row[j]] for j, am in enumerate(out.argmax)]
    correct = torch.stack([h.sum() for h in hits]).float()
    valid_n = rows.scored().to(device, torch.float32)
    chain = greedy_chain(rows, hits, *greedy) if greedy is not None else (torch.zeros(steps, device=device),) * 2
    return out.loss, StepStats(out.ce_sum.detach(), correct, valid_n, rows.counted.to(device), *chain)


def acceptance_length(acc: list[float] | Tensor) -> float:
    """Simulated chain acceptance 1 + sum_k prod_{j<=k} acc_j; the leading 1 is the target's bonus token."""
    total, run = 1.0, 1.0
    for a in (acc.tolist() if isinstance(acc, Tensor) else acc):
        run *= float(a)
        total += run
    return total


def summarise(stats: StepStats) -> dict[str, float]:
    """loss_j, acc_j, chain_acc_j per step and the simulated acceptance lengths (which count the bonus token).

    acc_j (teacher-forced, every counted position) and chain_acc_j (greedy_chain: step j's acceptance given the
    earlier steps', on text that agrees with the target) both count a position whose target argmax lies outside
    the draft vocab as a miss, as an engine does (the draft can never propose that token); the loss leaves such
    positions out when train.mask_out_of_vocab. sim_accept_len = 1 + sum_k prod_{j<=k} chain_acc_j is what an
    engine's acceptance length estimates (best-checkpoint selection uses it); sim_accept_len_tf is the same
    product over acc_j, which treats the steps as independent and every training token as greedy."""
    valid = stats.valid.clamp(min=1)
    acc = (stats.correct / stats.counted.clamp(min=1)).tolist()
    chain = (stats.chain_hit / stats.chain_alive.clamp(min=1)).tolist()
    out: dict[str, float] = {}
    for j, (ls, a, c) in enumerate(zip((stats.loss_sum / valid).tolist(), acc, chain, strict=True)):
        out[f"loss_{j}"] = ls
        out[f"acc_{j}"] = a
        out[f"chain_acc_{j}"] = c
    out["sim_accept_len_tf"] = acceptance_length(acc)
    out["sim_accept_len"] = acceptance_length(chain) if float(stats.chain_alive[0]) > 0 else out["sim_accept_len_tf"]
    return out
