"""Training-time test (TTT), the teacher, the loss and the metrics of EAGLE-3.

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
positions (not over all positions) and weighted decay**j.

Attention at step j: the causal prefix of step-0 keys (positions 0..t) plus the same position's keys from
steps 1..j (its own included), as the engine's KV cache holds them when drafting j tokens ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from eagle3.model import Eagle3Draft, repeat_kv

Attention = Literal["fast", "dense"]


# ------------------------------------------------------------------------------------------------ attention
def ttt_attention_fast(q: Tensor, k0: Tensor, v0: Tensor, ks: list[Tensor], vs: list[Tensor]) -> Tensor:
    """Exact TTT attention without a [T, (j+1)T] mask: one causal SDPA with j "sink" keys.

    The j same-position scores d_i(t) = q_t . k_i,t are computed elementwise and appended to each query as
    extra channels; j shared sink keys (one-hot in those channels) then score exactly d_i(t) for query t, and
    their one-hot values report the softmax weight p_i(t) each sink received, normalised jointly with the
    step-0 causal keys. The output is SDPA's step-0 part plus sum_i p_i(t) v_i,t. SDPA sees a lower-right
    causal mask (sinks first, visible to every query), so flash / memory-efficient kernels still apply.
    q [B, nh, T, D]; k0, v0 and each ks[i], vs[i] [B, nkv, T, D].
    """
    b, nh, t, d = q.shape
    n = len(ks)
    if n == 0:
        n_rep = nh // k0.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k0, n_rep), repeat_kv(v0, n_rep), is_causal=True)
    n_rep = nh // k0.shape[1]
    dp = -(-(d + n) // 8) * 8  # padded head dim (kernels like multiples of 8)
    diag = torch.stack([(q * repeat_kv(k, n_rep)).sum(-1) for k in ks], dim=-1)  # [B, nh, T, n]
    q_aug = torch.cat([q, diag, q.new_zeros(b, nh, t, dp - d - n)], dim=-1)
    sinks = torch.zeros(n, dp, dtype=q.dtype, device=q.device)
    sinks[torch.arange(n), d + torch.arange(n)] = 1.0
    sinks = sinks.expand(b, k0.shape[1], n, dp)
    pad = (0, dp - d)
    k_aug = torch.cat([sinks, F.pad(k0, pad)], dim=2)
    v_aug = torch.cat([sinks, F.pad(v0, pad)], dim=2)
    out = F.scaled_dot_product_attention(
        q_aug, repeat_kv(k_aug, n_rep), repeat_kv(v_aug, n_rep),
        attn_mask=causal_lower_right(t, t + n), scale=d**-0.5,
    )
    result = out[..., :d]
    for i, v in enumerate(vs):
        result = result + out[..., d + i : d + i + 1] * repeat_kv(v, n_rep)
    return result


def ttt_attention_dense(q: Tensor, k0: Tensor, v0: Tensor, ks: list[Tensor], vs: list[Tensor]) -> Tensor:
    """Reference: all keys concatenated with an explicit [T, (j+1)T] mask (causal block + diagonal blocks)."""
    t = q.shape[2]
    n_rep = q.shape[1] // k0.shape[1]
    keys = torch.cat([k0, *ks], dim=2)
    values = torch.cat([v0, *vs], dim=2)
    eye = torch.eye(t, dtype=torch.bool, device=q.device)
    mask = torch.cat([torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), *([eye] * len(ks))], dim=1)
    return F.scaled_dot_product_attention(q, repeat_kv(keys, n_rep), repeat_kv(values, n_rep), attn_mask=mask)


def shift_tokens(input_ids: Tensor, by: int) -> Tensor:
    """x_{t+by} at position t, zero-padded past the end (those positions are never valid)."""
    return F.pad(input_ids[:, by:], (0, by), value=0)


def ttt_unroll(draft: Eagle3Draft, hidden0: Tensor, input_ids: Tensor, steps: int,
               attention: Attention = "fast") -> list[Tensor]:
    """Logits [B, T, draft_vocab] for each of `steps` unrolled steps (see the module docstring)."""
    attend = ttt_attention_fast if attention == "fast" else ttt_attention_dense
    t = input_ids.shape[1]
    pos = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], t)
    hidden = hidden0
    k0 = v0 = None
    ks: list[Tensor] = []
    vs: list[Tensor] = []
    logits = []
    for j in range(steps):
        q, k, v = draft.attention_inputs(shift_tokens(input_ids, 1 + j), hidden, pos + j)
        if j == 0:
            k0, v0 = k, v
        else:
            ks.append(k)
            vs.append(v)
        assert k0 is not None and v0 is not None
        out = attend(q, k0, v0, ks, vs)
        hidden = draft.after_attention(hidden, out)
        logits.append(draft.logits(hidden))
    return logits


# -------------------------------------------------------------------------------------------------- teacher
@dataclass
class TeacherOutput:
    probs: Tensor
    """[..., draft_vocab] float32: the target's distribution restricted to the draft vocab, renormalised."""
    draft_target: Tensor
    """[...] int64: the target's FULL-vocab argmax as a draft id, -1 when it lies outside the draft vocab."""


class Teacher:
    """The frozen target lm_head, applied to stored final states in vocab chunks.

    Only [N, draft_vocab] (the restricted logits, softmaxed in place) and one [N, chunk] block exist at a time;
    a full [N, V] logits tensor (2.7 GB fp32 for 4096 tokens of Kimi's 163840 vocab) is never built. The draft
    rows are cut out of each chunk's logits, so restricted and full argmax come from the very same numbers.
    """

    def __init__(self, lm_head_weight: Tensor, d2t: Tensor, t2d: Tensor, chunk: int):
        self.weight = lm_head_weight.detach()
        self.t2d = t2d.bool().to(self.weight.device)
        self.chunk = chunk
        v = self.t2d.shape[0]
        if self.weight.shape[0] != v:
            raise ValueError(f"target lm_head has {self.weight.shape[0]} rows but t2d covers {v} target ids")
        to_draft = torch.full((v,), -1, dtype=torch.int64)
        to_draft[torch.arange(d2t.shape[0]) + d2t.cpu().long()] = torch.arange(d2t.shape[0])
        self.to_draft = to_draft.to(self.weight.device)
        self.draft_vocab = d2t.shape[0]

    def to(self, device: torch.device | str) -> Teacher:
        self.weight, self.t2d, self.to_draft = self.weight.to(device), self.t2d.to(device), self.to_draft.to(device)
        return self

    @torch.no_grad()
    def __call__(self, final: Tensor) -> TeacherOutput:
        lead = final.shape[:-1]
        x = final.reshape(-1, final.shape[-1]).to(self.weight.dtype)
        n = x.shape[0]
        restricted = torch.empty(n, self.draft_vocab, dtype=torch.float32, device=x.device)
        best = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
        best_id = torch.zeros(n, dtype=torch.int64, device=x.device)
        filled = 0
        for c0 in range(0, self.weight.shape[0], self.chunk):
            block = (x @ self.weight[c0 : c0 + self.chunk].T).float()  # [N, chunk]
            m, i = block.max(dim=-1)
            better = m > best
            best = torch.where(better, m, best)
            best_id = torch.where(better, i + c0, best_id)
            sel = self.t2d[c0 : c0 + self.chunk]
            k = int(sel.sum())
            if k:
                restricted[:, filled : filled + k] = block[:, sel]
                filled += k
            del block
        restricted -= restricted.max(dim=-1, keepdim=True).values
        restricted.exp_()
        restricted /= restricted.sum(dim=-1, keepdim=True)
        return TeacherOutput(restricted.view(*lead, -1), self.to_draft[best_id].view(lead))


# ----------------------------------------------------------------------------------------------------- loss
@dataclass
class StepStats:
    """Sums (not means) so that batches and ranks aggregate exactly."""

    loss_sum: Tensor  # [steps] soft-CE summed over valid positions (detached)
    correct: Tensor  # [steps] draft argmax == target argmax (as draft id), over valid positions
    valid: Tensor  # [steps] number of valid positions


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


def ttt_loss(logits: list[Tensor], teacher: TeacherOutput, loss_mask: Tensor, decay: float,
             mask_out_of_vocab: bool) -> tuple[Tensor, StepStats]:
    """sum_j decay**j * mean over step j's valid positions of soft-CE(teacher, draft); plus per-step sums."""
    steps = len(logits)
    b, t = loss_mask.shape
    total = logits[0].new_zeros((), dtype=torch.float32)
    loss_sum = torch.zeros(steps, device=loss_mask.device)
    correct = torch.zeros(steps, device=loss_mask.device)
    valid_n = torch.zeros(steps, device=loss_mask.device)
    for j, lg in enumerate(logits):
        n = t - 2 - j
        if n <= 0:
            continue
        valid = valid_positions(loss_mask, teacher.draft_target, j, mask_out_of_vocab)[:, :n]
        count = valid.sum()
        if count == 0:
            # Keep every parameter in the graph (DDP expects gradients for all of them each step).
            total = total + lg.sum() * 0.0
            continue
        sel = lg[:, :n][valid].float()  # [M, Vd]
        p = teacher.probs[:, 1 + j : 1 + j + n][valid]
        ce = -(p * torch.log_softmax(sel, dim=-1)).sum(-1)  # [M]
        total = total + (decay**j) * ce.sum() / count
        with torch.no_grad():
            loss_sum[j] = ce.sum()
            correct[j] = (sel.argmax(-1) == teacher.draft_target[:, 1 + j : 1 + j + n][valid]).sum()
            valid_n[j] = count
    return total, StepStats(loss_sum, correct, valid_n)


def acceptance_length(acc: list[float] | Tensor) -> float:
    """Simulated chain acceptance 1 + sum_k prod_{j<=k} acc_j; the leading 1 is the target's bonus token."""
    total, run = 1.0, 1.0
    for a in (acc.tolist() if isinstance(acc, Tensor) else acc):
        run *= float(a)
        total += run
    return total


def summarise(stats: StepStats) -> dict[str, float]:
    """loss_j, acc_j per step and the simulated acceptance length (which counts the bonus token)."""
    valid = stats.valid.clamp(min=1)
    acc = (stats.correct / valid).tolist()
    out: dict[str, float] = {}
    for j, (ls, a) in enumerate(zip((stats.loss_sum / valid).tolist(), acc, strict=True)):
        out[f"loss_{j}"] = ls
        out[f"acc_{j}"] = a
    out["sim_accept_len"] = acceptance_length(acc)
    return out
