"""Prompt-lookup (n-gram) drafting beside the head, and the card's context-length buckets."""

from __future__ import annotations

import json
import random

import pytest
from copy_heads import repeat_current_token
from test_evaluate import _setup

from eagle3.evaluate import CONTEXT_BUCKETS, context_bucket
from eagle3.specdec import ngram_proposal


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """vLLM's rule written out plainly: over every earlier position, the longest n-gram ending the context (the
    earliest occurrence of it), then up to k tokens after it."""
    best, start = 0, None
    for n in range(min_n, max_n + 1):
        if n >= len(tokens):
            break
        suffix = tokens[-n:]
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == suffix:
                if n > best:
                    best, start = n, i + n
                break
    return [] if start is None else tokens[start:start + k]


def test_ngram_proposal_is_vllms_rule():
    assert ngram_proposal([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert ngram_proposal([7, 1, 2, 8, 1, 2], 2) == [8, 1]  # n=2 beats nothing longer; k tokens after the match
    assert ngram_proposal([1, 2, 9, 5, 1, 2, 9, 6, 1, 2, 9], 3) == [5, 1, 2]  # longest (3), earliest occurrence
    assert ngram_proposal([5, 6, 7], 3) == [] and ngram_proposal([4], 3) == []
    assert ngram_proposal([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    assert ngram_proposal([1, 2, 3, 1, 2], 3, min_n=3) == []  # only a 2-gram matches
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        assert ngram_proposal(seq, 3, 2, 4) == _reference(seq, 3, 2, 4), seq


def test_ngram_is_measured_beside_the_head_and_stays_lossless(tmp_path, capsys):
    """A target that repeats its current token: the context ends with that token over and over, so n-gram drafting
    proposes it every step and is accepted in full where the random head accepts about nothing; the card prints its
    τ and tokens per forward next to the head's, per set and category."""
    from eagle3.evaluate import run

    cfg = _setup(tmp_path)  # its head is random: it drafts nothing useful, n-gram must win here
    repeat_current_token(cfg.target.path)
    template = tmp_path / "plain.jinja"
    template.write_text("{{ messages | map(attribute='content') | join(' ') }}")
    cfg.data.chat_template = str(template)
    cfg.eval.max_new_tokens = 24
    prompts = tmp_path / "rep.jsonl"
    prompts.write_text('{"id": "a", "category": "x", "prompt": "Say ppp"}\n{"id": "b", "category": "y", '
                       '"prompt": "Now tt"}\n')
    cfg.eval.prompt_sets = [str(prompts)]
    r = run(cfg)["sets"]["rep"]
    ng = r["ngram"]
    assert ng["greedy_mismatches"] == 0  # lossless
    # every draft is accepted whole; the first steps of a turn draft fewer than 3 (the match ends the context)
    assert ng["acceptance_rate"][0] == 1.0 and ng["acceptance_rate"][2] > 0.6
    assert ng["tau"] >= 3 > 1.5 > r["tau"]
    assert ng["tokens_per_forward"] > 2.5 > 1.5 > r["tokens_per_forward"]
    assert set(r["categories"]) == {"x", "y"} and all("ngram" in c for c in r["categories"].values())
    assert sum(c["ngram"]["verify_steps"] for c in r["categories"].values()) == ng["verify_steps"]
    out = capsys.readouterr().out
    head_line = next(line for line in out.splitlines() if line.startswith("prompt set"))
    assert "ngram τ" in head_line and "ng tok/fwd" in head_line
    saved = json.loads((cfg.eval_dir / "report.json").read_text())
    rows = {row["set"]: row for row in saved["card"]}
    assert rows["rep"]["ngram_tau"] == pytest.approx(ng["tau"]) and "rep/x" in rows


def test_context_buckets_split_the_verify_steps_by_where_they_draft(tmp_path, capsys):
    from eagle3.evaluate import run

    assert [context_bucket(p) for p in (0, 2047, 2048, 8191, 8192, 32767, 32768)] == [
        "<2K", "<2K", "2-8K", "2-8K", "8-32K", "8-32K", ">32K"]
    assert [name for _, name in CONTEXT_BUCKETS] == ["<2K", "2-8K", "8-32K", ">32K"]
    cfg = _setup(tmp_path)
    cfg.eval.max_new_tokens = 40
    cfg.eval.ngram = False
    template = tmp_path / "plain.jinja"
    template.write_text("{{ messages | map(attribute='content') | join(' ') }}")
    cfg.data.chat_template = str(template)
    prompts = tmp_path / "long.jsonl"
    # one byte per token (the test tokenizer): a prompt that ends 30 tokens before position 2048
    prompts.write_text(json.dumps({"id": "long", "prompt": "a" * 2018}) + "\n" + json.dumps({"prompt": "short"}) + "\n")
    cfg.eval.prompt_sets = [str(prompts)]
    r = run(cfg)["sets"]["long"]
    b = r["context_buckets"]
    assert list(b) == ["<2K", "2-8K"]
    assert sum(x["verify_steps"] for x in b.values()) == r["verify_steps"]
    pooled = sum(x["tau"] * x["verify_steps"] for x in b.values()) / r["verify_steps"]
    assert pooled == pytest.approx(r["tau"])
    saved = json.loads((cfg.eval_dir / "report.json").read_text())
    assert {row["set"] for row in saved["card"]} >= {"long@<2K", "long@2-8K"}
    assert "long@2-8K" in capsys.readouterr().out


def test_code_edit_asks_to_return_each_humaneval_function_with_one_change():
    from eagle3.data.edits import EVAL_KINDS
    from eagle3.prompts import load_prompt_set

    ps = load_prompt_set("code-edit")
    assert len(ps.prompts) == 164 and {p.category for p in ps.prompts} == set(EVAL_KINDS)
    first = ps.prompts[0]
    assert first.id == "HumanEval/0/rename" and first.category == "rename"
    ask = first.turns[0]
    assert ask.startswith("Rename the function `has_close_elements` to `has_close_elements_v2`")
    # the whole function, its solution included: the answer is mostly a copy of it
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in ask
    assert "distance = abs(elem - elem2)" in ask and ask.endswith("```")
    capped = load_prompt_set("code-edit", max_prompts=3)
    assert [p.category for p in capped.prompts].count("comments") == 3 and len(capped.prompts) == 12
