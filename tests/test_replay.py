"""Trace replay (eagle3.replay): hand-computed walks, vLLM's drafters' rules, and the head's replayed drafts equal
to what the built-in speculative decoder drafts and accepts on the same prompts."""

from __future__ import annotations

import json

import pytest
import torch
from models import tiny_llama
from test_specdec import _prompts, _target, real_draft

from eagle3.engines.hybrid_rule import settings
from eagle3.replay import (
    Drafter,
    HeadDrafter,
    NgramDrafter,
    Proposal,
    Replayer,
    Trace,
    always,
    head_chains,
    ngram_if_match,
    oracle,
    suffix_tree,
    walk,
)
from eagle3.specdec import HFTargetDecoder, SpecSettings, SpeculativeDecoder


class Fixed(Drafter):
    """Drafts the same tokens at every round (a stand-in for a head in hand-computed walks)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, context):
        return Proposal(self.tokens)


def test_walk_by_hand():
    """prompt [1 2 3], answer [4 5 6 7 4 5 6 7]: the prefill gives 4 (1 forward). Head-only, always drafting
    [5 6 9]: the round at root 4 accepts 5 6 (bonus 7), root 7 drafts 5 (truth 4: rejected, bonus 4), root 4 accepts
    5 6 (bonus 7): the whole answer, 8 tokens, in 1 + 3 forwards. n-gram (2..4, k 3) finds no earlier n-gram at
    roots 4 5 6 7 4 (one token each), then at root 5 the 2-gram [4 5] occurred: draft [6 7 4], truth [6 7], 2
    accepted and the answer ends: 1 + 6 forwards."""
    trace = Trace([1, 2, 3], [4, 5, 6, 7, 4, 5, 6, 7])
    steps: list = []
    t = walk(trace, {"head": Fixed([5, 6, 9])}, always("head"), steps=steps)
    assert steps == [("head", 2), ("head", 0), ("head", 2)]
    assert (t.generated, t.forwards, t.accepted) == (8, 4, 4)
    assert t.tokens_per_forward == 2.0

    steps = []
    t = walk(trace, {"ngram": NgramDrafter(3)}, always("ngram"), steps=steps)
    assert steps == [("ngram", 0)] * 5 + [("ngram", 2)]
    assert (t.forwards, t.accepted) == (7, 2)

    # the oracle takes the better of the two at each round; a match-length rule takes n-gram only on a long match
    steps = []
    walk(trace, {"head": Fixed([5, 6, 9]), "ngram": NgramDrafter(3)}, oracle, steps=steps)
    assert steps == [("head", 2), ("head", 0), ("head", 2)]
    steps = []
    walk(trace, {"head": Fixed([9]), "ngram": NgramDrafter(3)}, ngram_if_match(2), steps=steps)
    assert steps == [("head", 0)] * 5 + [("ngram", 2)]


def test_suffix_tree_learns_across_requests_in_the_runs_order():
    """vLLM's suffix decoding: the global tree holds earlier responses, so a second request whose answer repeats
    the first's drafts it after one token; the first request, with nothing cached and a prompt that never repeats,
    finds no draft."""
    try:
        suffix_tree()
    except ImportError as e:
        pytest.skip(str(e))
    from eagle3.replay import SuffixDrafter

    d = {"suffix": SuffixDrafter(3)}
    first = walk(Trace([1, 2, 3], [10, 11, 12, 13, 14, 15]), d, always("suffix"))
    assert (first.forwards, first.accepted) == (6, 0)
    steps: list = []
    second = walk(Trace([7, 8], [10, 11, 12, 13, 14, 15]), d, always("suffix"), steps=steps)
    # root 10: a 1-token match drafts 1 token (vLLM's spec factor 1), 11, bonus 12; root 12: the match [10 11 12]
    # drafts 13 14 15, all accepted: the end
    assert steps == [("suffix", 1), ("suffix", 3)]
    assert second.forwards == 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _target(tiny_llama(tmp_path_factory.mktemp("llama") / "t", vocab=128, layers=4), dtype=torch.float32)


def taught_head(target: HFTargetDecoder, k: int, steps: int = 150):
    """A real Eagle3Draft trained a few seconds on the target's own greedy answers (TTT, k steps, against the
    target's argmax): its rounds accept anywhere from 0 to k tokens, where a random head accepts none."""
    import torch.nn.functional as F

    from eagle3.rows import plan_rows

    torch.manual_seed(0)
    draft = real_draft(target.model, [1, 2, 3], draft_vocab=128).float()
    dec = SpeculativeDecoder(target, draft, SpecSettings(k, 1, k + 1, max_new_tokens=32))
    data = []
    for prompt in _prompts(128, n=48, seed=7):
        ids = prompt + dec.generate_baseline(prompt).tokens
        with torch.inference_mode():
            logits, aux = target.forward(torch.tensor(ids), torch.arange(len(ids)), target.new_cache())
        data.append((torch.tensor(ids), aux.float().clone(), logits.argmax(-1).clone()))
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for step in range(steps):
        ids, aux, argmax = data[step % len(data)]
        rows = plan_rows(torch.ones(1, len(ids), dtype=torch.long), torch.zeros(1, len(ids), dtype=torch.long), k,
                         False)
        loss = sum(F.cross_entropy(lg, argmax[rows.keep[j][rows.score[j]] + 1 + j])
                   for j, lg in enumerate(draft(aux[None], ids[None], rows)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


def test_head_replay_is_what_the_decoder_drafts_and_accepts(llama):
    """The built-in speculative decoder (a real Eagle3Draft, k = 3 chain) on a few prompts: at every round, the
    replay's chain at the round's root equals the decoder's draft up to its first rejected token (past it the decoder
    drafted from its own wrong token, the replay from the answer's), and the replay's head-only walk accepts what
    the decoder accepted, round by round, in as many target forwards: rounds rejected at the first token, cut inside the chain, and wholly accepted."""
    k = 3
    target = HFTargetDecoder(llama, [1, 2, 3])
    draft = taught_head(target, k)
    dec = SpeculativeDecoder(target, draft, SpecSettings(k, 1, k + 1, max_new_tokens=24))
    drafted: list[list[int]] = []
    inner = dec._draft_tree

    def record(*a, **kw):
        tree, kv = inner(*a, **kw)
        drafted.append(list(tree.tokens[1:]))
        return tree, kv

    dec._draft_tree = record
    seen: set[int] = set()
    for prompt in _prompts(128, n=6, seed=4):
        drafted.clear()
        gen = dec.generate(prompt)
        trace = Trace(prompt, gen.tokens)
        with torch.inference_mode():
            _, aux = target.forward(torch.tensor(trace.tokens), torch.arange(len(trace.tokens)), target.new_cache())
        chains = head_chains(draft, aux, trace.tokens, k)
        steps: list = []
        tally = walk(trace, {"head": HeadDrafter()}, always("head"), chains, steps)
        assert tally.forwards == gen.target_forwards
        # the decoder's last round may accept drafts past the answer's end (then cut at max_new_tokens): the trace
        # has no tokens to check them against, and the forwards are the same
        end = len(trace.tokens)
        assert [a for _, a in steps] == [min(a - 1, end - m - 1) for m, a in zip(gen.positions, gen.accept_lengths)]
        for m, got, (_, a) in zip(gen.positions, drafted, steps, strict=True):
            upto = min(a + 1, k, end - m - 1)  # the chain stops at the answer's end
            assert chains.tokens[m - 1, :upto].tolist() == got[:upto], (m, got, chains.tokens[m - 1])
        seen |= {a for _, a in steps}
    assert {0, 1, k} <= seen, seen


def test_replayer_tallies_each_rule_on_drafters_of_its_own():
    """Two rules over the same traces: each has its own drafters, and the per-set and per-category rows add up."""
    rules = {"head": always("head"), "oracle": oracle}
    rep = Replayer(3, rules, make_drafters=lambda: {"head": Fixed([5, 6, 9]), "ngram": NgramDrafter(3)})
    rep.add(Trace([1, 2, 3], [4, 5, 6, 7, 4, 5, 6, 7], "s", "a"), None)
    rep.add(Trace([1, 2, 3], [4, 5, 6, 7], "s", "b"), None)
    rows = list(rep.rows())
    assert [(s, c) for s, c, _ in rows] == [("s", ""), ("s", "a"), ("s", "b")]
    whole = rows[0][2]["head"]
    assert whole.generated == 12 and whole.forwards == rows[1][2]["head"].forwards + rows[2][2]["head"].forwards


def test_settings_refuse_a_malformed_rule(monkeypatch, tmp_path):
    """EAGLE3_HYBRID unset: the plugin does nothing; a rule without its parameter, or an unknown one, is an error
    naming what it expects."""
    monkeypatch.delenv("EAGLE3_HYBRID", raising=False)
    assert settings() is None
    for bad, match in (('{"rule": "suffix-score"}', "needs \\['threshold'\\]"), ('{"rule": "x"}', "expected"),
                       ("[1]", "expected"), ("no/such/file.json", "neither a JSON rule nor a file")):
        monkeypatch.setenv("EAGLE3_HYBRID", bad)
        with pytest.raises(ValueError, match=match):
            settings()
    monkeypatch.setenv("EAGLE3_HYBRID", json.dumps({"rule": "ngram-match", "length": 3}))
    assert settings() == {"rule": "ngram-match", "length": 3}
    router = tmp_path / "router.json"  # a file, as bench_hybrid.py writes the fitted router
    router.write_text(json.dumps({"rule": "router", "weights": {"suffix": [0, 0, 1, 0, 0, -1]}}))
    monkeypatch.setenv("EAGLE3_HYBRID", str(router))
    assert settings()["weights"] == {"suffix": [0, 0, 1, 0, 0, -1]}


def test_eval_hybrid_is_served_by_vllm_with_a_greedy_chain():
    """eval.hybrid names an engine plugin (vLLM's or SGLang's): the built-in engine, a tree or sampling is refused at
    load, naming why; the rule reaches the plugin as it reads it."""
    from eagle3.config import load_config

    cfg = load_config(None, ["eval.engine=vllm", "eval.hybrid={rule: ngram-match, length: 3}"])
    assert cfg.eval.hybrid.engine_rule(cfg.eval.ngram_max) == {"rule": "ngram-match", "length": 3, "max": 4}
    assert load_config(None, ["eval.engine=vllm", "eval.hybrid={}"]).eval.hybrid.engine_rule(4) == {
        "rule": "suffix-score", "threshold": 1.0}
    for bad in (["eval.engine=builtin"], ["eval.engine=vllm", "eval.topk=2", "eval.num_draft_tokens=5"],
                ["eval.engine=vllm", "eval.temperature=0.7"]):
        with pytest.raises(Exception, match="eval.hybrid is served by vLLM or SGLang"):
            load_config(None, [*bad, "eval.hybrid={rule: suffix-score}"])
    with pytest.raises(Exception, match="eval.hybrid.rul"):
        load_config(None, ["eval.engine=vllm", "eval.hybrid={rul: x}"])


def test_eval_hybrid_router_reads_its_file(tmp_path):
    """eval.hybrid rule router takes the router from the file `router` names (as bench_hybrid.py writes it), its
    features checked; the file without the rule, or the rule without a file, is refused."""
    from eagle3.config import load_config

    f = tmp_path / "router.json"
    rule = {"rule": "router", "features": ["head_p1"], "weights": {"suffix": [-1.0, 0.5]}}
    f.write_text(json.dumps(rule))
    cfg = load_config(None, ["eval.engine=vllm", f"eval.hybrid={{rule: router, router: {f}}}"])
    assert cfg.eval.hybrid.engine_rule(4) == rule
    for bad in ("{rule: router}", f"{{rule: suffix-score, router: {f}}}"):
        with pytest.raises(Exception, match="eval.hybrid.router"):
            load_config(None, ["eval.engine=vllm", f"eval.hybrid={bad}"])
    f.write_text(json.dumps({**rule, "features": ["head_q"]}))
    with pytest.raises(ValueError, match="features are among"):
        cfg.eval.hybrid.engine_rule(4)


def test_a_router_fitted_on_rounds_takes_the_drafter_that_gains():
    """fit_router on hand-made rounds where the suffix draft wins exactly when its score is high: the learned rule
    takes it there and the head elsewhere; a round without a suffix draft stays the head's."""
    from eagle3.replay import Proposal, Recorder, fit_router, learned

    def props(score: float, suffix_acc: int, head_acc: int, tokens=(1, 2, 3)):
        return {"head": Proposal([9, 9, 9], head_acc), "suffix": Proposal(list(tokens), suffix_acc, score, 4),
                "ngram": Proposal([], 0)}

    rec = Recorder(always("head"))
    for _ in range(20):
        assert rec(props(2.5, 3, 0)) == "head"  # the recorder follows its rule
        rec(props(0.3, 0, 1))
    weights = fit_router(rec.rows)
    assert set(weights) == {"ngram", "suffix"} and len(weights["suffix"]) == 6
    rule = learned(weights)
    assert rule(props(2.5, 0, 0)) == "suffix" and rule(props(0.3, 0, 0)) == "head"
    assert rule(props(2.5, 0, 0, tokens=())) == "head"


def test_an_engine_rule_replays_as_the_plugins_decide():
    """eagle3.replay.engine_rule (bench_hybrid --router) and hybrid_rule.pick (both plugins) take the same drafter
    on the same round, for each kind of rule."""
    from eagle3.engines.hybrid_rule import parse_rule, pick
    from eagle3.replay import Proposal, engine_rule

    rules = [{"rule": "suffix-score", "threshold": 1.5}, {"rule": "ngram-match", "length": 3},
             {"rule": "router", "features": ["head_p1", "suffix_agree", "ngram_match"],
              "weights": {"suffix": [-2.0, -1.0, 0.0, 1.0], "ngram": [0.0, 0.0, 1.0, -2.5]}}, {"rule": "head"}]
    rounds = [(Proposal([5, 6, 7], probs=[p1, 0.5, 0.5]), Proposal(sx, score=score, match=2), Proposal(ng, match=n))
              for p1 in (0.1, 0.9) for sx, score in (([5, 9], 2.0), ([8], 0.5), ([], 0.0))
              for ng, n in (([1, 2, 3], 3), ([4], 2), ([], 0))]
    for raw in rules:
        rule = parse_rule(json.dumps(raw))
        replayed = engine_rule(rule)
        seen = set()
        for head, sx, ng in rounds:
            got = replayed({"head": head, "suffix": sx, "ngram": ng})
            chain = pick(rule, head.tokens, head.probs, (sx.tokens, sx.score, sx.match) if sx.tokens else None,
                         (ng.tokens, ng.match) if ng.tokens else None)
            want = "head" if chain is None else ("suffix" if sx.tokens and chain == sx.tokens else "ngram")
            assert got == want, (raw, head, sx, ng)
            seen.add(got)
        assert len(seen) == (1 if raw["rule"] == "head" else 2 if raw["rule"] != "router" else 3), (raw, seen)
