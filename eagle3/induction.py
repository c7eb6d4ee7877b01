"""A copy (induction) circuit written into the first draft layer's attention at init (`draft.copy_init`).

Prompt lookup beats a trained head wherever the answer re-emits its context (BENCHMARKS.md "Code and edits"), and a
head does not learn to copy from the loss at a recipe's budget: induction heads form in a language model after far
more tokens than a draft head trains on. Yet one layer of the head can copy as it stands. At draft position t the
layer sees the token x = x_{t+1} (its embedding) and the target's states at t; at a context position m its key can
hold the token the target read there (t_m, linearly readable from the target's fused states) and the token before
it (t_{m-1}, partly readable), and its value the token it was fed (t_{m+1}). A query holding
x and t_t therefore attends where the same two tokens occurred, and returns the token that followed them: the
bigram lookup prompt lookup does, written in the engines' own weights (nothing new for SGLang or vLLM to load).

What is set, for the first `groups` kv heads of the first layer (and their query heads):
- fc keeps its random init outside a small subspace U of the feature, where it writes the two token readouts (ridge
  fits on the training cache's states, `fit_readouts`), in a whitened basis of the embedding;
- keys and queries use only the lowest-frequency RoPE pairs (they turn least with position: a warning says how
  far over LOW_FREQ_SPAN), other dims zero; the softmax is sharpened so that a bigram match dominates;
- values carry the token fed at m in the whitened embedding basis (head_dim components per kv head), and o_proj
  maps them back onto the embedding directions, which the lm_head (the target's rows) reads.
Everything else is the default init; training is free to use, sharpen or drop the circuit.

The bigram half of the query reads the target's token at the query's position: right for the first drafted token,
one token stale at the later ones (the draft's own hidden carries it). The output is written in embedding directions,
which the lm_head reads where the target ties the two (SmolLM2 does). What it does to a trained head: BENCHMARKS.md
"A copy circuit at init".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from eagle3.model import Eagle3Draft

log = logging.getLogger("eagle3")

LOW_FREQ_SPAN = 1024
"""Positions over which a match should survive RoPE: a warning says when the chosen pairs turn more than half a
radian over it (the count of pairs is fixed, `write_copy_circuit`, so a larger theta keeps more of the match)."""
FIT_POSITIONS = 32_768
"""At most this many positions fit the readouts: [positions, 3H] float is 2.8 GB at Kimi-K2.5's width."""


@dataclass
class Readouts:
    """Linear maps from the target's fused states [3H] at position m to embedding space [H]."""

    current: Tensor
    """[3H, H]: the token the target read at m."""
    previous: Tensor
    """[3H, H]: the token before it."""
    current_acc: float
    previous_acc: float
    """Held-out nearest-embedding accuracy of each map (the fit's own check)."""


def _ridge(x: Tensor, y: Tensor, lam: float) -> Tensor:
    scale = x.pow(2).mean(0).sqrt().clamp_min(1e-6)  # per-dim scale: the target's massive-activation dims
    xs = x / scale
    # the penalty grows with the positions, so that lam means the same whatever the sample count
    w = torch.linalg.solve(xs.T @ xs + lam * len(x) / 1000 * torch.eye(x.shape[1], dtype=x.dtype), xs.T @ y)
    return w / scale[:, None]


def _nearest(x: Tensor, table: Tensor, chunk: int = 1024) -> Tensor:
    """The row of `table` (unit rows) nearest each row of `x` by cosine, a chunk of rows at a time (a 164K vocab)."""
    return torch.cat([(torch.nn.functional.normalize(p, dim=-1) @ table.T).argmax(-1) for p in x.split(chunk)])


def fit_readouts(aux: list[Tensor], input_ids: list[Tensor], embed: Tensor, lam: float = 1.0) -> Readouts:
    """Ridge fits of the current and previous token's embedding from the fused states, on 80% of the positions (at
    most FIT_POSITIONS in all), checked on the rest (nearest embedding by cosine)."""
    x = torch.cat([a[1:].float() for a in aux])[:FIT_POSITIONS]
    cur = torch.cat([i[1:] for i in input_ids])[:FIT_POSITIONS]
    prev = torch.cat([i[:-1] for i in input_ids])[:FIT_POSITIONS]
    e = embed.float()
    n = int(0.8 * len(x))
    en = torch.nn.functional.normalize(e, dim=-1)

    def fit(ids: Tensor) -> tuple[Tensor, float]:
        w = _ridge(x[:n], e[ids[:n]], lam)
        return w, float((_nearest(x[n:] @ w, en) == ids[n:]).float().mean())

    wc, ac = fit(cur)
    wp, ap = fit(prev)
    return Readouts(wc, wp, ac, ap)


def low_frequency_pairs(inv_freq: Tensor, count: int) -> Tensor:
    """The `count` RoPE pairs (indices i: dims i and i + D/2) that rotate least."""
    order = torch.argsort(inv_freq)
    pairs = order[:count]
    turn = float(inv_freq[pairs].max()) * LOW_FREQ_SPAN
    if turn > 0.5:
        log.warning("copy_init: the %d lowest-frequency RoPE pairs turn up to %.2f rad over %d positions; matches "
                    "far apart score lower", count, turn, LOW_FREQ_SPAN)
    return pairs


@dataclass
class _Basis:
    """The principal directions of the draft vocab's embeddings (rows of `vh`), their singular values `s`, and the
    same directions whitened (`white`: scaled by mean(s) / s, so that every component weighs alike in a match)."""

    s: Tensor
    vh: Tensor
    white: Tensor


def _embedding_basis(e: Tensor, t2d: Tensor, components: int) -> _Basis:
    ed = e[t2d.nonzero().flatten()] if t2d.any() else e
    _, s, vh = torch.linalg.svd(ed - ed.mean(0), full_matrices=False)
    rank = int((s > 1e-4 * s[0]).sum())  # centring takes one dimension from a vocab no larger than H
    if components > rank:
        raise ValueError(f"draft.copy_init: its values carry {components} components of the draft vocab's "
                         f"embeddings, which span {rank}; copy with fewer kv heads")
    s, vh = s[:rank], vh[:rank]
    return _Basis(s, vh, vh / s[:, None] * s.mean())


def _write_fc(fc: Tensor, readouts: Readouts, white: Tensor, r_cur: int, r_prev: int, sample_aux: Tensor,
              feature_gain: float) -> tuple[Tensor, Tensor, Tensor, float]:
    """fc keeps its random init outside a subspace U (random orthonormal), where it writes the two readouts.
    Returns (U's current-token and previous-token columns, the new fc, the default feature's rms)."""
    h = fc.shape[0]
    basis = torch.linalg.qr(torch.randn(h, r_cur + r_prev, generator=torch.Generator().manual_seed(0)))[0]
    u_cur, u_prev = basis[:, :r_cur], basis[:, r_cur:]
    rows_cur = white[:r_cur] @ readouts.current.T  # [r_cur, 3H]
    rows_prev = white[:r_prev] @ readouts.previous.T
    default_rms = (sample_aux @ fc.float().T).pow(2).mean().sqrt()
    part = (sample_aux @ rows_cur.T).pow(2).mean().sqrt()
    gain = float(default_rms / part) * feature_gain  # the readouts against the default feature's scale
    new_fc = (torch.eye(h) - basis @ basis.T) @ fc.float() + gain * (u_cur @ rows_cur + u_prev @ rows_prev)
    fc.copy_(new_fc.to(fc.dtype))
    return u_cur, u_prev, new_fc, float(default_rms)


def _mean_norm(x: Tensor) -> float:
    return float(x.norm(dim=-1).mean())


@torch.no_grad()
def write_copy_circuit(draft: Eagle3Draft, readouts: Readouts, embed: Tensor, groups: int,
                       sample_aux: Tensor, prev_weight: float = 0.7, sharpness: float = 20.0,
                       feature_gain: float = 0.5, output_gain: float = 2.0) -> None:
    """Set the first `groups` kv heads of the draft's first layer (and fc's subspace) to the copy circuit."""
    attn = draft.midlayer.self_attn
    h, d, n_kv, n_rep = draft.config.hidden_size, attn.head_dim, attn.n_kv, attn.n_heads // attn.n_kv
    if not 1 <= groups <= n_kv:
        raise ValueError(f"draft.copy_init={groups}: the first layer has {n_kv} kv heads")
    e, aux = embed.float(), sample_aux.float()
    t2d = draft.t2d.cpu().bool()
    if not torch.allclose(draft.lm_head.weight.detach().float().cpu(), e[t2d.nonzero().flatten()], atol=1e-3):
        log.warning("copy_init: the target's lm_head is not its embeddings; the circuit writes embedding directions, "
                    "which this lm_head reads only in part")
    b = _embedding_basis(e, t2d, groups * d)
    # 3/8 of a head's pairs match (12 of 32 at head_dim 64: the ones that turn least); of their dims, two thirds
    # hold the current token and one third the one before it (its readout is the weaker)
    pairs = low_frequency_pairs(attn.rotary_emb.inv_freq.cpu(), d // 2 * 3 // 8)
    dims = torch.cat([pairs, pairs + d // 2])
    r_cur, r_prev = len(dims) - len(dims) // 3, len(dims) // 3
    u_cur, u_prev, new_fc, default_rms = _write_fc(draft.fc.weight, readouts, b.white, r_cur, r_prev, aux,
                                                   feature_gain)
    # the layer's input: [input_layernorm(emb) | hidden_norm(feature)]; both norms' weights are 1 at init
    feat = aux @ new_fc.T
    feat = feat / feat.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
    k_cur, k_prev = 1.0 / _mean_norm(feat @ u_cur), 1.0 / _mean_norm(feat @ u_prev)  # keys of ~unit norm
    a = e / e.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)  # a padding row is zero
    q_emb = 1.0 / _mean_norm(a @ b.white[:r_cur].T)
    logit = sharpness * math.sqrt(d)  # the attention multiplies by 1/sqrt(D)
    once = (a[:4096] @ b.white[:groups * d].T) @ b.vh[:groups * d]  # the output's scale, on a sample of tokens
    out_gain = output_gain * default_rms / float(once.pow(2).mean().sqrt())  # against the feature's rms
    key, query = torch.zeros(d, 2 * h), torch.zeros(d, 2 * h)
    key[dims[:r_cur], h:], key[dims[r_cur:], h:] = k_cur * u_cur.T, k_prev * u_prev.T
    query[dims[:r_cur], :h] = logit * q_emb * b.white[:r_cur]
    query[dims[r_cur:], h:] = logit * prev_weight * k_cur * u_cur[:, :r_prev].T
    for g in range(groups):
        comps = slice(g * d, (g + 1) * d)  # this kv head's share of the embedding's components
        value = torch.zeros(d, 2 * h)
        value[:, :h] = b.white[comps]
        attn.k_proj.weight[comps] = key.to(attn.k_proj.weight.dtype)
        attn.v_proj.weight[comps] = value.to(attn.v_proj.weight.dtype)
        back = b.vh[comps].T * out_gain / n_rep  # [H, D]: the whitened readout M = V S^-1 V^T, over its heads
        for head in range(g * n_rep, (g + 1) * n_rep):
            attn.q_proj.weight[head * d:(head + 1) * d] = query.to(attn.q_proj.weight.dtype)
            attn.o_proj.weight[:, head * d:(head + 1) * d] = back.to(attn.o_proj.weight.dtype)
    log.info("copy_init: %d of %d kv heads of the first layer copy (readouts: current token %.0f%%, previous %.0f%% "
             "held-out)", groups, n_kv, 100 * readouts.current_acc, 100 * readouts.previous_acc)
