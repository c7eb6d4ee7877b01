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
positions (not over all positions; over those of the whole accumulation group on all ranks in training) and
weighted decay**j. Only those positions are computed at all (Rows): the layer, norm, lm_head and teacher of a
step run on the rows that reach the loss, now or at a later step.

Attention at step j: the causal prefix of step-0 keys (positions 0..t) plus the same position's keys from
steps 1..j (its own included), as the engine's KV cache holds them when drafting j tokens ahead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from eagle3.model import Eagle3Draft, repeat_kv

Attention = Literal["fast", "dense"]


# ------------------------------------------------------------------------------------------------ attention
def _prefix_mask(q_pos: Tensor, t: int, sinks: int) -> Tensor:
    """Bool [B, 1, M, sinks + T]: query m (at position q_pos[b, m]) sees every sink and the keys 0..q_pos."""
    causal = torch.arange(t, device=q_pos.device) <= q_pos[..., None]  # [B, M, T]
    return F.pad(causal, (sinks, 0), value=True)[:, None]


def ttt_attention_fast(q: Tensor, k0: Tensor, v0: Tensor, ks: list[Tensor], vs: list[Tensor],
                       q_pos: Tensor | None = None) -> Tensor:
    """Exact TTT attention without a [T, (j+1)T] mask: one SDPA over the step-0 keys plus j "sink" keys.

    The j same-position scores d_i(t) = q_t . k_i,t are computed elementwise and appended to each query as
    extra channels; j shared sink keys (one-hot in those channels) then score exactly d_i(t) for query t, and
    their one-hot values report the softmax weight p_i(t) each sink received, normalised jointly with the
    step-0 causal keys. The output is SDPA's step-0 part plus sum_i p_i(t) v_i,t.
    q [B, nh, M, D]; k0, v0 [B, nkv, T, D]; each ks[i], vs[i] [B, nkv, M, D], aligned with q. q_pos [B, M]: the
    position of each query; None when the queries are positions 0..T-1 in order, which SDPA takes as a
    lower-right causal mask (sinks first, visible to every query) so flash kernels apply.
    """
    b, nh, m, d = q.shape
    t = k0.shape[2]
    n = len(ks)
    n_rep = nh // k0.shape[1]
    if n == 0:
        k, v = repeat_kv(k0, n_rep), repeat_kv(v0, n_rep)
        if q_pos is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_prefix_mask(q_pos, t, 0))
    dp = -(-(d + n) // 8) * 8  # padded head dim (kernels like multiples of 8)
    diag = torch.stack([(q * repeat_kv(k, n_rep)).sum(-1) for k in ks], dim=-1)  # [B, nh, M, n]
    q_aug = torch.cat([q, diag, q.new_zeros(b, nh, m, dp - d - n)], dim=-1)
    sinks = torch.zeros(n, dp, dtype=q.dtype, device=q.device)
    sinks[torch.arange(n), d + torch.arange(n)] = 1.0
    sinks = sinks.expand(b, k0.shape[1], n, dp)
    pad = (0, dp - d)
    k_aug = torch.cat([sinks, F.pad(k0, pad)], dim=2)
    v_aug = torch.cat([sinks, F.pad(v0, pad)], dim=2)
    mask = causal_lower_right(m, t + n) if q_pos is None else _prefix_mask(q_pos, t, n)
    out = F.scaled_dot_product_attention(q_aug, repeat_kv(k_aug, n_rep), repeat_kv(v_aug, n_rep), attn_mask=mask,
                                         scale=d**-0.5)
    result = out[..., :d]
    for i, v in enumerate(vs):
        result = result + out[..., d + i : d + i + 1] * repeat_kv(v, n_rep)
    return result


def ttt_attention_dense(q: Tensor, k0: Tensor, v0: Tensor, ks: list[Tensor], vs: list[Tensor],
                        q_pos: Tensor | None = None) -> Tensor:
    """Reference: all keys concatenated with an explicit [M, T + jM] mask (causal block + diagonal blocks)."""
    b, _, m, _ = q.shape
    t = k0.shape[2]
    n_rep = q.shape[1] // k0.shape[1]
    if q_pos is None:
        q_pos = torch.arange(m, device=q.device).expand(b, m)
    keys = torch.cat([k0, *ks], dim=2)
    values = torch.cat([v0, *vs], dim=2)
    eye = torch.eye(m, dtype=torch.bool, device=q.device).expand(b, 1, m, m)
    mask = torch.cat([_prefix_mask(q_pos, t, 0), *([eye] * len(ks))], dim=-1)
    return F.scaled_dot_product_attention(q, repeat_kv(keys, n_rep), repeat_kv(values, n_rep), attn_mask=mask)


def shift_tokens(input_ids: Tensor, by: int) -> Tensor:
    """x_{t+by} at position t, zero-padded past the end (those positions are never valid)."""
    return F.pad(input_ids[:, by:], (0, by), value=0)


# ------------------------------------------------------------------------------------------------ the rows
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
class Rows:
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

    def to(self, device: torch.device | str) -> Rows:
        def move(x: Any) -> Any:
            if isinstance(x, Tensor):
                return x.to(device, non_blocking=True)
            return [move(v) for v in x] if isinstance(x, list) else x

        return Rows(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

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


def plan_rows(loss_mask: Tensor, draft_target: Tensor, steps: int, mask_out_of_vocab: bool) -> Rows:
    """The rows of a batch (see Rows), from its loss mask and the teacher's argmax as draft ids (-1 = OOV)."""
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
    return Rows((b, t), keep, parent, score, need.nonzero().squeeze(1), teacher_row, counted, slot, width, q_pos)


def every_row(b: int, t: int, steps: int, device: torch.device | str = "cpu") -> Rows:
    """Every position computed and scored at every step (the reference unroll, and decode tests)."""
    all_ = torch.arange(b * t, device=device)
    return Rows((b, t), [all_] * steps, [all_] * steps, [all_] * steps, all_, [all_] * steps,
                torch.full((steps,), float(b * t), device=device), [all_] * steps, [t] * steps, [None] * steps)


# ------------------------------------------------------------------------------------------------ the unroll
def _rows(x: Tensor) -> Tensor:
    """[B, heads, T, D] -> [B*T, heads, D]."""
    return x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])


def ttt_unroll_rows(draft: Eagle3Draft, hidden0: Tensor, input_ids: Tensor, rows: Rows,
                    attention: Attention = "fast") -> list[Tensor]:
    """Logits [len(score[j]), draft_vocab] of the scored rows of each unrolled step (see the module docstring).

    Step 0 computes keys and values at every position (they are every later query's prefix); everything else
    (queries, attention, the layer after it, norm and lm_head) runs only on the rows in `rows`, each batch row's
    kept queries packed to the left and masked by their own positions.
    """
    attend = ttt_attention_fast if attention == "fast" else ttt_attention_dense
    b, t = input_ids.shape
    flat_pos = torch.arange(t, device=input_ids.device).repeat(b)
    keep = rows.keep[0]
    q, k0, v0 = draft.attention_inputs(shift_tokens(input_ids, 1), hidden0, flat_pos.view(b, t))
    out = attend(rows.pack(0, _rows(q)[keep]), k0, v0, [], [], rows.q_pos[0])
    hidden = draft.block(hidden0.reshape(b * t, -1)[keep], rows.unpack(0, out))  # [M0, H]
    logits = [draft.logits(hidden[rows.score[0]])]
    ks: list[Tensor] = []  # step i's keys and values at the rows of keep[i] (i = 1, 2, ...)
    vs: list[Tensor] = []
    for j in range(1, rows.steps):
        keep = rows.keep[j]
        hidden = hidden[rows.parent[j]]
        ids = shift_tokens(input_ids, 1 + j).flatten()[keep]
        q, k, v = draft.attention_inputs(ids[None], hidden[None], (flat_pos[keep] + j)[None])
        ks.append(k[0].transpose(0, 1))
        vs.append(v[0].transpose(0, 1))
        at = [rows.within(i + 1, j) for i in range(len(ks))]
        out = attend(rows.pack(j, q[0].transpose(0, 1)), k0, v0, [rows.pack(j, x[w]) for x, w in zip(ks, at, strict=True)],
                     [rows.pack(j, x[w]) for x, w in zip(vs, at, strict=True)], rows.q_pos[j])
        hidden = draft.block(hidden, rows.unpack(j, out))
        logits.append(draft.logits(hidden[rows.score[j]]))
    return logits


def ttt_unroll(draft: Eagle3Draft, hidden0: Tensor, input_ids: Tensor, steps: int,
               attention: Attention = "fast") -> list[Tensor]:
    """Logits [B, T, draft_vocab] of every position at each of `steps` unrolled steps (the reference)."""
    b, t = input_ids.shape
    rows = every_row(b, t, steps, input_ids.device)
    return [x.view(b, t, -1) for x in ttt_unroll_rows(draft, hidden0, input_ids, rows, attention)]


# -------------------------------------------------------------------------------------------------- teacher
@dataclass
class TeacherOutput:
    probs: Tensor
    """[..., draft_vocab] float32: the target's distribution restricted to the draft vocab, renormalised."""
    draft_target: Tensor
    """[...] int64: the target's FULL-vocab argmax as a draft id, -1 when it lies outside the draft vocab."""


def lm_head_argmax(weight: Tensor, final: Tensor, chunk: int) -> Tensor:
    """[...] int64 target ids: the argmax of final @ weight.T over the full vocab, in vocab chunks of `chunk`
    rows, so a [N, V] logits tensor is never built. Extraction stores it; the trainer computes it for caches
    without it, in the same dtype and chunks (so both give the same ids)."""
    return lm_head_max(weight, final, chunk)[1]


@torch.no_grad()
def lm_head_max(weight: Tensor, final: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """([...] float32 max logit, [...] int64 its target id) of final @ weight.T, chunked (see lm_head_argmax)."""
    lead = final.shape[:-1]
    x = final.reshape(-1, final.shape[-1]).to(weight.dtype)
    n = x.shape[0]
    best = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
    best_id = torch.zeros(n, dtype=torch.int64, device=x.device)
    for c0 in range(0, weight.shape[0], chunk):
        m, i = (x @ weight[c0 : c0 + chunk].T).float().max(dim=-1)
        better = m > best
        best = torch.where(better, m, best)
        best_id = torch.where(better, i + c0, best_id)
    return best.view(lead), best_id.view(lead)


class ArgmaxHead:
    """The target's lm_head, to compute the full-vocab argmax of each token once, where its states are captured.

    The trainer needs that argmax (as a draft id, or -1) to mask out-of-vocab positions, and getting it reads
    every row of the lm_head: 6x the rows of the loss's draft vocab for SmolLM2, 5x for Kimi-K2.5. Extraction
    stores it in the cache (as target ids: the cache does not depend on the draft vocab) and online capture hands
    it over with the states. The weights are the target's dtype and the trainer's chunking, so the ids are the
    ones the trainer would compute; the backend's own lm_head is used where it has one in memory.
    """

    def __init__(self, weight: Tensor, chunk: int):
        self.weight, self.chunk = weight.detach(), chunk

    @classmethod
    def for_backend(cls, cfg: Any, backend: Any) -> ArgmaxHead:
        weight = getattr(backend, "lm_head_weight", None)
        if weight is None:  # e.g. SGLang: the weights live in the server
            from eagle3.precision import DTYPES
            from eagle3.targets.weights import load_lm_head

            device = cfg.target.device
            if device == "auto" or (device.startswith("cuda") and not torch.cuda.is_available()):
                device = "cuda" if torch.cuda.is_available() else "cpu"
            weight = load_lm_head(cfg).to(device, DTYPES[cfg.target.dtype])
        return cls(weight, cfg.train.teacher_chunk)

    def __call__(self, final: Tensor) -> Tensor:
        """[T] int32 target ids (on the CPU) of final [T, H]."""
        return lm_head_argmax(self.weight, final.to(self.weight.device), self.chunk).to("cpu", torch.int32)


class Teacher:
    """The frozen target lm_head, applied to stored final states.

    Its two products cost very different amounts. The full-vocab argmax (as a draft id, -1 when out of the
    draft vocab) reads every row of the lm_head, in vocab chunks so that a full [N, V] logits tensor (2.7 GB
    fp32 for 4096 tokens of Kimi's 163840 vocab) is never built; it depends on the sample only, so the trainer
    computes it once per sample (TeacherTargets). The distribution over the draft vocab reads only the draft
    vocab's rows, and only at the positions the loss scores.
    """

    def __init__(self, lm_head_weight: Tensor, d2t: Tensor, t2d: Tensor, chunk: int):
        self.weight = lm_head_weight.detach()
        self.chunk = chunk
        v = t2d.shape[0]
        if self.weight.shape[0] != v:
            raise ValueError(f"target lm_head has {self.weight.shape[0]} rows but t2d covers {v} target ids")
        target_ids = torch.arange(d2t.shape[0]) + d2t.cpu().long()
        to_draft = torch.full((v,), -1, dtype=torch.int64)
        to_draft[target_ids] = torch.arange(d2t.shape[0])
        self.to_draft = to_draft.to(self.weight.device)
        self.to_draft_host = to_draft  # batches are planned on the host (no device syncs in the step)
        self.draft_weight = self.weight[target_ids.to(self.weight.device)]  # [draft_vocab, H], draft id order
        self.draft_vocab = d2t.shape[0]

    def to(self, device: torch.device | str) -> Teacher:
        self.weight, self.to_draft = self.weight.to(device), self.to_draft.to(device)
        self.draft_weight = self.draft_weight.to(device)
        return self

    def argmax(self, final: Tensor) -> Tensor:
        """[...] int64: the full-vocab argmax of the target's logits (a target id)."""
        return lm_head_argmax(self.weight, final, self.chunk)

    def targets(self, final: Tensor) -> Tensor:
        """[...] int64: the full-vocab argmax of the target's logits, as a draft id (-1 when out of vocab)."""
        return self.to_draft[self.argmax(final)]

    @torch.no_grad()
    def probs(self, final: Tensor) -> Tensor:
        """[..., draft_vocab] float32: softmax of the target's logits over the draft vocab, in draft id order."""
        lead = final.shape[:-1]
        x = final.reshape(-1, final.shape[-1]).to(self.weight.dtype)
        p = (x @ self.draft_weight.T).float()
        p -= p.max(dim=-1, keepdim=True).values
        p.exp_()
        p /= p.sum(dim=-1, keepdim=True)
        return p.view(*lead, self.draft_vocab)

    def __call__(self, final: Tensor) -> TeacherOutput:
        return TeacherOutput(self.probs(final), self.targets(final))


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


def greedy_chain(rows: Rows, hits: list[Tensor], input_ids: Tensor, target_argmax: Tensor,
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
    b, t = rows.shape
    steps = rows.steps
    alive_n = torch.zeros(steps, device=input_ids.device)
    hit_n = torch.zeros(steps, device=input_ids.device)
    live = torch.ones(b * t, dtype=torch.bool, device=input_ids.device)
    for j in range(steps):
        hit = torch.zeros(b * t, dtype=torch.bool, device=input_ids.device)
        hit[rows.keep[j][rows.score[j]]] = hits[j]
        fed = shift_tokens(input_ids, 1 + j) == shift_tokens(target_argmax, j)  # x_{t+1+j} == argmax at t+j
        live = live & fed.flatten() & valid_positions(loss_mask, target_argmax, j, False).flatten()
        alive_n[j] = live.sum()
        live = live & hit
        hit_n[j] = live.sum()
    return alive_n, hit_n


def ttt_loss(logits: list[Tensor], probs: Tensor, draft_target: Tensor, rows: Rows, decay: float,
             norm: Tensor | None = None, greedy: tuple[Tensor, Tensor, Tensor] | None = None,
             ) -> tuple[Tensor, StepStats]:
    """sum_j decay**j * (soft-CE(teacher, draft) summed over step j's scored rows) / norm[j]; plus per-step sums.

    logits[j] holds step j's scored rows (ttt_unroll_rows); probs [len(teacher_pos), draft_vocab] and
    draft_target [len(teacher_pos)] the teacher at rows.teacher_pos. norm [steps]: the scored positions of the
    whole accumulation group on all ranks, so every position weighs the same whichever micro-batch or rank it
    fell in; None: this batch's own (a mean per step). greedy: (input_ids, target_argmax, loss_mask) [B, T] of the
    batch, for the chain counts of greedy_chain (zeros without).
    """
    steps = len(logits)
    device = probs.device
    total = probs.new_zeros((), dtype=torch.float32)
    loss_sum, correct, valid_n = (torch.zeros(steps, device=device) for _ in range(3))
    hits: list[Tensor] = []
    for j, lg in enumerate(logits):
        count = lg.shape[0]
        if count == 0:
            # Keep every parameter in the graph (DDP expects gradients for all of them each step).
            total = total + lg.sum() * 0.0
            hits.append(torch.zeros(0, dtype=torch.bool, device=device))
            continue
        p = probs[rows.teacher_row[j]]
        z = lg.float()  # argmax of bf16 logits on a CPU costs 2x a log_softmax of float32 ones
        ce = -(p * torch.log_softmax(z, dim=-1)).sum(-1)  # [M]
        total = total + (decay**j) * ce.sum() / (count if norm is None else norm[j])
        with torch.no_grad():
            loss_sum[j] = ce.sum()
            hits.append(z.argmax(-1) == draft_target[rows.teacher_row[j]])
            correct[j] = hits[-1].sum()
            valid_n[j] = count
    chain = greedy_chain(rows, hits, *greedy) if greedy is not None else (torch.zeros(steps, device=device),) * 2
    return total, StepStats(loss_sum, correct, valid_n, rows.counted.to(device), *chain)


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
