"""Prompt sets with tools: BFCL bundled from bfcl-eval, agentic JSONL prompts, and the evaluator on them."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from agentic_data import WEATHER
from test_evaluate import _setup

from eagle3.data.templates import TemplateError
from eagle3.prompts import load_prompt_set, read_jsonl_prompts


def test_bfcl_is_bundled_with_one_category_per_file():
    ps = load_prompt_set("bfcl")
    assert Counter(p.category for p in ps.prompts) == {
        "simple_python": 400, "simple_java": 100, "simple_javascript": 50, "multiple": 200, "parallel": 200,
        "parallel_multiple": 200, "irrelevance": 240}
    assert ps.num_turns == len(ps.prompts) == 1390 and not any(p.id.startswith(("live", "multi_turn")) for p in ps.prompts)
    by_id = {p.id: p for p in ps.prompts}
    p = by_id["simple_python_1"]
    assert [t.role for t in p.messages] == ["user"] and "factorial of 5" in p.messages[0].content
    (fn,) = [t["function"] for t in p.tools]
    assert fn["name"] == "math_factorial"  # BFCL's dots are not allowed in OpenAI function names
    assert fn["description"].endswith(" Note that the provided function is in Python 3 syntax.")
    assert fn["parameters"] == {"type": "object", "properties": {"number": {
        "type": "integer", "description": "The number for which factorial needs to be calculated."}},
        "required": ["number"]}
    java = by_id["simple_java_0"].tools[0]["function"]
    assert java["description"].endswith("in Java 8 SDK syntax.") and java["parameters"]["type"] == "object"
    types = {v.get("type") for p in ps.prompts for t in p.tools
             for v in t["function"]["parameters"]["properties"].values()}
    assert types <= {"integer", "number", "string", "boolean", "array", "object"}, types  # JSON schema's only
    capped = load_prompt_set("bfcl", max_prompts=2)
    assert Counter(p.category for p in capped.prompts) == {c: 2 for c in Counter(x.category for x in ps.prompts)}


def test_bfcl_live_is_a_training_source_disjoint_from_the_prompt_set():
    """BFCL's live questions as tool prompts to regenerate: each with its tools and a user turn, no answer
    (so prepare alone skips them all), the categories interleaved so the first few cover each, and none of them a
    question of the `bfcl` prompt set it is measured on."""
    from eagle3.config import SourceConfig
    from eagle3.data.sources import SourceStats, read_conversations

    live = list(read_conversations(SourceConfig(path="bundled:bfcl-live"), for_generation=True))
    assert len(live) == 2251 and all(c.turns[-1].role == "user" for c in live)
    assert sum(not c.tools for c in live) == 4  # four live_irrelevance questions offer no function at all
    kinds = Counter(c.id.split("-")[0].rsplit("_", 1)[0] for c in live[:60])
    assert set(kinds) == {"live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
                          "live_irrelevance", "live_relevance"}, kinds
    eval_ids = {p.id for p in load_prompt_set("bfcl").prompts}
    assert not eval_ids & {c.id for c in live}
    stats = SourceStats("live")
    assert list(read_conversations(SourceConfig(path="bundled:bfcl-live"), stats)) == []
    assert stats.skipped == {"no_assistant_turn": 2251}


def test_sharegpt_long_replays_long_histories_held_out_from_the_train_split(tmp_path):
    from datasets import Dataset
    from models import make_prepared

    from eagle3.prompts import LONG_PROMPTS, sharegpt_long

    ps = load_prompt_set("sharegpt-long")
    assert len(ps.prompts) == ps.num_turns == LONG_PROMPTS
    for p in ps.prompts:
        chars = sum(len(t.content) for t in p.messages)
        assert 8000 <= chars <= 28000 and len(p.messages) >= 3 and p.messages[-1].role == "user", p.id
        assert p.to_generate() == [None]  # the history is the prompt; its next answer is generated
    # a prepared train split that holds two of them (one under prepare's #n suffix of a repeated id): they are
    # left out, the set refilled from later conversations
    import shutil

    from datasets import load_from_disk

    prepared = make_prepared(tmp_path / "prep", n=6, n_eval=1)
    train = load_from_disk(str(prepared / "train")).to_dict()
    # ... and a third by a later part of its conversation: ShareGPT V3's `<id>_<k>`, which the set joins back
    long = [p for p in ps.prompts if sum(len(t.content) for t in p.messages) > 16000]
    assert len(long) == 75  # the whole bundled file, unjoined, has 53 records that long
    train["id"][:3] = [ps.prompts[0].id, ps.prompts[3].id + "#1", ps.prompts[5].id.rsplit("_", 1)[0] + "_40"]
    shutil.rmtree(prepared / "train")
    Dataset.from_dict(train).save_to_disk(str(prepared / "train"))
    held = sharegpt_long(prepared)
    ids = [p.id for p in held.prompts]
    assert len(ids) == LONG_PROMPTS and not {ps.prompts[k].id for k in (0, 3, 5)} & set(ids)
    assert ids[:3] == [ps.prompts[1].id, ps.prompts[2].id, ps.prompts[4].id]


def test_an_agentic_prompt_is_its_history_up_to_the_answer(tmp_path):
    f = tmp_path / "agent.jsonl"
    rec = {"id": "a1", "category": "weather", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "-3 C"},
        {"role": "assistant", "content": "It is -3 C."}]}  # the reference answer: generated, not given
    f.write_text(json.dumps(rec) + "\n" + json.dumps({"id": "a2", "tools": [WEATHER], "messages": rec["messages"][:1]})
                 + "\n")
    ps = read_jsonl_prompts(f)
    a1, a2 = ps.prompts
    assert [t.role for t in a1.messages] == ["user", "assistant", "tool"] and a1.category == "weather"
    assert a1.tools == [WEATHER] and a1.has_tools and a1.to_generate() == [None] and ps.num_turns == 2
    assert [t.role for t in a2.messages] == ["user"]
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "x", "content": "r"}]}
    f.write_text(json.dumps(rec) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"agent\.jsonl:2: .*tool_result_without_call"):
        read_jsonl_prompts(f)


def _agentic_prompts(tmp_path):
    rows = [{"id": f"w{i}", "category": "call" if i % 2 else "answer", "tools": [WEATHER], "messages": [
        {"role": "user", "content": f"Weather in town {i}?"},
        *([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "get_weather",
                                                                        "arguments": f'{{"city": "t{i}"}}'}}]},
           {"role": "tool", "tool_call_id": "c", "content": f"{i} C"}] if i % 2 == 0 else [])]} for i in range(4)]
    f = tmp_path / "agentic.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_the_evaluator_measures_tool_prompts_per_category_with_their_tools_rendered(tmp_path):
    from transformers import AutoTokenizer

    from eagle3.evaluate import run

    cfg = _setup(tmp_path)
    cfg.data.chat_template = "chatml-tools"
    cfg.eval.prompt_sets = [str(_agentic_prompts(tmp_path))]
    report = run(cfg)
    r = report["sets"]["agentic"]
    assert r["turns"] == 4 and set(r["categories"]) == {"answer", "call"}
    assert sum(c["verify_steps"] for c in r["categories"].values()) == r["verify_steps"] > 0
    assert r["greedy_mismatches"] == 0  # lossless on tool prompts too
    tok = AutoTokenizer.from_pretrained(cfg.target.path)
    rendered = json.loads((cfg.eval_dir / "rendered_prompts.json").read_text())["agentic"]
    texts = [tok.decode(ids) for ids in rendered]
    assert all('"name": "get_weather"' in t and "<tools>" in t for t in texts)  # the declarations reached the target
    assert "<tool_response>\n0 C\n</tool_response>" in texts[0] and texts[0].endswith("<|im_start|>assistant\n")


def test_a_template_that_drops_tools_is_refused_for_tool_prompts(tmp_path):
    from eagle3.evaluate import run

    cfg = _setup(tmp_path)  # the test tokenizer's own template: plain ChatML
    cfg.eval.prompt_sets = [str(_agentic_prompts(tmp_path))]
    with pytest.raises(TemplateError, match=r"4 of 4 prompts use tools.*chatml-tools"):
        run(cfg)
