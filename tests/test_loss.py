"""TTT attention (fast vs dense reference), loss-mask alignment (golden), the chunked teacher and its memory."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from models import assert_fast_equals_dense, ttt_unroll  # noqa: E402 - tests/models.py

from eagle3.loss import (
    SoftCE,
    StepStats,
    Teacher,
    acceptance_length,
    linear_soft_ce,
    summarise,
    ttt_loss,
)
from eagle3.model import Eagle3Draft, Eagle3DraftConfig
from eagle3.rows import plan_rows, valid_positions
from eagle3.targets.argmax import lm_head_argmax, row_max
from eagle3.ttt import ttt_attention_dense, ttt_attention_fast


class Taught(NamedTuple):
    probs: torch.Tensor
    """[..., draft_vocab] the target's distribution over the draft vocab."""
    draft_target: torch.Tensor
    """[...] the target's full-vocab argmax as a draft id, -1 outside the draft vocab."""


def taught(teacher: Teacher, lm_head: torch.Tensor, final: torch.Tensor, chunk: int = 64) -> Taught:
    """What the trainer has of a batch: the teacher's probs, and the argmax extraction stored (as a draft id)."""
    return Taught(teacher.probs(final), teacher.to_draft[lm_head_argmax(lm_head, final, chunk)])


def draft(seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    c = Eagle3DraftConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=12,
                          intermediate_size=96, vocab_size=200, draft_vocab_size=50, target_hidden_size=48)
    m = Eagle3Draft(c, embed_weight=torch.randn(200, 48))
    d2t = torch.arange(50) * 3 - torch.arange(50)
    t2d = torch.zeros(200, dtype=torch.bool)
    t2d[torch.arange(50) * 3] = True
    m.set_vocab(d2t, t2d)
    return m


@pytest.mark.parametrize("n_prev", [0, 1, 3, 6])
def test_fast_attention_matches_dense(n_prev):
    torch.manual_seed(n_prev)
    b, nh, nkv, t, d = 2, 6, 2, 17, 12
    q = torch.randn(b, nh, t, d, requires_grad=True)
    k0, v0 = torch.randn(b, nkv, t, d, requires_grad=True), torch.randn(b, nkv, t, d, requires_grad=True)
    ks = [torch.randn(b, nkv, t, d, requires_grad=True) for _ in range(n_prev)]
    vs = [torch.randn(b, nkv, t, d, requires_grad=True) for _ in range(n_prev)]
    fast = ttt_attention_fast(q, k0, v0, ks, vs)
    dense = ttt_attention_dense(q, k0, v0, ks, vs)
    torch.testing.assert_close(fast, dense, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(fast)
    leaves = [q, k0, v0, *ks, *vs]
    g_fast = torch.autograd.grad((fast * w).sum(), leaves)
    g_dense = torch.autograd.grad((dense * w).sum(), leaves)
    for a, b_ in zip(g_fast, g_dense, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_prev", [0, 2])
def test_attention_of_some_queries_matches_those_rows_of_all_queries(n_prev):
    """Queries only at some positions (zeros elsewhere, as TTTPlan.pack lays a pruned step out) get exactly what
    the same queries get among all positions."""
    torch.manual_seed(10 + n_prev)
    b, nh, nkv, t, d = 2, 6, 2, 13, 12
    q = torch.randn(b, nh, t, d)
    k0, v0 = torch.randn(b, nkv, t, d), torch.randn(b, nkv, t, d)
    ks = [torch.randn(b, nkv, t, d) for _ in range(n_prev)]
    vs = [torch.randn(b, nkv, t, d) for _ in range(n_prev)]
    picks = [torch.tensor([0, 3, 4, 12]), torch.tensor([5, 7])]

    def take(x):
        out = torch.zeros_like(x)
        for r, pk in enumerate(picks):
            out[r, :, pk] = x[r, :, pk]
        return out

    for attend in (ttt_attention_fast, ttt_attention_dense):
        every = attend(q, k0, v0, ks, vs)
        some = attend(take(q), k0, v0, [take(k) for k in ks], [take(v) for v in vs])
        for r, pk in enumerate(picks):
            torch.testing.assert_close(some[r, :, pk], every[r, :, pk], atol=1e-5, rtol=1e-5)


def test_ttt_unroll_fast_matches_dense_with_gradients():
    m = draft()
    aux = torch.randn(2, 21, 3 * 48)
    ids = torch.randint(0, 200, (2, 21))
    assert_fast_equals_dense(m, aux, ids, 5)


def test_ttt_step_j_sees_prefix_and_own_column_only():
    """Changing a token after position t must not change any step's output at t (no future leak)."""
    m = draft()
    aux = torch.randn(1, 12, 3 * 48)
    ids = torch.randint(0, 200, (1, 12))
    base = ttt_unroll(m, m.project(aux), ids, 4)
    ids2 = ids.clone()
    ids2[0, 9:] = (ids2[0, 9:] + 1) % 200
    aux2 = aux.clone()
    aux2[0, 9:] += 1.0
    other = ttt_unroll(m, m.project(aux2), ids2, 4)
    for j, (a, b) in enumerate(zip(base, other, strict=True)):
        # step j at t reads token x_{t+1+j}: positions t <= 7-j are untouched by changes at >= 9
        torch.testing.assert_close(a[0, : 8 - j], b[0, : 8 - j], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------------- golden
LOSS_MASK = [0, 0, 0, 1, 1, 1, 0, 1, 1, 1]  # 10 tokens; assistant tokens at 3,4,5 and 7,8,9
OOV_AT = 6  # the target's argmax at position 6 is outside the draft vocab
# position t counts at step j iff t+2+j <= 9, LOSS_MASK[t+2+j] == 1 and (masking OOV) t+1+j != 6, by hand:
GOLDEN_MASKED = {0: [1, 2, 3, 6, 7], 1: [0, 1, 2, 5, 6], 2: [0, 1, 4, 5], 3: [0, 3, 4]}
GOLDEN_ALL = {0: [1, 2, 3, 5, 6, 7], 1: [0, 1, 2, 4, 5, 6], 2: [0, 1, 3, 4, 5], 3: [0, 2, 3, 4]}


def _golden_teacher() -> Taught:
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(1, 10, 5), -1)
    target = torch.tensor([[0, 1, 2, 3, 4, 0, -1, 1, 2, 3]])
    assert target[0, OOV_AT] == -1
    return Taught(probs, target)


@pytest.mark.parametrize("mask_oov,golden", [(True, GOLDEN_MASKED), (False, GOLDEN_ALL)])
def test_loss_mask_golden(mask_oov, golden):
    teacher = _golden_teacher()
    mask = torch.tensor([LOSS_MASK])
    rows = plan_rows(mask, teacher.draft_target, 4, mask_oov)
    for j, expected in golden.items():
        got = valid_positions(mask, teacher.draft_target, j, mask_oov)[0].nonzero().flatten().tolist()
        assert got == expected, f"step {j}"
        assert rows.keep[j][rows.score[j]].tolist() == expected, f"step {j} scores other rows"
        # Step j computes exactly the positions it or a later step scores.
        assert rows.keep[j].tolist() == sorted(set().union(*(golden[k] for k in range(j, 4)))), f"step {j}"
        # acc_j's denominator counts an out-of-vocab teacher as a position (a miss), whatever the loss does.
        assert rows.counted[j] == len(GOLDEN_ALL[j])
    # The first assistant token (position 3) is learned: predicted at step 0 from position 1.
    assert 1 in golden[0]
    torch.manual_seed(2)
    full = [torch.randn(1, 10, 5) for _ in range(4)]
    logits = [full[j][0][rows.keep[j][rows.score[j]]] for j in range(4)]
    probs = teacher.probs.flatten(0, 1)[rows.teacher_pos]
    out = SoftCE(probs, rows, decay=0.8)(logits, torch.eye(5))  # an identity lm_head: the logits as given
    loss, stats = ttt_loss(out, teacher.draft_target.flatten()[rows.teacher_pos], rows)
    expected_loss = 0.0
    for j, pos in golden.items():
        ce = [-(teacher.probs[0, t + 1 + j] * torch.log_softmax(full[j][0, t], -1)).sum() for t in pos]
        expected_loss += 0.8**j * torch.stack(ce).mean()
        assert stats.valid[j] == len(pos)
        correct = sum(int(full[j][0, t].argmax() == teacher.draft_target[0, t + 1 + j]) for t in pos)
        assert stats.correct[j] == correct
    torch.testing.assert_close(loss, torch.as_tensor(expected_loss), atol=1e-6, rtol=1e-6)
    acc = summarise(stats)
    for j in range(4):
        assert acc[f"acc_{j}"] == pytest.approx(float(stats.correct[j]) / len(GOLDEN_ALL[j]))


@pytest.mark.parametrize("mask_oov", [True, False])
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_pruned_rows_match_every_row_loss_and_gradients(mask_oov, steps):
    """Computing only the rows that reach the loss gives the loss and gradients of computing every row."""
    m = draft(3)
    torch.manual_seed(steps)
    b, t, h = 3, 19, 48
    aux = torch.randn(b, t, 3 * h)
    ids = torch.randint(0, 200, (b, t))
    mask = (torch.rand(b, t) < 0.6).long()
    mask[2, 11:] = 0  # a padded row
    w = torch.randn(200, h)
    teacher = Teacher(w, m.d2t, m.t2d)
    final = torch.randn(b, t, h)
    out = taught(teacher, w, final)
    assert (out.draft_target == -1).any()

    def reference():
        logits = ttt_unroll(m, m.project(aux), ids, steps)
        total = torch.zeros(())
        for j, lg in enumerate(logits):
            valid = valid_positions(mask, out.draft_target, j, mask_oov)
            pos = valid.nonzero()
            if len(pos) == 0:
                continue
            sel = lg[pos[:, 0], pos[:, 1]]
            p = out.probs[pos[:, 0], pos[:, 1] + 1 + j]
            total = total + 0.8**j * (-(p * torch.log_softmax(sel, -1)).sum(-1)).mean()
        return total

    ref = reference()
    g_ref = torch.autograd.grad(ref, list(m.parameters()))
    rows = plan_rows(mask, out.draft_target, steps, mask_oov)
    assert rows.keep[-1].numel() < b * t  # something was pruned
    head = SoftCE(teacher.probs(final.flatten(0, 1)[rows.teacher_pos]), rows, 0.8, chunk=7)
    got, stats = ttt_loss(m(aux, ids, rows, head=head), out.draft_target.flatten()[rows.teacher_pos], rows)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    g = torch.autograd.grad(got, list(m.parameters()))
    for a, b_ in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-6, rtol=1e-5)
    for j in range(steps):
        assert stats.valid[j] == valid_positions(mask, out.draft_target, j, mask_oov).sum()


def _soft_ce_case(seed: int, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    v, h, sizes = 37, 16, [23, 11, 0, 4]
    w = torch.randn(v, h, dtype=dtype, requires_grad=True)
    probs = torch.softmax(torch.randn(30, v, dtype=dtype) * 3, -1)
    xs = [torch.randn(n, h, dtype=dtype, requires_grad=True) for n in sizes]
    index = [torch.randint(0, 30, (n,)) for n in sizes]
    scales = torch.tensor([1.0, 0.8 / 3, 0.64, 0.5], dtype=dtype)
    return w, probs, xs, index, scales


def _soft_ce_autograd(xs, w, probs, index, scales):
    """The unfused reference: logits, log_softmax, autograd."""
    total, ce_sum, am = 0.0, [], []
    for j, x in enumerate(xs):
        z = x @ w.T
        ce = -(probs[index[j]] * torch.log_softmax(z.float() if z.dtype != torch.float64 else z, -1)).sum(-1)
        total = total + scales[j] * ce.sum()
        ce_sum.append(ce.sum().detach())
        am.append(z.argmax(-1))
    return total, torch.stack(ce_sum), am


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_fused_soft_ce_matches_autograd(chunk):
    """The fused, chunked lm_head + soft-CE gives autograd's loss, per-step sums, argmax and gradients (of the
    rows and of the weight, an empty step included) for any chunking."""
    w, probs, xs, index, scales = _soft_ce_case(chunk)
    ref, ref_ce, ref_am = _soft_ce_autograd(xs, w, probs, index, scales)
    g_ref = torch.autograd.grad(ref * 3.0, [w, *xs])
    out = linear_soft_ce(xs, w, probs, index, scales, chunk)
    torch.testing.assert_close(out.loss, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.ce_sum, ref_ce, atol=1e-5, rtol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(out.argmax, ref_am, strict=True))
    g = torch.autograd.grad(out.loss * 3.0, [w, *xs])  # an upstream factor (accelerate's `loss * world`)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_fused_soft_ce_sum_keeps_float32_precision_at_a_real_size():
    """One step of 750 scored rows over an 8192-token draft vocab (SmolLM2's): the logged loss agrees with a
    float64 sum (torch.dot over the 6M products of a chunk was off by 7e-4)."""
    torch.manual_seed(0)
    n, v, h = 750, 8192, 64
    w, x = torch.randn(v, h) * 0.5, torch.randn(n, h)
    probs = torch.softmax(torch.randn(n, v) * 3, -1)
    out = linear_soft_ce([x], w, probs, [torch.arange(n)], torch.ones(1), 4096)
    ref = -(probs.double() * torch.log_softmax((x @ w.T).double(), -1)).sum()
    assert abs(float(out.ce_sum[0]) - float(ref)) / float(ref) < 1e-6


def test_fused_soft_ce_float64_matches_autograd_and_backward_runs_once():
    w, probs, xs, index, scales = _soft_ce_case(0, torch.float64)
    ref, _, _ = _soft_ce_autograd(xs, w, probs, index, scales)
    g_ref = torch.autograd.grad(ref, [w, *xs])
    out = linear_soft_ce(xs, w, probs, index, scales, 2)
    g = torch.autograd.grad(out.loss, [w, *xs], retain_graph=True)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    with pytest.raises(RuntimeError, match="runs once"):
        torch.autograd.grad(out.loss, [w, *xs])


def test_fused_soft_ce_under_bf16_autocast_and_without_grad():
    """Under bf16 autocast the matmuls run in bf16 like the unfused path's lm_head (the softmax in float32);
    under no_grad (the trainer's eval) the same figures come out and no gradient is made."""
    w, probs, xs, index, scales = _soft_ce_case(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_ce, _ = _soft_ce_autograd(xs, w, probs, index, scales)
        out = linear_soft_ce(xs, w, probs, index, scales, 4)
    torch.testing.assert_close(out.loss, ref.float(), atol=1e-3, rtol=1e-3)
    for a, b in zip(torch.autograd.grad(out.loss, [w, *xs]), torch.autograd.grad(ref, [w, *xs]), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        plain = linear_soft_ce(xs, w, probs, index, scales, 4)
    assert not plain.loss.requires_grad
    torch.testing.assert_close(plain.ce_sum, _soft_ce_autograd(xs, w, probs, index, scales)[1], atol=1e-5, rtol=1e-6)


def test_fused_soft_ce_on_bf16_weights():
    """bf16 parameters without autocast (FSDP2 with a bf16 `param_dtype`): bf16 matmuls and gradients, as autograd
    gives."""
    w, probs, xs, index, scales = _soft_ce_case(4)
    w = w.detach().bfloat16().requires_grad_()
    xs = [x.detach().bfloat16().requires_grad_() for x in xs]
    ref, _, _ = _soft_ce_autograd(xs, w, probs, index, scales)
    out = linear_soft_ce(xs, w, probs, index, scales, 4)
    torch.testing.assert_close(out.loss, ref.float(), atol=1e-3, rtol=1e-3)
    for a, b in zip(torch.autograd.grad(out.loss, [w, *xs]), torch.autograd.grad(ref, [w, *xs]), strict=True):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_fused_soft_ce_sums_the_bf16_weight_gradient_in_float32():
    """The lm_head's gradient is summed over every chunk and TTT step in float32 and rounded to the weight's bf16
    once: 4 steps x 512 one-row chunks (2048 products) land within two bf16 roundings (2**-8) of the float64
    gradient of the same bf16 inputs, as one chunk does. Summed in bf16 (the weight's dtype), each addition rounds:
    5.5e-2 here, and 1.9e-2 with 8-row chunks."""
    torch.manual_seed(0)
    v, h, n, steps = 64, 32, 512, 4
    w = (torch.randn(v, h) * 0.3).bfloat16().requires_grad_()
    xs = [torch.randn(n, h).bfloat16() for _ in range(steps)]
    probs = torch.softmax(torch.randn(n, v) * 3, -1)
    index, scales = [torch.arange(n)] * steps, torch.tensor([0.8**j / n for j in range(steps)])
    w64 = w.detach().double().requires_grad_()
    ref = sum(-scales[j].double() * (probs.double() * torch.log_softmax(x.double() @ w64.T, -1)).sum()
              for j, x in enumerate(xs))
    g_ref = torch.autograd.grad(ref, w64)[0]
    for chunk in (n, 1):
        g = torch.autograd.grad(linear_soft_ce(xs, w, probs, index, scales, chunk).loss, w)[0]
        assert g.dtype == torch.bfloat16
        assert float((g.double() - g_ref).norm() / g_ref.norm()) < 2**-8, chunk


def test_fused_soft_ce_holds_one_chunk_of_logits():
    """8192 scored rows of a 32000-token draft vocab: the fused loss never holds the [8192, 32000] fp32 logits
    (1 GB) an unfused step keeps for its backward (twice, with log_softmax's output), only a chunk of them, the
    rows' gradient and the weight's."""
    n, v, h, chunk = 8192, 32000, 64, 512
    torch.manual_seed(0)
    w = torch.randn(v, h, requires_grad=True)
    x = torch.randn(n, h, requires_grad=True)
    probs = torch.softmax(torch.randn(n, v), -1)
    index = [torch.arange(n)]
    linear_soft_ce([x[:8]], w, probs, [index[0][:8]], torch.ones(1), chunk).loss.backward()  # warm up
    peak, _ = _peak_extra(lambda: linear_soft_ce([x], w, probs, index, torch.ones(1), chunk).loss.backward())
    bound = 4 * chunk * v * 4 + 2 * (n * h + v * h) * 4 + 64 * 2**20
    assert peak < bound, (peak, bound)
    assert peak < n * v * 4 * 0.5, peak


def test_a_batch_with_nothing_to_score_still_reaches_every_parameter():
    """No assistant token at all (a blanked sample): zero loss, and a (zero) gradient for every parameter, as
    DDP expects of every rank at every step."""
    m = draft(4)
    b, t, h = 2, 9, 48
    w = torch.randn(200, h)
    teacher = Teacher(w, m.d2t, m.t2d)
    final = torch.randn(b, t, h)
    mask = torch.zeros(b, t, dtype=torch.long)
    target = taught(teacher, w, final).draft_target
    rows = plan_rows(mask, target, 3, True)
    head = SoftCE(teacher.probs(final.flatten(0, 1)[rows.teacher_pos]), rows, 0.8)
    out = m(torch.randn(b, t, 3 * h), torch.randint(0, 200, (b, t)), rows, head=head)
    loss, stats = ttt_loss(out, target.flatten()[rows.teacher_pos], rows)
    assert float(loss.detach()) == 0.0 and float(stats.counted.sum()) == 0.0
    grads = torch.autograd.grad(loss, list(m.parameters()), allow_unused=False)
    assert all(float(g.abs().sum()) == 0.0 for g in grads)


def test_acceptance_length_counts_bonus_token():
    assert acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert acceptance_length([0.0, 1.0]) == 1.0
    assert abs(acceptance_length([0.5, 0.5]) - 1.75) < 1e-12
    s = summarise(StepStats(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 1.0]), torch.tensor([2.0, 4.0]),
                            torch.tensor([2.0, 4.0]), torch.zeros(2), torch.zeros(2)))
    assert s["acc_0"] == 0.5 and s["acc_1"] == 0.25 and s["loss_1"] == 1.0
    # no chain counts (nothing greedy-consistent): the teacher-forced figure stands in
    assert abs(s["sim_accept_len"] - (1 + 0.5 + 0.125)) < 1e-9
    assert abs(s["sim_accept_len_tf"] - 1.625) < 1e-9


def test_greedy_chain_golden():
    """Chains start where the bonus token is the target's argmax and go on while every draft token hits and the
    text keeps agreeing with the target (what an engine, feeding its accepted draft tokens, would see)."""
    from eagle3.loss import greedy_chain

    x = torch.tensor([[5, 1, 2, 3, 4, 6, 7, 8]])
    top = torch.tensor([[1, 2, 9, 4, 6, 6, 8, 0]])  # x_{t+1} == top_t at t = 0, 1, 3, 4, 6
    mask = torch.ones(1, 8, dtype=torch.long)
    rows = plan_rows(mask, top, 2, False)
    assert rows.keep[0][rows.score[0]].tolist() == [0, 1, 2, 3, 4, 5]
    assert rows.keep[1][rows.score[1]].tolist() == [0, 1, 2, 3, 4]
    hits = [torch.tensor([1, 1, 1, 1, 0, 0]).bool(), torch.tensor([1, 1, 1, 0, 1]).bool()]
    alive, hit = greedy_chain(rows, hits, x, top, mask)
    # step 0: alive where the bonus token agrees (t = 0, 1, 3, 4; t = 6 has no label), hit at 0, 1, 3
    # step 1: of those, the fed x_{t+2} agrees with top_{t+1} at t = 0, 3; the draft hits at t = 0 only
    assert alive.tolist() == [4, 2] and hit.tolist() == [3, 1]
    s = summarise(StepStats(torch.ones(2), torch.ones(2), torch.ones(2), torch.ones(2), alive, hit))
    assert s["chain_acc_0"] == 0.75 and s["chain_acc_1"] == 0.5
    assert s["sim_accept_len"] == pytest.approx(1 + 0.75 + 0.75 * 0.5)


@pytest.mark.parametrize("v,block", [(37, 8), (64, 8), (8192, 128), (300, 128), (5, 128)])
def test_row_max_is_max_of_the_last_dim_with_its_first_index(v, block):
    """row_max (the loss's and the teacher argmax's) gives z.max(-1) exactly: the value, and on ties the first
    index, wherever the maximum lies (a full block, the short tail block, several blocks at once)."""
    torch.manual_seed(v)
    z = torch.randn(50, v)
    z[:10] = z[:10].round()  # many ties within and across blocks
    z[10, -1] = 99.0  # the maximum in the tail block
    z[11, [0, v - 1]] = 99.0  # a tie between the first and the last column
    z[12] = 0.0  # all equal
    ref_v, ref_i = z.max(-1)
    got_v, got_i = row_max(z, block)
    assert torch.equal(got_v, ref_v) and torch.equal(got_i, ref_i)


# ------------------------------------------------------------------------------------------------- teacher
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_teacher_matches_full_softmax(chunk):
    torch.manual_seed(0)
    v, h, vd = 300, 32, 40
    w = torch.randn(v, h)
    ids = torch.sort(torch.randperm(v)[:vd]).values
    d2t = ids - torch.arange(vd)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    final = torch.randn(3, 11, h)
    out = taught(Teacher(w, d2t, t2d), w, final, chunk)
    logits = final @ w.T
    torch.testing.assert_close(out.probs, torch.softmax(logits[..., ids], -1), atol=1e-6, rtol=1e-5)
    full = logits.argmax(-1)
    expected = torch.where(t2d[full], torch.searchsorted(ids, full), torch.full_like(full, -1))
    assert torch.equal(out.draft_target, expected)
    assert (out.draft_target == -1).any() and (out.draft_target >= 0).any()


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_extra(run):
    """(peak resident memory of run() above what was resident before it, its result), in this process (Linux:
    reset the VmHWM counter, run, read it)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS:")
    out = run()
    return _status("VmHWM:") - before, out


def _teacher_peak(v: int, h: int, n: int, vd: int, chunk: int, dtype: torch.dtype) -> dict:
    """Peak extra resident memory of one teacher call, in this process (Linux: reset VmHWM, run, read it)."""
    torch.manual_seed(0)
    w = torch.randn(v, h, dtype=dtype)
    ids = torch.arange(vd) * (v // vd)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    teacher = Teacher(w, ids - torch.arange(vd), t2d)
    final = torch.randn(n, h, dtype=dtype)
    taught(teacher, w, final[:8], chunk)  # warm up kernels and allocator
    peak, out = _peak_extra(lambda: taught(teacher, w, final, chunk))
    return {"peak_extra": peak, "probs_bytes": out.probs.numel() * 4}


def _check_bound(res: dict, v: int, n: int, vd: int, chunk: int) -> None:
    # Bound: the restricted probs [N, VD] fp32 (the output) + a few [N, chunk] fp32 blocks (matmul result, its
    # fp32 copy, the draft-row selection) + slack. A full [N, V] fp32 logits tensor is never built.
    bound = n * vd * 4 + 4 * n * chunk * 4 + 64 * 2**20
    assert res["peak_extra"] < bound, res
    assert res["peak_extra"] < n * v * 4 * 0.6, res  # well under one full [N, V] fp32 logits tensor


def test_teacher_memory_kimi_vocab():
    """Kimi's vocab (163840) and a 32K draft vocab on 1024 tokens, narrow hidden to keep it fast (~4 s)."""
    v, n, vd, chunk = 163840, 1024, 32768, 4096
    res = _teacher_peak(v, 64, n, vd, chunk, torch.float32)
    _check_bound(res, v, n, vd, chunk)


@pytest.mark.slow
def test_teacher_memory_kimi_vocab_4096_tokens():
    """The same on a 4096-token sequence (~15-35 s on 2 cores)."""
    v, n, vd, chunk = 163840, 4096, 32768, 8192
    res = _teacher_peak(v, 64, n, vd, chunk, torch.float32)
    print(res)
    _check_bound(res, v, n, vd, chunk)


@pytest.mark.slow
def test_teacher_memory_full_kimi_head_bf16():
    """The real Kimi-K2.5 lm_head size: 163840 x 7168 bf16 (2.3 GB), 4096 tokens where the CPU has native bf16; 512
    where bf16 matmuls are emulated (AVX2: ~10x slower, 20 minutes at 4096 tokens): the same head and vocab chunks,
    the bound scaled with the tokens."""
    from eagle3.precision import cpu_native_bf16

    v, n, vd, chunk = 163840, 4096 if cpu_native_bf16()[0] else 512, 32768, 8192
    res = _teacher_peak(v, 7168, n, vd, chunk, torch.bfloat16)
    _check_bound(res, v, n, vd, chunk)


def test_teacher_probs_are_a_distribution_over_the_draft_vocab():
    torch.manual_seed(0)
    w = torch.randn(100, 16)
    t2d = torch.zeros(100, dtype=torch.bool)
    t2d[:10] = True
    out = taught(Teacher(w, torch.zeros(10, dtype=torch.long), t2d), w, torch.randn(5, 16), 32)
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(5))
    assert F.one_hot(out.draft_target.clamp(min=0), 10).shape == (5, 10)


def test_group_normalised_micro_batches_add_up_to_one_batch():
    """Normalised by the whole group's scored positions, two micro-batches' losses (and so their accumulated
    gradients) add up to the loss of one batch holding both; per-micro-batch means would not, whenever the two
    score different numbers of positions."""
    m = draft(5)
    h = 48
    torch.manual_seed(5)
    w = torch.randn(200, h)
    teacher = Teacher(w, m.d2t, m.t2d)
    parts = []
    for b, share in ((2, 0.8), (1, 0.3)):
        parts.append({"aux": torch.randn(b, 15, 3 * h), "ids": torch.randint(0, 200, (b, 15)),
                      "mask": (torch.rand(b, 15) < share).long(), "final": torch.randn(b, 15, h)})

    def loss_of(p, denominators=None):
        target = taught(teacher, w, p["final"]).draft_target
        rows = plan_rows(p["mask"], target, 3, True)
        head = SoftCE(teacher.probs(p["final"].flatten(0, 1)[rows.teacher_pos]), rows, 0.8, denominators)
        loss, _ = ttt_loss(m(p["aux"], p["ids"], rows, head=head), target.flatten()[rows.teacher_pos], rows)
        return loss, rows

    rows = [plan_rows(p["mask"], taught(teacher, w, p["final"]).draft_target, 3, True) for p in parts]
    norm = rows[0].scored() + rows[1].scored()
    assert rows[0].scored()[0] != rows[1].scored()[0]
    group = loss_of(parts[0], norm)[0] + loss_of(parts[1], norm)[0]
    whole = loss_of({k: torch.cat([parts[0][k], parts[1][k]]) for k in parts[0]})[0]
    torch.testing.assert_close(group, whole, atol=1e-6, rtol=1e-6)
    per_micro = (loss_of(parts[0])[0] + loss_of(parts[1])[0]) / 2
    assert abs(float((per_micro - whole).detach())) > 1e-3
    g_group = torch.autograd.grad(group, list(m.parameters()))
    g_whole = torch.autograd.grad(whole, list(m.parameters()))
    for a, b_ in zip(g_group, g_whole, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-6, rtol=1e-5)
