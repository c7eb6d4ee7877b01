"""eagle3's hybrid drafter in the real SGLang 0.5.23 on CPU (eagle3.engines.sglang_hybrid, a `sglang.srt.plugins`
entry point wrapping the EAGLE-3 draft worker's round): the head is exported with the rule beside it and the server
started with EAGLE3_HYBRID=auto, as a user serves it; its greedy text is the plain target's, and its verify steps
are the trace replay's (eagle3.replay) on the same prompts under the same rule.

    bash scripts/setup_sglang_cpu.sh && PYTHON=.venv-sglang/bin/python bash scripts/setup_suffix_decoding.sh
    pytest -m sglang tests/test_sglang_hybrid.py
"""

from __future__ import annotations

import pytest
import torch
from test_sglang_real import CPU_FLAGS, _omp_bind, sglang_env  # noqa: F401  (fixture)
from test_vllm_engine import _tiny_setup
from test_vllm_hybrid import PROMPTS, ROUTER, _blind, _replay, assert_hybrid_on_card

from eagle3.engines import EngineRun
from eagle3.engines.hybrid_rule import MODEL_FREE
from eagle3.engines.sglang_eval import run_sglang
from eagle3.replay import suffix_tree

pytestmark = pytest.mark.sglang


def _sglang_setup(tmp_path):
    """The vLLM tests' tiny target and head (tests/test_vllm_engine.py `_tiny_setup`), served by SGLang on this CPU
    (one rank on its core); skips where arctic-inference's suffix tree does not import."""
    try:
        suffix_tree()
    except ImportError as e:
        pytest.skip(str(e))
    _omp_bind(1)
    cfg = _tiny_setup(tmp_path)
    cfg.target.device, cfg.eval.engine = "cpu", "sglang"
    cfg.target.sglang.launch_args, cfg.target.sglang.startup_timeout_s = list(CPU_FLAGS), 900
    return cfg


def test_hybrid_in_sglang_is_lossless_and_verifies_the_replays_rounds(tmp_path):
    """The router (suffix decoding's draft of 2+ tokens, else prompt lookup's on a 3+ match, else the head's) with a
    head whose fc is random: its own drafts miss, so whatever SGLang accepts comes from the rounds the rule handed
    to a model-free drafter, and a plugin that did not load, or wrote the chains to the wrong rows, shows as the
    head's rounds (one token each) or as rounds the replay does not have."""
    from eagle3.engines.reference import compare_greedy, hf_greedy
    from eagle3.engines.vllm_eval import stop_token_ids

    torch.set_num_threads(2)
    cfg = _sglang_setup(tmp_path)
    _blind(cfg.checkpoint_dir / "best")
    k = cfg.eval.num_steps
    assert cfg.eval.topk == 1 and cfg.eval.num_draft_tokens == k + 1
    s = run_sglang(EngineRun(cfg.target, cfg.eval, cfg.paths), PROMPTS, cfg.checkpoint_dir / "best", hybrid=ROUTER)
    assert s["hybrid"] == ROUTER and s["draft"].endswith("sglang")
    assert (cfg.paths.export_dir / "sglang" / "eagle3_hybrid" / "rule.json").is_file()
    stop = stop_token_ids(cfg.target)
    same = compare_greedy(s["outputs"], hf_greedy(cfg.target, PROMPTS, cfg.eval.max_new_tokens, stop), stop)
    assert same["greedy_same"] == len(PROMPTS), same
    want = _replay(cfg, "router", k)
    assert want["other"] > 0 and want["drafted"] > want["other"], want  # both drafters were chosen
    assert sum(s["verify_steps_per_prompt"]) == want["rounds"], (s["verify_steps_per_prompt"], want)
    assert want["rounds"] < _replay(cfg, "head", k)["rounds"] * 3 // 4  # the rule's rounds, not the blind head's


def test_eval_puts_sglangs_hybrid_on_the_card(tmp_path):
    """`eagle3 eval --engine sglang` with eval.hybrid (a router file, as bench_hybrid.py writes one): the built-in run,
    SGLang with the head, then SGLang with the hybrid on the same prompts; the card's rows get SGLang's τ and tokens
    per forward for both, and the hybrid's greedy text is the head's. Then the same with SGLang alone
    (eval.builtin false): the same rounds."""
    import json

    from eagle3.config import HybridConfig
    from eagle3.evaluate import run
    from eagle3.report import card

    cfg = _sglang_setup(tmp_path)
    router = tmp_path / "router.json"
    router.write_text(json.dumps(ROUTER))
    cfg.eval.hybrid = HybridConfig(rule="router", router=str(router))
    report = run(cfg)
    s = report["engines"]["sglang"]
    assert s["hybrid"]["hybrid"] == ROUTER | {"features": list(MODEL_FREE)}
    assert s["hybrid"]["same_outputs_as_head"] == s["requests"] == 3
    assert_hybrid_on_card(report, "sglang")

    cfg.eval.builtin = False  # SGLang alone decodes every turn (the Kimi recipe's mode), then the hybrid replays them
    alone = run(cfg)
    a = alone["engines"]["sglang"]
    assert a["hybrid"]["same_outputs_as_head"] == a["requests"] == 3
    assert a["hybrid"]["verify_steps"] == s["hybrid"]["verify_steps"]  # the same turns, the same rounds
    assert any("sglang_hybrid_tokens_per_forward" in r for r in card(alone))


def test_hybrid_in_sglang_with_requests_batched_together(tmp_path):
    """Prompts sent at once share SGLang's draft batches: the plugin rewrites each request's own row (its check that a
    row's root is that request's last token would stop the server otherwise), and every text is the plain target's."""
    from concurrent.futures import ThreadPoolExecutor

    from eagle3.engines.reference import compare_greedy, hf_greedy
    from eagle3.engines.sglang_eval import generate, serving
    from eagle3.engines.vllm_eval import stop_token_ids

    cfg = _sglang_setup(tmp_path)
    run = EngineRun(cfg.target, cfg.eval, cfg.paths)
    stop = stop_token_ids(cfg.target)
    prompts = PROMPTS * 3
    with serving(run, cfg.checkpoint_dir / "best", ROUTER) as (url, _), ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: generate(url, ids, run, stop), prompts))
    metas = [o["meta_info"] for o in outs]
    assert all(m["completion_tokens"] == cfg.eval.max_new_tokens for m in metas), metas
    same = compare_greedy([o["output_ids"] for o in outs], hf_greedy(cfg.target, prompts, cfg.eval.max_new_tokens, stop),
                          stop)
    assert same["greedy_same"] == len(prompts), same
    assert sum(m["spec_verify_ct"] for m in metas) < len(prompts) * (cfg.eval.max_new_tokens - 1) * 3 // 4  # drafts pay
