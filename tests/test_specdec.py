"""Speculative decoding: greedy output == the target's own, sampling is distributed as the target's, τ counting.

Drafts used here:
- `OracleDraft`: a stand-in that implements the draft API (project/decode/draft_to_target) by running the TARGET on
  the context its attention mask lets it see. Its KV cache stores token ids, so a wrong tree mask, position or
  cache crop shows up as lost acceptance; with no noise every drafted token is the target's choice, so τ must
  be exactly num_steps + 1. Noise makes it partially wrong (rejection paths).
- the real `eagle3.model.Eagle3Draft`, randomly initialised (almost everything rejected).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from models import tiny_deepseek_v3, tiny_llama
from torch import nn
from transformers import AutoModelForCausalLM

from eagle3.specdec import (
    AcceptanceStats,
    HFTargetDecoder,
    SpecSettings,
    SpeculativeDecoder,
    accept_among,
    keep_cache_positions,
)


class OracleDraft(nn.Module):
    """Drafts with the target itself over exactly the tokens the attention mask exposes (see module docstring)."""

    def __init__(self, target: nn.Module, first_token: int, draft_ids: torch.Tensor, noise: float = 0.0,
                 sharpen: float = 10.0, seed: int = 0):
        super().__init__()
        self.target, self.first_token, self.noise, self.sharpen = target, first_token, noise, sharpen
        self.register_buffer("ids", draft_ids)
        self.dummy = nn.Parameter(torch.zeros(1, dtype=next(target.parameters()).dtype))
        self.g = torch.Generator().manual_seed(seed)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*aux.shape[:-1], 4, dtype=aux.dtype)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.ids[draft_ids]

    def _logits(self, context: list[int], last: int = 1) -> torch.Tensor:
        """Draft logits [last, draft_vocab] for the last `last` positions of `context`."""
        out = self.target(input_ids=torch.tensor([[self.first_token, *context]])).logits[0, -last:].float()
        lg = out[:, self.ids] * self.sharpen
        if self.noise:
            lg = lg + self.noise * torch.randn(lg.shape, generator=self.g)
        return lg

    def decode(self, input_ids, hidden, position_ids, past_kv, attn_mask=None, extra=None):
        new = input_ids.to(torch.float64).view(1, 1, -1, 1)
        keys = new if past_kv is None else torch.cat([past_kv[0][0], new], dim=2)  # one layer's (keys, values)
        tokens = keys.view(-1).long().tolist()
        past = keys.shape[2] - input_ids.shape[1]
        if attn_mask is None:  # causal: one forward gives every row
            logits = self._logits(tokens, last=input_ids.shape[1])[None]
        else:
            rows = []
            for r in range(input_ids.shape[1]):
                visible = attn_mask[0, r].nonzero().view(-1).tolist()
                assert visible[-1] == past + r, "a draft query must see itself last"
                rows.append(self._logits([tokens[i] for i in visible])[0])
            logits = torch.stack(rows)[None]
        return torch.zeros(*input_ids.shape, 4, dtype=hidden.dtype), logits, ((keys, keys),)


def _target(path: Path, dtype=torch.float64) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _prompts(vocab: int, n: int = 4, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _target(tiny_llama(tmp_path_factory.mktemp("llama") / "t", vocab=128, layers=4))


SHAPES = [SpecSettings(3, 1, 4), SpecSettings(3, 2, 6), SpecSettings(4, 3, 9), SpecSettings(2, 4, 5)]


@pytest.mark.parametrize("settings", SHAPES, ids=lambda s: f"steps{s.num_steps}-topk{s.topk}-n{s.num_draft_tokens}")
def test_greedy_oracle_is_lossless_and_accepts_everything(llama, settings):
    """Perfect drafts: the output is the target's greedy output and every step accepts num_steps tokens."""
    settings.max_new_tokens = 16
    target = HFTargetDecoder(llama, [1, 2, 3])
    # Sharp draft log-probs: the greedy path scores ~0 and survives the tree's pruning to num_draft_tokens.
    draft = OracleDraft(llama, first_token=1, draft_ids=torch.arange(128), sharpen=1e4)
    dec = SpeculativeDecoder(target, draft, settings)
    for prompt in _prompts(128, n=3):
        ref = dec.generate_baseline(prompt)
        out = dec.generate(prompt)
        assert out.tokens == ref.tokens, prompt
        assert set(out.accept_lengths) == {settings.num_steps + 1}, out.accept_lengths
        assert out.target_forwards == 1 + len(out.accept_lengths)


@pytest.mark.parametrize("settings", SHAPES[:2], ids=["chain", "tree"])
def test_greedy_is_lossless_with_wrong_drafts(llama, settings):
    """Noisy drafts over a partial draft vocab: rejections at every depth, output unchanged."""
    settings.max_new_tokens = 16
    target = HFTargetDecoder(llama, [1, 2, 3])
    draft = OracleDraft(llama, first_token=1, draft_ids=torch.arange(100), noise=0.5, sharpen=3.0)
    dec = SpeculativeDecoder(target, draft, settings)
    lengths = []
    for prompt in _prompts(128, n=3, seed=2):
        out = dec.generate(prompt)
        assert out.tokens == dec.generate_baseline(prompt).tokens, prompt
        lengths += out.accept_lengths
    assert 1 in lengths and max(lengths) > 1, lengths  # both rejection and acceptance paths were taken


def real_draft(target: nn.Module, ids: list[int], draft_vocab: int = 64, seed: int = 0):
    """A randomly initialised eagle3.model.Eagle3Draft sized for `target`, lm_head from the target's rows."""
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig

    c = target.config
    cfg = Eagle3DraftConfig(hidden_size=c.hidden_size, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=128, vocab_size=c.vocab_size, draft_vocab_size=draft_vocab,
                            target_hidden_size=c.hidden_size, aux_layer_ids=ids)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg).to(target.dtype)
    target_ids = torch.arange(draft_vocab) * (c.vocab_size // draft_vocab)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    draft.set_vocab(target_ids - torch.arange(draft_vocab), t2d)
    draft.init_from_target(target.lm_head.weight.detach(), target.model.embed_tokens.weight.detach())
    return draft.eval()


@pytest.mark.parametrize("settings", [SpecSettings(3, 1, 4), SpecSettings(3, 3, 8)], ids=["chain", "tree"])
def test_greedy_is_lossless_with_the_real_draft_head(llama, settings):
    settings.max_new_tokens = 16
    target = HFTargetDecoder(llama, [1, 2, 3])
    dec = SpeculativeDecoder(target, real_draft(llama, [1, 2, 3]), settings)
    for prompt in _prompts(128, n=3, seed=4):
        out = dec.generate(prompt)
        assert out.tokens == dec.generate_baseline(prompt).tokens, prompt
        assert all(1 <= a <= settings.num_steps + 1 for a in out.accept_lengths)


def test_greedy_lossless_deepseek_mla_tree(tmp_path):
    """The MLA target's cache is re-gathered along tree paths like any other."""
    model = _target(tiny_deepseek_v3(tmp_path / "ds", vocab=96), dtype=torch.float32)  # MoE grouped_mm: no fp64
    target = HFTargetDecoder(model, [1, 2, 3])
    settings = SpecSettings(3, 2, 6, max_new_tokens=16)
    for noise in (0.0, 15.0):
        dec = SpeculativeDecoder(target, OracleDraft(model, 1, torch.arange(96), noise=noise, sharpen=1e4), settings)
        for prompt in _prompts(96, n=3):
            out = dec.generate(prompt)
            assert out.tokens == dec.generate_baseline(prompt).tokens
            if noise == 0:
                assert set(out.accept_lengths) == {4}


def test_aux_hooks_equal_hidden_states(llama):
    target = HFTargetDecoder(llama, [1, 2, 3])
    ids = torch.tensor(_prompts(128, n=1)[0])
    _, aux = target.forward(ids, torch.arange(len(ids)), target.new_cache())
    hs = llama(input_ids=ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux, torch.cat([hs[1][0], hs[2][0], hs[3][0]], -1), rtol=0, atol=0)


def test_tree_verify_then_regather_matches_prefill_of_the_path(llama):
    """Tree forward + re-gathering the cache to one path == a plain prefill of exactly that path."""
    target = HFTargetDecoder(llama, [1, 2, 3])
    cache = target.new_cache()
    target.forward(torch.tensor([1, 5]), torch.arange(2), cache)
    # tree: 6 (root, pos 2) -> {7, 8} (pos 3); 8 -> 9 (pos 4)
    parents = [-1, 0, 0, 2]
    mask = torch.eye(4, dtype=torch.bool)
    for i, par in enumerate(parents):
        while par >= 0:
            mask[i, par] = True
            par = parents[par]
    logits, aux = target.forward(torch.tensor([6, 7, 8, 9]), torch.tensor([2, 3, 3, 4]), cache, tree_mask=mask)
    keep_cache_positions(cache, torch.tensor([0, 1, 2, 4, 5]))
    ref = target.new_cache()
    ref_logits, ref_aux = target.forward(torch.tensor([1, 5, 6, 8, 9]), torch.arange(5), ref)
    for a, b in zip(cache.layers, ref.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    torch.testing.assert_close(logits[[0, 2, 3]], ref_logits[2:])
    torch.testing.assert_close(aux[[0, 2, 3]], ref_aux[2:])


# ---------------------------------------------------------------------------------------------------- sampling
def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _chi2_ok(counts: torch.Tensor, p: torch.Tensor, crit_sigma: float = 4.0) -> bool:
    """Pearson chi-square over cells with expected count >= 5 (pooled tail) below mean + crit_sigma * std."""
    n = counts.sum()
    exp = p * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    e = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = e > 0
    chi2 = float(((obs[keep] - e[keep]) ** 2 / e[keep]).sum())
    dof = int(keep.sum()) - 1
    return chi2 < dof + crit_sigma * math.sqrt(2 * dof)


def test_accept_among_is_distributed_as_target():
    """Node-level check of both rules, many trials: sampled proposal (Leviathan) and one-hot siblings."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, generator=g) * 1.5, -1).double()
    q = torch.softmax(torch.randn(8, generator=g) * 1.5, -1).double()
    assert 0.5 * float((p - q).abs().sum()) > 0.2  # an always-accept rule would fail the checks below
    n = 20000
    for seed, mode in enumerate(("sampled", "siblings")):
        g = torch.Generator().manual_seed(100 + seed)
        counts = torch.zeros(8, dtype=torch.float64)
        for _ in range(n):
            if mode == "sampled":
                cands = [int(torch.multinomial(q, 1, generator=g))]
                props = [q]
            else:
                cands, props = [int(torch.argmax(q)), 3, 0], [None, None, None]
            i, residual = accept_among(p, cands, props, g)
            tok = cands[i] if i >= 0 else int(torch.multinomial(residual, 1, generator=g))
            counts[tok] += 1
        assert _tv(counts, p) < 0.02, (mode, counts / n, p)
        assert _chi2_ok(counts, p), mode


def _exact_marginals(model: nn.Module, prompt: list[int], temperature: float, vocab: int) -> list[torch.Tensor]:
    """Exact distributions of generated tokens 1, 2 and 3 under the target's own sampling (enumerated)."""
    with torch.no_grad():
        p1 = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        seqs = torch.tensor([prompt + [a] for a in range(vocab)])
        p2_given = torch.softmax(model(input_ids=seqs).logits[:, -1].double() / temperature, -1)  # [a, b]
        p12 = p1[:, None] * p2_given
        seqs3 = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3_given = torch.softmax(model(input_ids=seqs3).logits[:, -1].double() / temperature, -1)
        p3 = (p12.reshape(-1, 1) * p3_given).sum(0)
    return [p1, p12.sum(0), p3]


@pytest.mark.parametrize("settings", [SpecSettings(2, 1, 3), SpecSettings(2, 1, 3, draft_sampling="probabilistic"),
                                      SpecSettings(2, 2, 4)], ids=["chain", "sampled-chain", "tree"])
def test_sampling_matches_target_distribution(tmp_path, settings):
    """Tokens 2 and 3 (both produced by speculation) follow the target's own sampling distribution, whether the
    chain drafts its argmax (one-hot proposals, as SGLang and vLLM's default) or samples the draft."""
    vocab, temperature, runs = 24, 0.8, 400
    model = _target(tiny_llama(tmp_path / "t", vocab=vocab, layers=4, hidden=32, heads=2, kv_heads=1,
                               intermediate=64, seed=3))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked (not uniform) distributions: acceptance is not trivially equal
    prompt = [1, 7, 9, 4, 11]
    exact = _exact_marginals(model, prompt, temperature, vocab)
    target = HFTargetDecoder(model, [1, 2, 3])
    # A draft much peakier than the target: accepting its tokens blindly would visibly distort the output.
    draft = OracleDraft(model, 1, torch.arange(vocab), noise=0.5, sharpen=4.0 / temperature, seed=5)
    settings.temperature, settings.max_new_tokens = temperature, 3
    dec = SpeculativeDecoder(target, draft, settings)
    g = torch.Generator().manual_seed(123)
    counts = [torch.zeros(vocab, dtype=torch.float64) for _ in range(3)]
    stats = AcceptanceStats()
    for _ in range(runs):
        out = dec.generate(prompt, g)
        stats.add(out.accept_lengths)
        for i, tok in enumerate(out.tokens[:3]):
            counts[i][tok] += 1
    assert stats.accepted_tokens > 0.15 * stats.steps  # speculation really produced tokens 2-3 often
    for i in (1, 2):
        assert counts[i].sum() > 0.9 * runs
        print(f"token {i + 1}: TV {_tv(counts[i], exact[i]):.3f}, accepted/step {stats.accepted_tokens / stats.steps:.2f}")
        assert _tv(counts[i], exact[i]) < 0.15, (i, _tv(counts[i], exact[i]))  # 400 samples over 24 cells
        assert _chi2_ok(counts[i], exact[i]), i


def test_draft_sampling_decides_what_an_exact_draft_scores(tmp_path):
    """A draft equal to the target at temperature 1: its sampled drafts are accepted every time (p/q = 1), its argmax
    drafts only with the target's probability of that argmax, so the two τ definitions really differ (and the
    engines' one, greedy, is not the paper's)."""
    vocab = 24
    model = _target(tiny_llama(tmp_path / "t", vocab=vocab, layers=4, hidden=32, heads=2, kv_heads=1,
                               intermediate=64, seed=3))
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    target = HFTargetDecoder(model, [1, 2, 3])
    draft = OracleDraft(model, 1, torch.arange(vocab), sharpen=1.0)  # q = p at temperature 1
    rates = {}
    for mode in ("probabilistic", "greedy"):
        dec = SpeculativeDecoder(target, draft, SpecSettings(3, 1, 4, temperature=1.0, max_new_tokens=13,
                                                             draft_sampling=mode))
        stats, g = AcceptanceStats(), torch.Generator().manual_seed(0)
        for _ in range(20):
            stats.add(dec.generate([1, 7, 9, 4, 11], g).accept_lengths)
        rates[mode] = stats.acceptance_rate(3)
    assert min(rates["probabilistic"]) >= 0.99, rates
    assert rates["greedy"][0] < 0.9, rates
    with pytest.raises(ValueError, match="draft_sampling"):
        SpecSettings(3, 1, 4, draft_sampling="sampled")


# ---------------------------------------------------------------------------------------------------------- τ
def test_tau_arithmetic_on_hand_made_steps():
    s = AcceptanceStats()
    s.add([4, 1, 2, 4], generated=12, target_forwards=5, seconds=2.0)
    assert s.steps == 4 and s.accepted_tokens == 3 + 0 + 1 + 3
    assert s.tau == pytest.approx(11 / 4)
    assert s.acceptance_rate(3) == [3 / 4, 2 / 4, 2 / 4]
    assert s.acceptance_rate(4) == [3 / 4, 2 / 4, 2 / 4, 0.0]
    assert s.tokens_per_forward == pytest.approx(12 / 5)
    assert s.tokens_per_second == pytest.approx(6.0)
    s.add([1, 1])
    assert s.tau == pytest.approx(13 / 6)
    assert math.isnan(AcceptanceStats().tau)
    with pytest.raises(ValueError, match=">= 1"):
        s.add([0])
