"""draft.copy_init: the copy circuit written into the first layer drafts a repeated span at init, where a default head
drafts nothing; the readouts it is fitted with recover the tokens; the config and the trainer refuse what it cannot do."""

from __future__ import annotations

import pytest
import torch

from eagle3.config import DraftConfig
from eagle3.induction import fit_readouts, write_copy_circuit
from eagle3.model import Eagle3Draft, Eagle3DraftConfig

V, H = 200, 128


def target_states(ids: torch.Tensor, embed: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[T, 3H] fused states of a made-up target: the low state holds the token read (plus noise), the mid state the
    token before it blended with this one, the high state noise (what the head's main path would learn from)."""
    prev = torch.cat([ids[:1], ids[:-1]])
    low = 3 * embed[ids] + 0.5 * torch.randn(len(ids), H, generator=g)
    mid = 2 * embed[prev] + embed[ids] + torch.randn(len(ids), H, generator=g)
    high = 5 * torch.randn(len(ids), H, generator=g)
    return torch.cat([low, mid, high], dim=-1)


def head(embed: torch.Tensor, layers: int = 1) -> Eagle3Draft:
    torch.manual_seed(0)
    c = Eagle3DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          intermediate_size=256, vocab_size=V, draft_vocab_size=V, target_hidden_size=H,
                          rope_theta=1e6, num_layers=layers)
    draft = Eagle3Draft(c)
    draft.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    draft.init_from_target(embed, embed)  # tied, as SmolLM2's
    return draft


def copied_share(draft: Eagle3Draft, embed: torch.Tensor, g: torch.Generator) -> float:
    """Step-0 drafts inside the second copy of a 30-token span (20 random tokens, the span, 10 random, the span):
    the share equal to the token that followed the same two tokens in the first copy."""
    hits = total = 0
    for _ in range(8):
        span = torch.randperm(V, generator=g)[:30]
        ids = torch.cat([torch.randint(V, (20,), generator=g), span, torch.randint(V, (10,), generator=g), span])
        aux = target_states(ids, embed, g)
        with torch.no_grad():
            _, logits, _ = draft.decode(ids[None, 1:], draft.project(aux[None, :-1]), torch.arange(len(ids) - 1)[None],
                                        None)
        start = 60  # the second copy; draft position t reads ids[t + 1] and proposes ids[t + 2]
        for t in range(start, len(ids) - 2):
            hits += int(logits[0, t].argmax()) == int(ids[t + 2])
            total += 1
    return hits / total


@pytest.mark.parametrize("layers", [1, 2])
def test_the_circuit_drafts_a_repeated_span_at_init(layers):
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=g)
    fit_ids = [torch.randint(V, (120,), generator=g) for _ in range(32)]
    readouts = fit_readouts([target_states(i, embed, g) for i in fit_ids], fit_ids, embed)
    assert readouts.current_acc > 0.95 and readouts.previous_acc > 0.9

    default = head(embed, layers)
    assert copied_share(default, embed, torch.Generator().manual_seed(1)) < 0.1
    copying = head(embed, layers)
    sample = torch.cat([target_states(i, embed, g) for i in fit_ids[:4]])
    write_copy_circuit(copying, readouts, embed, 2, sample)
    assert copied_share(copying, embed, torch.Generator().manual_seed(1)) > 0.75


def test_one_group_of_two_leaves_the_other_heads_as_they_were():
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=g)
    ids = [torch.randint(V, (120,), generator=g) for _ in range(16)]
    aux = [target_states(i, embed, g) for i in ids]
    draft, before = head(embed), head(embed)
    write_copy_circuit(draft, fit_readouts(aux, ids, embed), embed, 1, torch.cat(aux[:2]))
    a, b = draft.midlayer.self_attn, before.midlayer.self_attn
    for w, kept in (("k_proj", 32), ("v_proj", 32), ("q_proj", 64)):  # kv head 1 and its two query heads untouched
        assert torch.equal(getattr(a, w).weight[kept:], getattr(b, w).weight[kept:]), w
        assert not torch.equal(getattr(a, w).weight[:kept], getattr(b, w).weight[:kept]), w
    assert torch.equal(a.o_proj.weight[:, 64:], b.o_proj.weight[:, 64:])
    assert copied_share(draft, embed, torch.Generator().manual_seed(1)) > 0.75  # one kv head's values still copy
    with pytest.raises(ValueError, match="kv heads"):
        write_copy_circuit(draft, fit_readouts(aux, ids, embed), embed, 3, torch.cat(aux[:2]))


def test_the_config_refuses_what_the_circuit_cannot_be_written_into():
    with pytest.raises(ValueError, match="copy_init"):
        DraftConfig(copy_init=1, arch="mla")
    for bad in ({"init_from": "runs/x/checkpoints/best"}, {"fc_norm": True}, {"features": "top"}):
        with pytest.raises(ValueError, match="copy_init"):
            DraftConfig(copy_init=1, **bad)
    assert DraftConfig(copy_init=2).copy_init == 2
