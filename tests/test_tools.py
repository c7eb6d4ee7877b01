"""Tool use from the data file to the loss mask: reading every spelling, the built-in templates' exact strings and
token ids, the masked tool-call section, the refusal of a template that drops tools, and `eagle3 data show`."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from agentic_data import BAD_REASONS, WEATHER, write_agentic
from tokenizer_builders import KIMI_SPECIALS, kimi_test_tokenizer, llama_test_tokenizer

from eagle3 import prepare
from eagle3.config import SourceConfig, load_config
from eagle3.data.prepared import load_prepared
from eagle3.data.sources import SourceStats, read_conversations
from eagle3.data.templates import (
    TemplateError,
    answer_spans,
    render,
    render_prompt,
    renders_tools,
    resolve_template,
)
from eagle3.data.types import Conversation, ToolCall, Turn


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    return kimi_test_tokenizer(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def chatml_tok(tmp_path_factory):
    return llama_test_tokenizer(tmp_path_factory.mktemp("chatml"), vocab_size=320)


def _read(path: Path) -> tuple[dict[str, Conversation], SourceStats]:
    stats = SourceStats("x")
    return {c.id: c for c in read_conversations(SourceConfig(path=str(path)), stats)}, stats


# ----------------------------------------------------------------------------------------------- reading
def test_every_spelling_is_read_linked_and_bad_records_are_counted_by_reason(tmp_path):
    convs, stats = _read(write_agentic(tmp_path / "a.jsonl", n=4))
    assert sorted(convs) == ["call3", "par0", "sg2", "text1"]
    assert stats.skipped == BAD_REASONS

    par = convs["par0"]
    assert par.tools == [WEATHER]
    assert [t.role for t in par.turns] == ["user", "assistant", "tool", "tool", "assistant"]
    calls = par.turns[1].tool_calls
    assert calls == (ToolCall("get_weather", '{"city": "City0"}', "c0a"), ToolCall("get_weather", '{"city": "Town0"}', "c0b"))
    assert par.turns[1].content == ""  # content null
    assert (par.turns[2].tool_call_id, par.turns[3].tool_call_id) == ("c0a", "c0b")
    assert par.turns[3].content == '{"temp": 1}'  # a JSON result kept as its JSON text

    text = convs["text1"]
    assert text.tools[1] == {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                                              "parameters": {"type": "object", "properties": {
                                                                  "q": {"type": "string"}}}}}  # a bare one wrapped
    call_turn = text.turns[2]
    assert (call_turn.content, call_turn.reasoning) == ("Let me look that up.", "Need the forecast.")
    assert text.turns[3].name == "search" and text.turns[3].tool_call_id == "x"  # the name taken from its call

    sg = convs["sg2"]
    assert sg.tools == [WEATHER]  # from a JSON string
    assert [t.role for t in sg.turns] == ["user", "assistant", "tool", "assistant"]
    assert sg.turns[1].content == "Checking." and sg.turns[1].tool_calls[0].name == "get_weather"
    assert sg.turns[2].tool_call_id == sg.turns[1].tool_calls[0].id == "call_0"  # generated, and linked by order
    assert stats.repaired["same_role_merged"] == 1 and stats.repaired["tool_call_id_generated"] == 1

    assert [t.role for t in convs["call3"].turns] == ["user", "assistant"]  # an answer that is only a call


def test_trailing_results_are_dropped_for_training_and_kept_for_generation(tmp_path):
    rec = {"id": "t", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "r"}]}
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(rec) + "\n")
    (conv,) = read_conversations(SourceConfig(path=str(p)))
    assert [t.role for t in conv.turns] == ["user", "assistant"]
    (prompt,) = read_conversations(SourceConfig(path=str(p)), for_generation=True)
    assert [t.role for t in prompt.turns] == ["user", "assistant", "tool"]


# ----------------------------------------------------------------------------------------- Kimi template
KIMI_CONV = Conversation("k", [
    Turn("system", "Be brief."),
    Turn("user", "Weather in Paris and Rome?"),
    Turn("assistant", "Checking.", reasoning="two cities", tool_calls=(
        ToolCall("get_weather", '{"city": "Paris"}', "call_a"), ToolCall("get_weather", '{"city":"Rome"}', "call_b"))),
    Turn("tool", "18C", tool_call_id="call_a", name="get_weather"),
    Turn("tool", "21C", tool_call_id="call_b"),
    Turn("assistant", "Paris 18C, Rome 21C.", reasoning="done"),
], tools=[WEATHER])

# K2.5 declares tools as the TypeScript namespace its tokenizer writes (eagle3.data.kimi_tools), not as JSON.
DECLARE = ("<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
           "// Current weather of a city.\ntype get_weather = (_: {\n  city: string\n}) => any;\n}\n<|im_end|>")
# Arguments as SGLang and vLLM render them: parsed, then `tojson` (the source's '{"city":"Rome"}' gains its spaces).
SECTION = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
           '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>'
           '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>')
RESULTS = ('<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>'
           '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\n21C<|im_end|>')


def _kimi_ids(text: str) -> list[int]:
    """Token ids as Kimi's tokenizer gives them: each special token its id, text its bytes (the test tokenizer)."""
    pattern = "(" + "|".join(re.escape(s) for s in sorted(KIMI_SPECIALS, key=len, reverse=True)) + ")"
    ids: list[int] = []
    for part in re.split(pattern, text):
        ids += [KIMI_SPECIALS[part]] if part in KIMI_SPECIALS else list(part.encode())
    return ids


@pytest.mark.parametrize("thinking", [False, True])
def test_kimi_renders_tools_exactly_as_kimis_template(kimi_tok, thinking):
    text, spans = answer_spans(KIMI_CONV, kimi_tok, "kimi-k2.5", thinking)
    think_call, think_end = ("two cities", "done") if thinking else ("", "")
    expected = (DECLARE + "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                "<|im_user|>user<|im_middle|>Weather in Paris and Rome?<|im_end|>"
                f"<|im_assistant|>assistant<|im_middle|><think>{think_call}</think>Checking.{SECTION}<|im_end|>"
                + RESULTS +
                f"<|im_assistant|>assistant<|im_middle|><think>{think_end}</think>Paris 18C, Rome 21C.<|im_end|>")
    assert text == expected
    # the loss covers what the model generates: the text, the whole call section and the end token; with thinking
    # the prompt ends with <think> (so the reasoning and </think> are generated), without it with <think></think>
    lead = "two cities</think>" if thinking else ""
    assert [text[a:b] for a, b in spans] == [f"{lead}Checking.{SECTION}<|im_end|>",
                                             ("done</think>" if thinking else "") + "Paris 18C, Rome 21C.<|im_end|>"]
    ids, mask = render(KIMI_CONV, kimi_tok, "kimi-k2.5", thinking)
    assert ids == _kimi_ids(expected)
    for marker in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                   "<|tool_call_end|>", "<|tool_calls_section_end|>"):
        positions = [i for i, t in enumerate(ids) if t == KIMI_SPECIALS[marker]]
        assert positions and all(mask[i] == 1 for i in positions), marker
    assert ids.count(163595) == 1 and ids.count(163597) == 2  # section begin, two calls
    # declarations and results are prompt: no token of them is trained
    declare, results = _kimi_ids(DECLARE), _kimi_ids(RESULTS)
    start = _find(ids, results)
    assert not any(mask[: len(declare)]) and not any(mask[start:start + len(results)])


def _find(seq: list[int], sub: list[int]) -> int:
    return next(i for i in range(len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub)


def test_kimi_generation_prompt_after_a_result_continues_the_loop(kimi_tok):
    ids = render_prompt(KIMI_CONV.turns[:5], kimi_tok, "kimi-k2.5", False, tools=KIMI_CONV.tools)
    text = kimi_tok.decode(ids, skip_special_tokens=False)
    assert text.startswith(DECLARE) and text.endswith(RESULTS + "<|im_assistant|>assistant<|im_middle|><think></think>")


# ------------------------------------------------------------------------------------------- chatml-tools
def test_chatml_tools_renders_the_hermes_convention(chatml_tok):
    text, spans = answer_spans(KIMI_CONV, chatml_tok, "chatml-tools", False)
    declared = json.dumps(WEATHER)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions")
    assert f"<tools>\n{declared}\n</tools>" in text
    call = ('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Rome"}}\n</tool_call><|im_end|>\n')
    results = "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
    assert call + results + "<|im_start|>assistant\nParis 18C, Rome 21C.<|im_end|>\n" in text
    assert [text[a:b] for a, b in spans] == [call.removeprefix("<|im_start|>assistant\n").removesuffix("\n"),
                                             "Paris 18C, Rome 21C.<|im_end|>"]


def test_chatml_tools_without_tools_is_plain_chatml(chatml_tok):
    conv = Conversation("p", [Turn("system", "S"), Turn("user", "hi"), Turn("assistant", "yo"), Turn("user", "ok?"),
                              Turn("assistant", "yes")])
    assert answer_spans(conv, chatml_tok, "chatml-tools", False) == answer_spans(conv, chatml_tok, "chatml", False)
    a, b = render_prompt(conv.turns[:2], chatml_tok, "chatml-tools", False), render_prompt(conv.turns[:2], chatml_tok,
                                                                                             "chatml", False)
    assert a == b


def test_which_templates_render_tools(chatml_tok, kimi_tok):
    assert renders_tools(kimi_tok, resolve_template("kimi-k2.5", kimi_tok))
    assert renders_tools(chatml_tok, resolve_template("chatml-tools", chatml_tok))
    for name in ("chatml", "llama3", "deepseek-v3"):
        assert not renders_tools(chatml_tok, resolve_template(name, chatml_tok)), name
    assert not renders_tools(chatml_tok, resolve_template("auto", chatml_tok))  # the test tokenizer's own ChatML


# ------------------------------------------------------------------------------------------------ prepare
def _cfg(tmp_path: Path, tok_dir: Path, template: str, *extra: str):
    data = write_agentic(tmp_path / "agentic.jsonl", n=12)
    return load_config(None, [f"output_dir={tmp_path / 'run'}", f"target.path={tok_dir}",
                              f"data.sources=[{{path: {data}}}]", "data.max_length=2048", "data.eval_size=2",
                              "draft.vocab_size=40", f"data.chat_template={template}", *extra])


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    llama_test_tokenizer(d, vocab_size=320)
    return d


def test_a_template_that_drops_tools_is_refused_by_name(tmp_path, chatml_dir):
    with pytest.raises(TemplateError) as e:
        prepare.run(_cfg(tmp_path, chatml_dir, "auto"))
    msg = str(e.value)
    assert "12 of 12 conversations use tools" in msg and "data.chat_template='auto'" in msg
    assert "kimi-k2.5" in msg and "chatml-tools" in msg


def test_prepare_trains_on_tool_calls_and_data_show_marks_them(tmp_path, chatml_dir, capsys):
    from eagle3.cli import main

    cfg = _cfg(tmp_path, chatml_dir, "chatml-tools")
    summary = prepare.run(cfg)
    assert summary["sources"][0]["skipped"] == BAD_REASONS
    assert summary["render"]["tool_conversations"] == 12
    p = load_prepared(cfg.prepared_dir)
    row = next(r for r in p.train if r["id"] == "par4")
    assert (row["source"], row["record"]) == ("agentic", 4)
    tok = llama_test_tokenizer(tmp_path / "t2", vocab_size=320)
    masked = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    assert masked.count("<tool_call>") == 2 and masked.count("</tool_call>") == 2 and '"city": "Town4"' in masked
    assert "tool_response" not in masked and "# Tools" not in masked  # results and declarations stay prompt

    capsys.readouterr()
    overrides = [f"output_dir={tmp_path / 'run'}", f"target.path={chatml_dir}",
                 f"data.sources=[{{path: {tmp_path / 'agentic.jsonl'}}}]", "data.chat_template=chatml-tools",
                 "data.max_length=2048", "data.eval_size=2", "draft.vocab_size=40"]
    assert main(["data", "show", "--config", str(_yaml(tmp_path)), "--id", "par4", "--color", "never", *overrides]) == 0
    out = capsys.readouterr().out
    body = out.split("-" * 100)[1]
    trained = re.findall(r"\[\[(.*?)\]\]", body, flags=re.S)
    assert trained[0].startswith("<tool_call>\n{\"name\": \"get_weather\"") and trained[0].endswith("<|im_end|>")
    assert trained[1] == "City4: 4 C and sunny; Town4: 5 C.<|im_end|>"
    n_train = sum(row["loss_mask"])
    assert f"tokens: {len(row['input_ids'])} = {n_train} trained (loss_mask 1, in 2 spans) + " \
           f"{len(row['input_ids']) - n_train} prompt" in out
    assert f"source: {tmp_path / 'agentic.jsonl'}, record 4" in out and '"tool_call_id": "c4a"' in out


def _yaml(tmp_path: Path) -> Path:
    p = tmp_path / "empty.yaml"
    p.write_text("{}\n")
    return p


def test_every_masked_stretch_of_a_tool_sample_ends_with_the_end_token(tmp_path, chatml_dir):
    cfg = _cfg(tmp_path, chatml_dir, "chatml-tools")
    prepare.run(cfg)
    p = load_prepared(cfg.prepared_dir)
    tok = llama_test_tokenizer(tmp_path / "t3", vocab_size=320)
    ends = Counter()
    for row in p.train:
        ids, mask = row["input_ids"], row["loss_mask"]
        runs, cur = [], []
        for t, m in zip(ids, mask, strict=True):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        for r in runs:
            ends[tok.decode(r).endswith("<|im_end|>")] += 1
    assert ends[True] > 0 and ends[False] == 0
