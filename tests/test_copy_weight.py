"""train.copy_weight: the positions where prompt lookup proposes the target's next token are found by vLLM's rule,
and only their share of the loss and of its gradient is scaled."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from eagle3.config import TrainConfig
from eagle3.objective import Objective, copy_positions
from eagle3.specdec import ngram_proposal

sys.path.append(str(Path(__file__).parent))  # tests/ helpers (appended: never shadow installed packages)
from test_long_context import HIDDEN, VOCAB, head  # noqa: E402


def test_copy_positions_follow_vllms_prompt_lookup_rule():
    """Every position of random rows over a 4-token alphabet (many repeats, several n-gram lengths matching at
    once): a copy position exactly where ngram_proposal on the tokens so far proposes the target's argmax."""
    g = torch.Generator().manual_seed(0)
    seen = 0
    for _ in range(60):
        t = int(torch.randint(1, 40, (1,), generator=g))
        ids, argmax = torch.randint(0, 4, (3, t), generator=g), torch.randint(0, 4, (3, t), generator=g)
        got = copy_positions(ids, argmax)
        for i in range(3):
            for p in range(t):
                proposal = ngram_proposal(ids[i, : p + 1].tolist(), 1)
                assert bool(got[i, p]) == (proposal == [int(argmax[i, p])]), (ids[i, : p + 1].tolist(), proposal)
                seen += bool(got[i, p])
    assert seen > 100  # the rule was exercised, not only its misses


def batch(t: int = 96) -> dict[str, torch.Tensor]:
    """One row whose second half repeats its first (a code edit's shape), the target's argmax the next token."""
    g = torch.Generator().manual_seed(1)
    half = torch.randint(0, VOCAB, (1, t // 2), generator=g)
    ids = torch.cat([half, half], 1)
    return {"aux": torch.randn(1, t, 3 * HIDDEN, generator=g), "final": torch.randn(1, t, HIDDEN, generator=g),
            "input_ids": ids, "loss_mask": torch.ones(1, t, dtype=torch.long), "lengths": torch.tensor([t]),
            "target_argmax": torch.cat([ids[:, 1:], ids[:, :1]], 1)}


def loss_and_grads(b: dict[str, torch.Tensor], copy_weight: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    draft, teacher, _ = head()
    objective = Objective(teacher, TrainConfig(ttt_steps=1, mask_out_of_vocab=False, copy_weight=copy_weight))
    loss, _ = objective.loss(draft, objective.plan(b))
    return loss.detach(), list(torch.autograd.grad(loss, [p for p in draft.parameters() if p.requires_grad]))


@pytest.mark.parametrize("weight", [0.5, 3.0])
def test_copy_weight_scales_the_loss_and_gradients_of_copy_positions_only(weight):
    """L(w) = L(1) + (w - 1) * (the copy positions' share of L(1)), and so for every gradient: the share is measured
    by a loss mask that keeps only the labels whose teacher sits at a copy position (step 0 scores position t
    against the teacher at t + 1, label x_{t+2})."""
    b = batch()
    copy = copy_positions(b["input_ids"], b["target_argmax"])
    assert 30 < int(copy.sum()) < 48  # the repeated half, less the lookup's first tokens
    only_copy = {**b, "loss_mask": torch.zeros_like(b["loss_mask"])}
    only_copy["loss_mask"][:, 2:] = copy[:, 1:-1]
    scored_all, scored_copy = b["input_ids"].shape[1] - 2, int(copy[:, 1:-1].sum())
    base, base_g = loss_and_grads(b, 1.0)
    share, share_g = loss_and_grads(only_copy, 1.0)
    share, share_g = share * scored_copy / scored_all, [g * scored_copy / scored_all for g in share_g]
    got, got_g = loss_and_grads(b, weight)
    torch.testing.assert_close(got, base + (weight - 1) * share)
    for g, g0, gs in zip(got_g, base_g, share_g, strict=True):
        torch.testing.assert_close(g, g0 + (weight - 1) * gs, atol=1e-5, rtol=1e-4)


def test_copy_weight_changes_nothing_where_nothing_repeats():
    b = batch()
    b["input_ids"] = torch.randperm(VOCAB)[:96][None]  # no n-gram occurs twice
    assert not copy_positions(b["input_ids"], b["target_argmax"]).any()
    torch.testing.assert_close(loss_and_grads(b, 4.0)[0], loss_and_grads(b, 1.0)[0], rtol=0, atol=0)


def test_copy_weights_of_a_sequence_parallel_rank_are_the_whole_sequences():
    """Each rank of a sequence-parallel group holds a slice of the positions: a lookup on the slice alone would miss
    the context before it, so its weights must be the single process's over its window."""
    from eagle3.sequence_parallel import SequenceParallel

    _, teacher, _ = head()
    b = batch()
    train = TrainConfig(ttt_steps=3, copy_weight=3.0)
    whole = Objective(teacher, train).plan(b).batch["position_weight"]
    for rank in range(2):
        part = Objective(teacher, train, SequenceParallel(2, rank, None)).plan(b)
        start = part.rows.start
        got = part.batch["position_weight"]
        n = min(got.shape[1], whole.shape[1] - start)
        assert torch.equal(got[:, :n], whole[:, start:start + n]) and start == rank * 48
        assert rank == 0 or got[:, :n].sum() > n  # the second half repeats the first: its copy positions are weighted
