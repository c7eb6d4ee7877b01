"""`eagle3 regenerate` on agentic conversations: calls parsed back out of the template's text (the inverse of its
render), recorded tool results replayed only while the regenerated call equals the recorded one, the cut at the
first different call (counted), call-only prompts, the output read back by `prepare`, the OpenAI client's request
bodies and tool_calls against the fake server, and the HF backend (a tiny random Llama end to end; a scripted
model that emits Kimi's call markers, through the real decode, parse and prepare).

    pytest -q tests/test_regenerate_tools.py      # about 20 s
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from agentic_data import WEATHER, good_records
from fake_openai_server import FakeOpenAIServer
from tokenizer_builders import KIMI_SPECIALS, kimi_test_tokenizer, llama_test_tokenizer

from eagle3 import prepare
from eagle3.config import Config, SourceConfig
from eagle3.data.prepared import load_prepared
from eagle3.data.sources import SourceStats, read_conversations
from eagle3.data.templates import TemplateError, answer_spans, render_prompt
from eagle3.data.tool_calls import parse_tool_calls
from eagle3.data.types import Conversation, ToolCall, Turn
from eagle3.regenerate import Summary, load_conversations, run
from eagle3.regenerate.dialogue import Answer, Dialogue, Outcome, split_reasoning
from eagle3.regenerate.openai import OpenAIBackend

SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_back(path: Path) -> tuple[dict[str, Conversation], SourceStats]:
    """The output as `prepare` reads it (not for generation: every record must be a training sample)."""
    stats = SourceStats("regenerated")
    return {c.id: c for c in read_conversations(SourceConfig(path=str(path)), stats)}, stats


def call(name: str, args: str, cid: str | None = None) -> ToolCall:
    return ToolCall(name, args, cid)


# ---------------------------------------------------------------------------- parsing: render, then parse back
PARALLEL = Conversation("p", [
    Turn("user", "Weather in Paris and Rome?"),
    Turn("assistant", "Checking.", reasoning="two cities", tool_calls=(
        call("get_weather", '{"city": "Paris"}', "a"), call("get_weather", '{"city":"Rome", "unit": "C"}', "b"))),
    Turn("tool", "18C", tool_call_id="a", name="get_weather"),
    Turn("tool", "21C", tool_call_id="b", name="get_weather"),
    Turn("assistant", "", reasoning="one more", tool_calls=(call("search", '{"q": "Rome \\u00e9t\\u00e9"}', "c"),)),
    Turn("tool", "hot", tool_call_id="c", name="search"),
    Turn("assistant", "Paris 18C, Rome 21C and hot."),
], tools=[WEATHER, SEARCH])


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    return kimi_test_tokenizer(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def chatml_tok(tmp_path_factory):
    return llama_test_tokenizer(tmp_path_factory.mktemp("chatml"), vocab_size=320)


@pytest.mark.parametrize(("template", "style", "thinking"), [
    ("kimi-k2.5", "kimi", False), ("kimi-k2.5", "kimi", True), ("chatml-tools", "hermes", False)])
def test_parse_inverts_what_the_template_renders(request, template, style, thinking):
    """Each assistant turn's trained span (what the model generates) parses back to its text, reasoning and calls,
    arguments as the exact JSON text the template wrote (Kimi's: `tojson` of the parsed object, as SGLang and vLLM
    render history calls; chatml-tools: the text as given); the parsed turns render to the same text again."""
    tok = request.getfixturevalue("chatml_tok" if style == "hermes" else "kimi_tok")
    text, spans = answer_spans(PARALLEL, tok, template, thinking)
    answers = [t for t in PARALLEL.turns if t.role == "assistant"]
    parsed_turns = []
    for (a, b), original in zip(spans, answers, strict=True):
        generated = text[a:b].removesuffix("<|im_end|>")
        parsed = parse_tool_calls(generated, style)
        assert not parsed.malformed
        content, reasoning = split_reasoning(parsed.content)
        assert content == original.content
        assert reasoning == (original.reasoning if thinking else None)
        written = [(c.name, json.dumps(json.loads(c.arguments), ensure_ascii=False) if style == "kimi" else c.arguments)
                   for c in original.tool_calls]
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == written
        parsed_turns.append(Turn("assistant", content, reasoning, parsed.tool_calls))
    ids = [c.id for t in parsed_turns for c in t.tool_calls]
    # Kimi: the id the model wrote, the conversation-wide counter; Hermes writes none
    assert ids == (["functions.get_weather:0", "functions.get_weather:1", "functions.search:2"] if style == "kimi"
                   else [None] * 3)
    # The parsed turns (under the record's ids, which the results name) render to the same text.
    it = iter(parsed_turns)
    turns = [t.with_(content=(p := next(it)).content, reasoning=p.reasoning, tool_calls=tuple(
        ToolCall(c.name, c.arguments, o.id) for c, o in zip(p.tool_calls, t.tool_calls, strict=True)))
        if t.role == "assistant" else t for t in PARALLEL.turns]
    again, _ = answer_spans(Conversation("p", turns, tools=PARALLEL.tools), tok, template, thinking)
    assert again == text


K_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
          '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')


@pytest.mark.parametrize(("style", "text"), [
    ("kimi", K_CALL.replace('{"city": "Paris"}', '{"city": Paris}')),  # arguments not JSON
    ("kimi", K_CALL.replace('{"city": "Paris"}', '["Paris"]')),  # not an object
    ("kimi", K_CALL.removesuffix("<|tool_call_end|><|tool_calls_section_end|>")),  # cut off by max_tokens
    ("kimi", K_CALL + " and more text"),  # text after the calls
    ("kimi", K_CALL.replace("functions.get_weather:0", "0")),  # a bare counter names no function
    ("kimi", "text <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"),  # no section
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'),  # unclosed
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone, anything else?'),
])
def test_a_call_that_does_not_parse_stays_text(style, text):
    parsed = parse_tool_calls(text, style)
    assert parsed.malformed and parsed.content == text and parsed.tool_calls == ()


def test_plain_text_and_other_spellings():
    for style in ("kimi", "hermes", None):
        assert parse_tool_calls("just text", style) == parse_tool_calls("just text", None)
        assert not parse_tool_calls("just text", style).malformed
    assert parse_tool_calls(K_CALL, None).content == K_CALL  # a template without calls looks for none
    # the text before the calls, as rendered: chatml-tools puts one newline between it and the first call
    assert parse_tool_calls('Sure.\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "hermes").content \
        == "Sure.\n"
    # Hermes JSON in another key order or spacing: read, the arguments re-serialised
    other = parse_tool_calls('<tool_call>{"arguments": {"city": "Nîmes"}, "name": "get_weather"}</tool_call>', "hermes")
    assert other.tool_calls == (ToolCall("get_weather", '{"city": "Nîmes"}'),) and other.content == ""
    spaced = parse_tool_calls("<|tool_calls_section_begin|>\n<|tool_call_begin|> get_weather:3 "
                              '<|tool_call_argument_begin|> {"city": "x"} <|tool_call_end|>\n'
                              "<|tool_calls_section_end|>", "kimi")
    assert spaced.tool_calls == (ToolCall("get_weather", '{"city": "x"}', "get_weather:3"),)


# ------------------------------------------------------------------------------ the dialogue, scripted answers
class ScriptedBackend:
    """A test backend: each conversation's answers come from its script, in order; every prompt is recorded."""

    def __init__(self, scripts: dict[str, list[Answer]]):
        self.scripts = {k: deque(v) for k, v in scripts.items()}
        self.prompts: dict[str, list[list[Turn]]] = {}

    def outcomes(self, dialogues: Iterable[Dialogue]) -> Iterator[Outcome]:
        for d in dialogues:
            while (history := d.next_prompt()) is not None:
                self.prompts.setdefault(d.source.id, []).append(history)
                d.add_answer(self.scripts[d.source.id].popleft())
            assert not self.scripts[d.source.id], f"{d.source.id}: answers left over"
            yield d.outcome()


def say(text: str) -> Answer:
    return Answer(text, tokens=len(text.split()), finish_reason="stop")


def calls(*cs: tuple[str, str]) -> Answer:
    return Answer("", tool_calls=tuple(ToolCall(n, a) for n, a in cs), tokens=3, finish_reason="tool_calls")


def cfg_for(tmp_path: Path, src: Path, **data) -> Config:
    return Config(output_dir=str(tmp_path / "run"), data={"sources": [{"path": str(src)}], **data})


def records() -> list[dict]:
    par, text, sg, call_only = good_records(4)  # tests/agentic_data.py: the four kinds
    return [
        par, text, sg, call_only,
        # BFCL-style: tools and a question, no answer at all
        {"id": "bfcl", "tools": [WEATHER], "messages": [{"role": "user", "content": "Weather in Oslo?"}]},
        # two steps: the first call equals the record's, the second does not
        {"id": "steps", "tools": [WEATHER, SEARCH], "messages": [
            {"role": "user", "content": "Plan a trip to Rome."},
            {"role": "assistant", "tool_calls": [{"id": "s1", "function": {"name": "search", "arguments": '{"q": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "s1", "content": "Rome, Italy"},
            {"role": "assistant", "tool_calls": [{"id": "s2", "function": {"name": "get_weather",
                                                                            "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "s2", "content": "21C"},
            {"role": "assistant", "content": "Go, it is 21C."}]},
        # a call where the record answered in text and went on
        {"id": "chatty", "tools": [WEATHER], "messages": [
            {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye."}, {"role": "assistant", "content": "Bye."}]},
        # a trailing tool result (a prompt read for generation): the answer after it is generated
        {"id": "trailing", "tools": [WEATHER], "messages": [
            {"role": "user", "content": "Weather in Bern?"},
            {"role": "assistant", "tool_calls": [{"id": "t", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}]},
            {"role": "tool", "tool_call_id": "t", "content": "5C"}]},
        # no tools at all: written as ShareGPT, as before
        {"id": "plain", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "5"}]},
    ]


SCRIPTS = {
    # the parallel calls in the other order, other spacing: equal; the results follow the new order
    "par0": [calls(("get_weather", '{"city":"Town0"}'), ("get_weather", '{ "city" : "City0" }')), say("Both mild.")],
    "text1": [calls(("search", '{"q": "umbrella City1"}'))],  # a different call: cut, counted
    "sg2": [say("It is warm, I think.")],  # text where the record called: cut, counted
    "call3": [calls(("get_weather", '{"city": "City3", "unit": "C"}'))],  # different, but the record ends there
    "bfcl": [calls(("get_weather", '{"city": "Oslo"}'))],
    "steps": [calls(("search", '{"q": "Rome"}')), calls(("get_weather", '{"city": "Roma"}'))],
    "chatty": [calls(("get_weather", '{"city": "Hi"}'))],
    "trailing": [calls(("get_weather", '{"city":"Bern"}')), say("5C in Bern.")],
    "plain": [say("4")],
}


def test_results_are_replayed_while_calls_equal_and_the_first_different_call_ends_the_conversation(tmp_path):
    src = write_jsonl(tmp_path / "agentic.jsonl", records())
    cfg = cfg_for(tmp_path, src)
    backend = ScriptedBackend(SCRIPTS)
    s = run(cfg, load_conversations(cfg.data), backend)
    assert (s.regenerated, s.failed, s.skipped_no_prompt) == (9, 0, 0)
    assert s.cut_at_different_call == 4  # text1, sg2, steps, chatty; not call3 (its record ends at that call)
    assert (s.tool_call_answers, s.replayed_results) == (8, 4)
    assert "4 ended at a tool call that differs from the record's (8 answers are tool calls, 4 recorded " \
           "results replayed, 0 answers with malformed calls kept as text)" in s.line()

    # What the backend was asked: after an equal parallel call, the results in the regenerated calls' order, each
    # carrying its regenerated call's id (the dialogue numbers calls that came without one).
    second = backend.prompts["par0"][1]
    assert [(t.role, t.content, t.tool_call_id) for t in second[-2:]] == [
        ("tool", '{"temp": 1}', "call_0"), ("tool", "0 C, sunny", "call_1")]
    assert [c.id for c in second[-3].tool_calls] == ["call_0", "call_1"]
    assert len(backend.prompts["steps"]) == 2 and backend.prompts["steps"][1][-1].content == "Rome, Italy"
    assert [t.role for t in backend.prompts["trailing"][1]] == ["user", "assistant", "tool"]

    convs, stats = read_back(cfg.regenerated_path)  # prepare's reader: every record is a usable sample
    assert sorted(convs) == sorted(SCRIPTS) and not stats.skipped

    def shape(cid: str) -> list[tuple]:
        return [(t.role, t.content, tuple((c.name, c.arguments) for c in t.tool_calls), t.tool_call_id)
                for t in convs[cid].turns]

    assert shape("par0") == [
        ("user", "Weather in City0 and Town0?", (), None),
        ("assistant", "", (("get_weather", '{"city":"Town0"}'), ("get_weather", '{ "city" : "City0" }')), None),
        ("tool", '{"temp": 1}', (), "call_0"), ("tool", "0 C, sunny", (), "call_1"),
        ("assistant", "Both mild.", (), None)]
    assert shape("text1")[-1] == ("assistant", "", (("search", '{"q": "umbrella City1"}'),), None)
    assert [t.role for t in convs["text1"].turns] == ["system", "user", "assistant"]
    assert shape("sg2")[1:] == [("assistant", "It is warm, I think.", (), None)]
    assert shape("call3")[1:] == [("assistant", "", (("get_weather", '{"city": "City3", "unit": "C"}'),), None)]
    assert shape("bfcl") == [("user", "Weather in Oslo?", (), None),
                             ("assistant", "", (("get_weather", '{"city": "Oslo"}'),), None)]
    assert [t.role for t in convs["steps"].turns] == ["user", "assistant", "tool", "assistant"]
    assert shape("steps")[-1][2] == (("get_weather", '{"city": "Roma"}'),)
    assert shape("chatty") == [("user", "Hi!", (), None), ("assistant", "", (("get_weather", '{"city": "Hi"}'),), None)]
    assert shape("trailing")[2:] == [("tool", "5C", (), "call_0"), ("assistant", "5C in Bern.", (), None)]
    assert all(convs[c].tools for c in SCRIPTS if c != "plain")

    out = {r["id"]: r for r in read_jsonl(cfg.regenerated_path)}
    assert out["plain"] == {"id": "plain", "conversations": [{"from": "human", "value": "2+2?"},
                                                             {"from": "gpt", "value": "4"}]}
    assert out["bfcl"] == {"id": "bfcl", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]}

    # Resume: the records are read back for their ids, nothing is asked again.
    again = run(cfg, load_conversations(cfg.data), ScriptedBackend({}))
    assert (again.regenerated, again.skipped_done) == (0, 9)

    # prepare trains on it through a template that renders tools: the calls are in the loss, nothing skipped.
    tok_dir = tmp_path / "tok"
    llama_test_tokenizer(tok_dir, vocab_size=320)
    pcfg = Config(output_dir=str(tmp_path / "run"), target={"path": str(tok_dir)},
                  data={"sources": [{"path": str(cfg.regenerated_path)}], "chat_template": "chatml-tools",
                        "eval_size": 0}, draft={"vocab_size": 40})
    summary = prepare.run(pcfg)
    assert summary["sources"][0]["skipped"] == {} and summary["render"]["tool_conversations"] == 8
    row = next(r for r in load_prepared(pcfg.prepared_dir).train if r["id"] == "bfcl")
    tok = llama_test_tokenizer(tmp_path / "tok2", vocab_size=320)
    trained = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    assert trained == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'


def test_a_prompt_without_an_answer_is_regenerated_not_skipped(tmp_path):
    """Reading for generation: a tools + user record (BFCL) and a ShareGPT record ending with a question are
    prompts; before, the reader dropped the first as no_assistant_turn and the trailing question of the second."""
    src = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "q", "tools": [WEATHER], "messages": [{"role": "user", "content": "Weather?"}]},
        {"id": "open", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                                         {"from": "human", "value": "c"}]},
        {"id": "none", "conversations": [{"from": "system", "value": "only a system turn"}]}])
    cfg = cfg_for(tmp_path, src)
    backend = ScriptedBackend({"q": [calls(("get_weather", "{}"))], "open": [say("B"), say("C")]})
    s = run(cfg, load_conversations(cfg.data), backend)
    assert (s.regenerated, s.skipped_no_prompt, s.cut_at_different_call) == (2, 1, 0)
    convs, _ = read_back(cfg.regenerated_path)
    assert [t.content for t in convs["open"].turns] == ["a", "B", "c", "C"]


def test_dialogue_cut_by_max_length_keeps_the_call_and_drops_the_results():
    conv = Conversation("m", [Turn("user", "u"), Turn("assistant", "", tool_calls=(call("f", "{}", "x"),)),
                              Turn("tool", "r", tool_call_id="x", name="f"), Turn("assistant", "done")], tools=[WEATHER])
    d = Dialogue(conv, max_length=50)
    d.next_prompt()
    d.add_answer(Answer("", tool_calls=(call("f", "{}"),), tokens=20, prompt_tokens=40))
    assert d.next_prompt() is None  # 60 tokens: the replayed result and the answer after it are not asked for
    out = d.outcome()
    assert [t.role for t in out.conversation.turns] == ["user", "assistant"]
    assert out.cut_at_max_length and not out.cut_at_different_call and out.replayed_results == 0


# ----------------------------------------------------------------------------------- OpenAI backend, fake server
def test_openai_sends_tools_and_stores_the_servers_tool_calls(tmp_path):
    paris, rome = '{"city": "Paris"}', '{"city": "Rome"}'
    src = write_jsonl(tmp_path / "a.jsonl", [
        {"id": "same", "tools": [WEATHER], "messages": [
            {"role": "user", "content": f"CALL get_weather {rome} CALL get_weather {paris}"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "p", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "r", "function": {"name": "get_weather", "arguments": rome}}]},
            {"role": "tool", "tool_call_id": "p", "content": "18C"},
            {"role": "tool", "tool_call_id": "r", "content": "21C"},
            {"role": "assistant", "content": "Paris 18C, Rome 21C."}]},
        {"id": "other", "tools": [WEATHER], "messages": [
            {"role": "user", "content": "CALL get_weather {\"city\": \"Lyon\"}"},
            {"role": "assistant", "tool_calls": [{"id": "p", "function": {"name": "get_weather", "arguments": paris}}]},
            {"role": "tool", "tool_call_id": "p", "content": "18C"},
            {"role": "assistant", "content": "18C."}]},
        {"id": "bad", "tools": [WEATHER], "messages": [{"role": "user", "content": "BAD_CALL please"}]},
        {"id": "plain", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "x"}]},
    ])
    with FakeOpenAIServer() as srv:
        cfg = Config(output_dir=str(tmp_path / "run"), data={"sources": [{"path": str(src)}]},
                     regenerate={"backend": "openai", "endpoints": [srv.url], "model": "fake-model", "timeout_s": 5.0,
                                 "concurrency": 1, "max_tokens": 32})
        s = run(cfg, load_conversations(cfg.data), OpenAIBackend(cfg.regenerate, backoff_s=0.01))
        bodies = {}
        for b in srv.chat_bodies():
            bodies.setdefault(next(m["content"] for m in b["messages"] if m["role"] == "user"), []).append(b)
    assert (s.regenerated, s.failed, s.truncated_turns) == (4, 0, 0)
    assert (s.cut_at_different_call, s.tool_call_answers, s.replayed_results, s.malformed_tool_calls) == (1, 2, 2, 1)

    same = bodies[f"CALL get_weather {rome} CALL get_weather {paris}"]
    assert all(b["tools"] == [WEATHER] for b in same) and len(same) == 2
    # The history goes back in the OpenAI shape: the server's calls with its ids, the results (in the order of
    # the server's calls, not the record's) naming those ids and the function.
    assert same[1]["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": rome}},
            {"id": "functions.get_weather:1", "type": "function", "function": {"name": "get_weather", "arguments": paris}}]},
        {"role": "tool", "content": "21C", "tool_call_id": "functions.get_weather:0", "name": "get_weather"},
        {"role": "tool", "content": "18C", "tool_call_id": "functions.get_weather:1", "name": "get_weather"}]
    assert "tools" not in bodies["hello"][0]  # a conversation without tools sends none

    out = {r["id"]: r for r in read_jsonl(cfg.regenerated_path)}
    assert out["same"]["messages"][-1] == {"role": "assistant", "content": "A2: after 21C + 18C"}
    assert out["other"]["messages"][1:] == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]}]
    # A call whose arguments are not JSON cannot be trained on (prepare would skip the record): kept as text.
    assert out["bad"]["messages"][1] == {"role": "assistant", "content": "let me call"}
    assert "conversations" in out["plain"]
    convs, stats = read_back(cfg.regenerated_path)
    assert len(convs) == 4 and not stats.skipped


# ------------------------------------------------------------------------------------------------- HF backend
@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    from models import tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(path, vocab=320, layers=2)
    llama_test_tokenizer(path, vocab_size=320)
    return path


def test_hf_backend_renders_tools_and_refuses_a_template_that_drops_them(tmp_path, tiny_target):
    """The real HF backend on a random Llama: prompts carry the tools through chatml-tools; greedy answers of a
    random model are text, so every record whose answer was a call and that went on is cut, and counted."""
    from eagle3.regenerate.hf import HFBackend

    src = write_jsonl(tmp_path / "a.jsonl", good_records(4))
    cfg = Config(output_dir=str(tmp_path / "run"), target={"path": str(tiny_target), "dtype": "float32"},
                 data={"sources": [{"path": str(src)}], "chat_template": "chatml-tools"},
                 regenerate={"backend": "hf", "max_tokens": 6, "batch_size": 2})
    backend = HFBackend(cfg.target, cfg.regenerate, cfg.data.chat_template)
    prompts: list[list[int]] = []
    generate = backend.generate
    backend.generate = lambda ps: prompts.extend(ps) or generate(ps)  # type: ignore[method-assign]
    s = run(cfg, load_conversations(cfg.data), backend)
    assert (s.regenerated, s.failed, s.cut_at_different_call) == (4, 0, 3)  # par0, text1, sg2; call3 ended there
    assert len(prompts) == 4
    assert all("<tools>" in backend.tokenizer.decode(p) and "get_weather" in backend.tokenizer.decode(p)
               for p in prompts)
    convs, _ = read_back(cfg.regenerated_path)
    assert all(len([t for t in c.turns if t.role == "assistant"]) == 1 and c.tools for c in convs.values())

    auto = cfg.model_copy(update={"output_dir": str(tmp_path / "auto")}, deep=True)
    auto.data.chat_template = "auto"  # the test tokenizer's own plain ChatML drops tools
    with pytest.raises(TemplateError, match=r"4 of 4 conversations to regenerate use tools.*chatml-tools"):
        run(auto, load_conversations(auto.data), HFBackend(auto.target, auto.regenerate, auto.data.chat_template, backend.model, backend.tokenizer))


class ScriptedModel(torch.nn.Module):
    """Stands in for a target that emits tool calls (a random model never does): `generate` returns the prompt
    followed by the next scripted answer's token ids, so the HF backend's own decode, parse and strip run on it."""

    def __init__(self, answers: list[list[int]], eos: list[int]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = SimpleNamespace(eos_token_id=eos)
        self.answers = deque(answers)
        self.prompts: list[list[int]] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **_):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            self.prompts.append([t for t, m in zip(ids, mask, strict=True) if m])
            rows.append(ids + self.answers.popleft()[:max_new_tokens])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])


def test_hf_backend_parses_kimi_calls_and_prepare_trains_on_exactly_the_generated_tokens(tmp_path, kimi_tok):
    """Kimi-K2.5 with thinking: the model's call (marker special tokens) is parsed out before the special tokens
    are stripped, the recorded result is replayed under the model's call id, and the prepared sample's trained
    tokens are exactly the tokens the model generated. (Its arguments are written as K2.5 writes them, the way its
    served history shows them, `json.dumps` spacing: a call written otherwise trains in that spelling.)"""
    from eagle3.regenerate.hf import HFBackend

    tok_dir = tmp_path / "kimi-tok"
    kimi_tok.save_pretrained(str(tok_dir))
    src = write_jsonl(tmp_path / "k.jsonl", [{"id": "k", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "x", "content": "18C"},
        {"role": "assistant", "content": "18C in Paris."}]}])
    first = "need it</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0" \
            '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    second = "got it</think>It is 18C in Paris.<|im_end|>"
    generated = [kimi_tok(t, add_special_tokens=False)["input_ids"] for t in (first, second)]
    assert generated[0].count(KIMI_SPECIALS["<|tool_call_begin|>"]) == 1
    model = ScriptedModel(generated, eos=[KIMI_SPECIALS["[EOS]"], KIMI_SPECIALS["<|im_end|>"]])
    cfg = Config(output_dir=str(tmp_path / "run"), target={"path": str(tok_dir)},
                 data={"sources": [{"path": str(src)}], "chat_template": "kimi-k2.5", "thinking": True,
                       "eval_size": 0},
                 regenerate={"backend": "hf", "max_tokens": 64, "batch_size": 1, "thinking": True,
                             "keep_reasoning": True}, draft={"vocab_size": 40})
    s = run_with(cfg, HFBackend(cfg.target, cfg.regenerate, cfg.data.chat_template, model, kimi_tok))
    assert (s.regenerated, s.tool_call_answers, s.replayed_results, s.cut_at_different_call) == (1, 1, 1, 0)
    assert kimi_tok.decode(model.prompts[1]).endswith(
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>")
    (rec,) = read_jsonl(cfg.regenerated_path)
    assert rec["messages"][1] == {"role": "assistant", "content": "Checking.", "reasoning_content": "need it",
                                  "tool_calls": [{"id": "functions.get_weather:0", "type": "function", "function": {
                                      "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert render_prompt([Turn("user", "Weather in Paris?")], kimi_tok, "kimi-k2.5", True,
                         tools=[WEATHER]) == model.prompts[0]

    cfg.data.sources = [SourceConfig(path=str(cfg.regenerated_path))]
    prepare.run(cfg)
    (row,) = load_prepared(cfg.prepared_dir).train
    trained = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    assert trained == generated[0] + generated[1]


def run_with(cfg: Config, backend) -> Summary:
    return run(cfg, load_conversations(cfg.data), backend)


def test_hf_malformed_call_is_kept_as_the_text_generated(tmp_path, kimi_tok):
    from eagle3.regenerate.hf import HFBackend

    broken = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" \
             "{city: Paris}<|tool_call_end|><|tool_calls_section_end|>"
    model = ScriptedModel([kimi_tok(broken + "<|im_end|>", add_special_tokens=False)["input_ids"]],
                          eos=[KIMI_SPECIALS["<|im_end|>"]])
    src = write_jsonl(tmp_path / "k.jsonl", [{"id": "k", "tools": [WEATHER],
                                              "messages": [{"role": "user", "content": "Weather?"}]}])
    cfg = Config(output_dir=str(tmp_path / "run"), target={"path": "unused"},
                 data={"sources": [{"path": str(src)}], "chat_template": "kimi-k2.5"}, regenerate={"batch_size": 1})
    s = run_with(cfg, HFBackend(cfg.target, cfg.regenerate, cfg.data.chat_template, model, kimi_tok))
    assert (s.malformed_tool_calls, s.tool_call_answers) == (1, 0)
    assert "1 answers with malformed calls kept as text" in s.line()
    (rec,) = read_jsonl(cfg.regenerated_path)
    assert rec["messages"][1] == {"role": "assistant", "content": broken}


# ------------------------------------------------------------------------------------------------- real vLLM
@contextmanager
def vllm_server(python: str, model: Path, log_path: Path, *flags: str) -> Iterator[str]:
    """A real vLLM OpenAI server for `model` on a free loopback port, up (GET /v1/models answers) within 10
    minutes; yields its root URL and stops it on exit."""
    from eagle3.targets.sglang_server import free_port  # below the ephemeral range: vLLM binds it after loading

    port = free_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
             "--enforce-eager", *flags],
            stdout=log, stderr=subprocess.STDOUT, env={"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ})
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 600
            while True:
                assert server.poll() is None, log_path.read_text()[-3000:]
                try:
                    urllib.request.urlopen(f"{url}/v1/models", timeout=2).read()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "vLLM did not come up in 10 minutes"
                    time.sleep(2)
            yield url
        finally:
            server.terminate()
            server.wait(60)


@pytest.mark.vllm
def test_real_vllm_renders_the_tool_history_as_eagle3_and_regenerates_with_tools(tmp_path):
    """vLLM (served with the chatml-tools template and `--enable-auto-tool-choice --tool-call-parser hermes`) takes
    the client's tool requests: its /tokenize of a request body whose history holds parallel calls and their
    results gives exactly the tokens eagle3 renders for that prompt (arguments written as transformers' `tojson`
    writes them: vLLM, like SGLang, renders history arguments from their parsed object), and regeneration through
    it sends tools and finishes every conversation (a random model answers in text: the records that called are
    cut, counted). About 30 s, most of it the server start."""
    from models import tiny_llama
    from test_vllm_engine import _find_vllm_python

    from eagle3.data.templates import CHATML_TOOLS

    py = _find_vllm_python()
    if py is None:
        pytest.skip("no vLLM: run scripts/setup_vllm_cpu.sh or set EAGLE3_VLLM_PYTHON to a vLLM virtualenv's python")
    target = tiny_llama(tmp_path / "target", vocab=320, hidden=128, heads=4, kv_heads=2, intermediate=256,
                        layers=2)  # head_dim 32: vLLM's CPU attention has no kernel for 16
    tok = llama_test_tokenizer(target, vocab_size=320)
    template = tmp_path / "chatml-tools.jinja"
    template.write_text(CHATML_TOOLS)
    flags = ("--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with vllm_server(py, target, tmp_path / "vllm.log", *flags) as url:
        cfg = Config(output_dir=str(tmp_path / "run"),
                     data={"sources": [{"path": str(write_jsonl(tmp_path / "a.jsonl", good_records(4)))}]},
                     regenerate={"backend": "openai", "endpoints": [f"{url}/v1"], "model": "tiny", "max_tokens": 6,
                                 "timeout_s": 120, "concurrency": 2})
        backend = OpenAIBackend(cfg.regenerate, backoff_s=0.01)
        history = [t.with_(tool_calls=tuple(ToolCall(c.name, json.dumps(json.loads(c.arguments), ensure_ascii=False),
                                                     c.id) for c in t.tool_calls)) for t in PARALLEL.turns[:6]]
        body = backend.body(history, PARALLEL.tools)
        req = urllib.request.Request(f"{url}/tokenize", json.dumps(
            {"model": "tiny", "messages": body["messages"], "tools": body["tools"], "add_generation_prompt": True}
        ).encode(), {"Content-Type": "application/json"})
        served = json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens"]
        assert served == render_prompt(history, tok, "chatml-tools", False, tools=PARALLEL.tools)

        s = run(cfg, load_conversations(cfg.data), backend)
        assert (s.regenerated, s.failed) == (4, 0) and s.tokens > 0
        assert s.cut_at_different_call == 3  # par0, text1 and sg2 called where the random model writes text
        out = {r["id"]: r for r in read_jsonl(cfg.regenerated_path)}  # (a random model's answer may be empty)
        assert {k: (r["tools"], r["messages"][-1]["role"]) for k, r in out.items()} == {
            c.id: (c.tools, "assistant") for c in load_conversations(cfg.data)}
