"""The training-time test's forward: EAGLE-3's head unrolled over several draft steps in one pass, each step's
queries attending over the step-0 causal prefix plus the same position's keys from the steps before it, as an
engine's KV cache holds them when drafting j tokens ahead (the alignment and which rows are computed:
eagle3.rows; the head's layers: eagle3.model). `ttt_attention_fast` never builds a T x T tensor;
`ttt_attention_dense` is the reference it is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor
from torch.profiler import record_function

from eagle3.rows import TTTPlan, shift_tokens

Attention = Literal["fast", "dense"]


class UnrolledHead(Protocol):
    """What the unroll needs of a head (eagle3.model.Eagle3Draft): its layers cut around attention."""

    attn_scale: float
    num_layers: int

    def layer_inputs(self, i: int, input_ids: Tensor, hidden: Tensor, position_ids: Tensor,
                     extra: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]: ...

    def layer_block(self, i: int, hidden: Tensor, attn_flat: Tensor) -> Tensor: ...

    def handoff(self, hidden: Tensor) -> Tensor: ...

    def norm(self, hidden: Tensor) -> Tensor: ...


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, n_kv, K, D] -> [B, n_kv*n_rep, K, D] (GQA: each kv head serves n_rep query heads)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, sinks: Tensor | None = None) -> Tensor:
    """Causal SDPA of q [B, nh, T, D] over k, v [B, nkv, T, D] (query t sees keys 0..t), plus `sinks` [n, D]:
    n shared keys, each its own value, that every query sees. The sinks go first and n zero queries before the
    real ones, so the mask is SDPA's square upper-left causal one: its flash kernels (CUDA, and the CPU's)
    never build the T x T scores, where any explicit mask, or a lower-right one on the CPU, would."""
    n_rep = q.shape[1] // k.shape[1]
    # Repeated, not SDPA's enable_gqa: the CPU kernel's GQA ran 10-15% slower at 4K tokens (fp32 and bf16), and not
    # every CUDA kernel takes it (one that does not falls back to the T x T math kernel).
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    b, h, _, d = q.shape
    n = sinks.shape[0]
    s = sinks.expand(b, h, n, d)
    out = F.scaled_dot_product_attention(torch.cat([q.new_zeros(b, h, n, d), q], 2), torch.cat([s, k], 2),
                                         torch.cat([s, v], 2), is_causal=True, scale=scale)
    return out[:, :, n:]


class LocalAttention:
    """Attention with every position of the sequence in this process. eagle3.sequence_parallel's Ulysses has the
    same two methods, there over a share of the positions and all-to-alls between ranks."""

    def keys(self, k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
        """Step 0's keys and values [B, nkv, T, D] in the layout `attend` takes (here: as they are)."""
        return k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float, sinks: Tensor | None = None) -> Tensor:
        """causal_attention of q [B, nh, T, D] over keys from `keys`."""
        return causal_attention(q, k, v, scale, sinks)


LOCAL = LocalAttention()


def ttt_attention_fast(q: Tensor, k0: Tensor, v0: Tensor, ks: list[Tensor], vs: list[Tensor],
                       scale: float | None = None, over: LocalAttention = LOCAL) -> Tensor:
    """Exact TTT attention, memory linear in T: one causal SDPA over the step-0 keys plus j "sink" keys.

    The j same-position scores d_i(t) = q_t . k_i,t are computed elementwise and appended to each query as
    extra channels; j shared sink keys (one-hot in those channels) then score exactly d_i(t) for query t, and
    their one-hot values report the softmax weight p_i(t) each sink received, normalised jointly with the
    step-0 causal keys. The output is SDPA's step-0 part plus sum_i p_i(t) v_i,t.
    q [B, nh, T, D] and each ks[i], vs[i] [B, nkv, T, D]: positions 0..T-1 in order (a position without a query
    holds zeros; its output is meaningless); k0, v0 as `over.keys` lays them out. `scale`: the softmax scale
    (None: D**-0.5). `over`: where the positions live (this process, or a sequence-parallel group).
    """
    b, nh, t, d = q.shape
    scale = d**-0.5 if scale is None else scale
    n = len(ks)
    if n == 0:
        return over.attend(q, k0, v0, scale)
    n_rep = nh // ks[0].shape[1]
    dp = -(-(d + n) // 8) * 8  # padded head dim (kernels like multiples of 8)
    diag = torch.stack([(q * repeat_kv(k, n_rep)).sum(-1) for k in ks], dim=-1)  # [B, nh, T, n]
    q_aug = torch.cat([q, diag, q.new_zeros(b, nh, t, dp - d - n)], dim=-1)
    sinks = torch.zeros(n, dp, dtype=q.dtype, device=q.device)
    sinks[torch.arange(n), d + torch.arange(n)] = 1.0
    pad = (0, dp - d)
    out = over.attend(q_aug, F.pad(k0, pad), F.pad(v0, pad), scale, sinks)
    result = out[..., :d]
    for i, v in enumerate(vs):
        result = result + out[..., d + i : d + i + 1] * repeat_kv(v, n_rep)
    return result


def ttt_attention_dense(q: Tensor, k0: Tensor, v0: Tensor, ks: list[Tensor], vs: list[Tensor],
                        scale: float | None = None) -> Tensor:
    """Reference: all keys concatenated with an explicit [T, T + jT] mask (causal block + diagonal blocks)."""
    t = q.shape[2]
    n_rep = q.shape[1] // k0.shape[1]
    keys = torch.cat([k0, *ks], dim=2)
    values = torch.cat([v0, *vs], dim=2)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=q.device)
    mask = torch.cat([causal, *([eye] * len(ks))], dim=-1)
    return F.scaled_dot_product_attention(q, repeat_kv(keys, n_rep), repeat_kv(values, n_rep), attn_mask=mask,
                                          scale=scale)


def _run_step(checkpoint: bool, fn: Callable[..., tuple[Tensor, ...]], *args: Any) -> tuple[Tensor, ...]:
    if checkpoint and torch.is_grad_enabled():
        # The layer draws no random numbers: no RNG state to save and restore around the recompute.
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


class _Unroll:
    """The unrolled steps of one `ttt_unroll_rows` call; a step's tensors in and out are flat tuples, as
    torch.utils.checkpoint takes them: each layer's keys, then each layer's values."""

    def __init__(self, draft: UnrolledHead, input_ids: Tensor, rows: TTTPlan, attention: Attention,
                 over: LocalAttention, extra: Tensor | None = None, positions: Tensor | None = None):
        self.draft, self.input_ids, self.rows, self.attention, self.over = draft, input_ids, rows, attention, over
        self.extra = extra
        self.n = draft.num_layers
        b, t = rows.shape
        if positions is None:
            self.flat_pos = (rows.start + torch.arange(t, device=input_ids.device)).repeat(b)
        else:
            self.flat_pos = positions[:, :t].to(input_ids.device).flatten()

    def attend(self, q: Tensor, k0: Tensor, v0: Tensor, ks: list[Tensor], vs: list[Tensor]) -> Tensor:
        scale = self.draft.attn_scale
        if self.attention == "dense":
            return ttt_attention_dense(q, k0, v0, ks, vs, scale)
        return ttt_attention_fast(q, k0, v0, ks, vs, scale, self.over)

    def step_0(self, hidden0: Tensor) -> tuple[Tensor, ...]:
        """-> (the kept rows' output, each layer's keys, then each layer's values at every position)."""
        draft, rows = self.draft, self.rows
        b, t = rows.shape
        ids, pos = shift_tokens(self.input_ids, 1)[:, :t], self.flat_pos.view(b, t)
        h, k0s, v0s = hidden0, [], []
        for i in range(self.n):
            q, k0, v0 = draft.layer_inputs(i, ids, h, pos, self.extra)
            k0, v0 = self.over.keys(k0, v0, q.shape[1])
            out = self.attend(q, k0, v0, [], [])
            k0s.append(k0)
            v0s.append(v0)
            if i < self.n - 1:  # every position: they are the next layer's keys
                h = draft.layer_block(i, h, out.transpose(1, 2).reshape(b, t, -1))
            else:  # the last layer only where a row is kept
                h = draft.layer_block(i, h.reshape(b * t, -1)[rows.keep[0]], rows.unpack(0, out))
        return h, *k0s, *v0s

    def step_j(self, j: int, hidden: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
        """state: each layer's step-0 keys, their values, then each layer's keys of steps 1..j-1 at their rows,
        then their values. -> (the output, each layer's keys at this step's rows, then their values)."""
        draft, rows, n, per = self.draft, self.rows, self.n, j - 1
        k0s, v0s, earlier = state[:n], state[n:2 * n], state[2 * n:]
        keep = rows.keep[j]
        h = draft.handoff(hidden[rows.parent[j]])
        ids = shift_tokens(self.input_ids, 1 + j)[:, :rows.shape[1]].flatten()[keep]
        at = [rows.within(s + 1, j) for s in range(j)]
        new_k, new_v = [], []
        for i in range(n):
            q, k, v = draft.layer_inputs(i, ids[None], h[None], (self.flat_pos[keep] + j)[None], self.extra)
            k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [M_j, nkv, D]
            ks = [*earlier[i * per:(i + 1) * per], k]
            vs = [*earlier[(n + i) * per:(n + i + 1) * per], v]
            out = self.attend(rows.pack(j, q[0].transpose(0, 1)), k0s[i], v0s[i],
                              [rows.pack(j, x[w]) for x, w in zip(ks, at, strict=True)],
                              [rows.pack(j, x[w]) for x, w in zip(vs, at, strict=True)])
            h = draft.layer_block(i, h, rows.unpack(j, out))
            new_k.append(k)
            new_v.append(v)
        return h, *new_k, *new_v


def ttt_unroll_rows(draft: UnrolledHead, hidden0: Tensor, input_ids: Tensor, rows: TTTPlan,
                    attention: Attention = "fast", over: LocalAttention = LOCAL,
                    checkpoint: bool = False, extra: Tensor | None = None, positions: Tensor | None = None
                    ) -> list[Tensor]:
    """Final-normed output hidden [len(score[j]), H] of the scored rows of each unrolled step (the lm_head's
    input; see the module docstring).

    hidden0 [B, T, H]: fc of the features at the plan's T positions; input_ids [B, rows.window] (the tokens
    past them included). Step 0 computes keys and values at every position (they are every later query's
    prefix; with stacked layers, every layer but the last runs at every position for them); everything else
    (queries, the layer after attention, the final norm) runs only on the rows in `rows`, placed at their
    positions for attention. `checkpoint`: keep only each step's inputs and outputs (its hidden, keys and values)
    for the backward, which recomputes the step's layers (torch.utils.checkpoint). `extra`: the embeddings of ids
    past the vocab (eagle3.model.Eagle3Draft.embed: image positions under draft.image_inputs=target-embeddings).
    `positions`: [B, window] the RoPE positions of the window's tokens (None: the token index from `rows.start`):
    an M-RoPE target's temporal row under `placeholder`, as vLLM positions its draft; step j's query at a position
    sits j past it, as an engine's j-th draft token does.
    """
    if attention == "dense" and over is not LOCAL:
        raise ValueError("the dense reference attention runs in one process only")
    unroll, n = _Unroll(draft, input_ids, rows, attention, over, extra, positions), draft.num_layers
    run = partial(_run_step, checkpoint)
    with record_function("ttt_step_0"):  # named in a torch.profiler trace (benchmarks/bench_profile.py); free else
        hidden, *step0 = run(unroll.step_0, hidden0)
        states = [draft.norm(hidden[rows.score[0]])]
    ks: list[list[Tensor]] = [[] for _ in range(n)]  # layer i's keys and values of step s at keep[s]'s rows (s >= 1)
    vs: list[list[Tensor]] = [[] for _ in range(n)]
    for j in range(1, rows.steps):
        with record_function(f"ttt_step_{j}"):
            hidden, *new = run(partial(unroll.step_j, j), hidden, *step0, *(x for k in ks for x in k),
                               *(x for v in vs for x in v))
            for i in range(n):
                ks[i].append(new[i])
                vs[i].append(new[n + i])
            states.append(draft.norm(hidden[rows.score[j]]))
    return states
