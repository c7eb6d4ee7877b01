"""Kimi-K2.5's prompt byte for byte (issue 59): the tools declared as the TypeScript namespace K2.5's tokenizer
writes, call ids numbered as SGLang and vLLM number them, reasoning kept and dropped by K2.5's own rule.

Two kinds of check. Goldens: exact strings written from the format (eagle3.data.kimi_tools' docstring), turned into
the test tokenizer's ids with their loss masks. And the served prompt: for every assistant turn, what a client
sends SGLang (server-issued ids, parsed arguments, every turn's reasoning) rendered by K2.5's real chat template
(tests/kimi_k25_chat_template.jinja) must be the training sample's prefix for that turn, thinking on and off, the
HF backend's generation prompt, and what `eagle3 regenerate` asks a server for.

    pytest -q tests/test_kimi_template.py      # a few seconds
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from agentic_data import write_agentic
from tokenizer_builders import KIMI_SPECIALS, kimi_test_tokenizer

from eagle3.data.kimi_tools import deep_sorted, typescript_declaration
from eagle3.data.templates import TemplateError, answer_spans, chat_messages, render, render_prompt, resolve_template
from eagle3.data.types import Conversation, ToolCall, Turn

REAL_TEMPLATE = (Path(__file__).parent / "kimi_k25_chat_template.jinja").read_text()
"""K2.5's own chat_template.jinja (source and licence in the file's first comment)."""


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    return kimi_test_tokenizer(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def real_tok(tmp_path_factory):
    """The test tokenizer carrying K2.5's real template as its own (what `data.chat_template: auto` reads)."""
    tok = kimi_test_tokenizer(tmp_path_factory.mktemp("kimi-real"))
    tok.chat_template = REAL_TEMPLATE
    return tok


def kimi_ids(text: str) -> list[int]:
    """Ids as the test tokenizer gives them: a special token its id, any other text its UTF-8 bytes."""
    pattern = "(" + "|".join(re.escape(s) for s in sorted(KIMI_SPECIALS, key=len, reverse=True)) + ")"
    return [i for part in re.split(pattern, text) if part
            for i in ([KIMI_SPECIALS[part]] if part in KIMI_SPECIALS else list(part.encode()))]


def golden(*parts: tuple[str, int]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a render written as (text, trained) pieces."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in parts:
        piece = kimi_ids(text)
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


# ------------------------------------------------------------------------------------ the TypeScript declaration
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
# Each JSON Schema feature OpenAI tools carry: nested objects, arrays (of scalars, of objects, with an item comment),
# enums, descriptions (several lines, a blank one), required vs optional, defaults, constraints, anyOf, a type list,
# additionalProperties, an empty schema; keys in no particular order (the tokenizer sorts them).
TRIP = {"type": "function", "function": {"name": "book_trip", "description": "Book a trip.", "parameters": {
    "type": "object", "required": ["travellers", "route"], "properties": {
        "route": {"type": "object", "description": "Where from and to.", "required": ["to", "from"], "properties": {
            "from": {"type": "string", "minLength": 3, "maxLength": 3, "description": "IATA code."},
            "to": {"type": "string"}, "via": {"type": "array", "items": {"type": "string"}}}},
        "travellers": {"type": "integer", "minimum": 1, "maximum": 9},
        "class": {"type": "string", "enum": ["economy", "business"], "default": "economy"},
        "flexible": {"type": "boolean", "default": False},
        "budget": {"type": ["number", "null"], "description": "Most to spend.\n\nIn euros."},
        "legs": {"type": "array", "minItems": 1, "items": {
            "type": "object", "properties": {"date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}},
            "required": ["date"]}},
        "seats": {"type": "array", "items": {"type": "string", "description": "A seat like 12A."}},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "extras": {"type": "object", "additionalProperties": {"type": "integer"}},
        "tags": {"type": "array", "default": ["a", "b"]},
        "priority": {"enum": [1, 2, 3], "type": "integer", "default": 2},
        "meta": {}}}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no description, no parameters

WEATHER_TS = ('// Current weather for a city.\ntype get_weather = (_: {\n  city: string,\n  unit?: "c" | "f"\n'
              '}) => any;')
SEARCH_TS = "// Search the web.\ntype search = (_: {\n  q: string\n}) => any;"
TRIP_TS = """// Book a trip.
type book_trip = (_: {
  // Where from and to.
  route: {
    // IATA code.
    // maxLength: 3, minLength: 3
    from: string,
    to: string,
    via?: Array<string>
  },
  // maximum: 9, minimum: 1
  travellers: number,
  // Most to spend.

  // In euros.
  budget?: number | null,
  // Default: "economy"
  class?: "economy" | "business",
  extras?: {
    [k: string]: number
  },
  // Default: False
  flexible?: boolean,
  // minItems: 1
  legs?: Array<{
    // pattern: ^\\d{4}-\\d{2}-\\d{2}$
    date: string
  }>,
  meta?: any,
  notes?: string | null,
  // Default: 2
  priority?: 1 | 2 | 3,
  seats?: Array<
    // A seat like 12A.
    string
  >,
  // Default: ["a", "b"]
  tags?: Array<any>
}) => any;"""


def namespace(*functions: str) -> str:
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


def test_the_issues_declaration_byte_for_byte():
    assert typescript_declaration([WEATHER]) == namespace(WEATHER_TS) == (
        "# Tools\n\n## functions\nnamespace functions {\n// Current weather for a city.\ntype get_weather = (_: {\n"
        '  city: string,\n  unit?: "c" | "f"\n}) => any;\n}\n')


def test_every_json_schema_feature_in_the_declaration():
    assert typescript_declaration([TRIP, PING, SEARCH]) == namespace(TRIP_TS, "type ping = (_: {}) => any;",
                                                                     SEARCH_TS)


def test_definitions_become_interfaces():
    draw = {"type": "function", "function": {"name": "draw", "parameters": {
        "type": "object", "required": ["at"], "$defs": {
            "Point": {"type": "object", "description": "A point.", "required": ["x", "y"],
                      "properties": {"x": {"type": "number"}, "y": {"type": "number"}}},
            "Color": {"enum": ["red", "blue"]}},
        "properties": {"at": {"$ref": "#/$defs/Point"}, "color": {"$ref": "#/$defs/Color"},
                       "scale": {"type": "number", "default": 1.0}}}}}
    assert typescript_declaration([draw]) == namespace(
        'interface Color "red" | "blue"\n// A point.\ninterface Point {\n  x: number,\n  y: number\n}\n'
        "type draw = (_: {\n  at: Point,\n  color?: Color,\n  // Default: 1.0\n  scale?: number\n}) => any;")


def test_key_order_does_not_change_the_declaration():
    shuffled = json.loads(json.dumps(TRIP, sort_keys=True))
    shuffled["function"]["parameters"]["properties"] = dict(reversed(
        list(shuffled["function"]["parameters"]["properties"].items())))
    assert typescript_declaration([shuffled]) == typescript_declaration([TRIP])


def fn(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def test_a_self_reference_in_the_parameters_names_them_an_interface():
    tool = fn({"type": "object", "required": ["v"], "properties": {
        "v": {"type": "string"}, "next": {"$ref": "#"}}})
    assert typescript_declaration([tool]) == namespace(
        "interface parameters {\n  next?: parameters,\n  v: string\n}\ntype f = (_: parameters) => any;")


def test_a_self_reference_inside_definitions_is_printed_but_never_declared():
    """The encoder decides `interface parameters` from the parameters alone, before it writes `$defs`: a `$ref: "#"`
    met only in a definition prints `parameters` there, declares nothing and leaves the signature inline."""
    tool = fn({"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}},
               "$defs": {"N": {"type": "object", "properties": {"p": {"$ref": "#"}}}}})
    assert typescript_declaration([tool]) == namespace(
        "interface N {\n  p?: parameters\n}\ntype f = (_: {\n  n?: N\n}) => any;")


@pytest.mark.parametrize(("kind", "shown"), [(None, "None"), (5, "5"), ({"a": 1}, "{'a': 1}"), (True, "True"),
                                             ("date", "date")])
def test_a_type_that_is_not_a_string_is_printed_with_str(kind, shown):
    """The encoder makes any `type` but a list, `object` or `array` a scalar named by the value itself, and an
    f-string prints it: a field, an uncommented array item, `additionalProperties`, a definition."""
    tool = fn({"type": "object", "$defs": {"D": {"type": kind}}, "properties": {
        "x": {"type": kind}, "xs": {"type": "array", "items": {"type": kind}},
        "m": {"type": "object", "additionalProperties": {"type": kind}}, "d": {"$ref": "#/$defs/D"}}})
    assert typescript_declaration([tool]) == namespace(
        f"interface D {shown}\ntype f = (_: {{\n  d?: D,\n  m?: {{\n    [k: string]: {shown}\n  }},\n"
        f"  x?: {shown},\n  xs?: Array<{shown}>\n}}) => any;")


@pytest.mark.parametrize("where", [
    {"anyOf": [{"type": "string"}, {"type": None}]},                          # " | ".join meets None
    {"type": "array", "items": {"type": 5, "description": "an item"}},         # "Array<\n" + ... + 5
])
def test_a_type_that_is_not_a_string_where_the_encoder_joins_text_leaves_json(where):
    """Where the encoder joins or concatenates the type's text instead of formatting it, the value raises
    (TypeError) and K2.5 declares the tools as JSON."""
    assert typescript_declaration([fn({"type": "object", "properties": {"x": where}})]) is None


def test_the_encoders_helpers_say_what_they_promise():
    """Each helper of the encoder states its contract in one docstring line (the review of issue 59 found none)."""
    from eagle3.data import kimi_tools

    for name in ("_base", "_object", "_ref", "_write", "_write_object", "_write_field", "_comment"):
        doc = getattr(kimi_tools, name).__doc__
        assert doc and doc.strip() and "\n" not in doc.strip(), name


def test_the_self_referring_parameters_own_additional_properties_are_never_written():
    """The encoder writes `interface parameters` from the fields alone: a value it would raise on when written
    (`additionalProperties: 5`) raises nothing there."""
    tool = fn({"type": "object", "additionalProperties": 5, "properties": {"x": {"$ref": "#"}}})
    assert typescript_declaration([tool]) == namespace(
        "interface parameters {\n  x?: parameters\n}\ntype f = (_: parameters) => any;")
    assert typescript_declaration([fn({"type": "object", "additionalProperties": 5})]) is None


@pytest.mark.parametrize("bad", [
    {"oneOf": [{"type": "string"}]},                    # a keyword the encoder does not know
    {"type": "string", "enum": ["a", 1]},               # an enum value of another type
    {"$ref": "#/$defs/Nowhere"},                        # a reference to no definition
    {"type": "object", "$defs": [["D", {"type": "string"}]], "properties": {"y": {"$ref": "#/$defs/D"}}},  # no map
])
def test_a_schema_the_encoder_refuses_leaves_k25s_json_fallback_as_sglang_serves_it(kimi_tok, bad):
    tool = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": bad}}}}
    assert typescript_declaration([WEATHER, tool]) is None
    conv = Conversation("f", [Turn("user", "q"), Turn("assistant", "a")], tools=[WEATHER, tool])
    text, _ = answer_spans(conv, kimi_tok, "kimi-k2.5", False)
    # K2.5's template then prints, as compact JSON, the tools SGLang handed it (its request model's dump: nulls
    # added) after K2.5's tokenizer sorted their keys, for every tool
    declared = json.dumps(deep_sorted(sglang_tools([WEATHER, tool])), separators=(",", ":"), ensure_ascii=False)
    assert declared.startswith('[{"defer_loading":null,"function":{"description":"Current weather for a city.",')
    assert ',{"defer_loading":null,"function":{"description":null,"name":"odd","parameters":{' in declared
    assert text.startswith(f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|><|im_user|>")
    assert text.startswith(sglang_render([{"role": "user", "content": "q"}], [WEATHER, tool], False, kimi_tok))


PLUGIN = {"type": "_plugin", "function": {"name": "browse"}}
"""Not a function tool: the encoder skips it, so alone it leaves the template to its JSON."""
UNTYPED = {"function": WEATHER["function"]}
"""No `type`: SGLang's request model makes it "function", so the encoder declares it."""
ODD = {"type": "function", "function": {"name": "odd", "strict": True, "parameters": {
    "type": "object", "properties": {"x": {"oneOf": [{"type": "string"}]}}}}}


@pytest.mark.parametrize("tools", [[PLUGIN], [PLUGIN, WEATHER], [UNTYPED], [PING], [TRIP, ODD]],
                         ids=["plugin", "plugin+weather", "untyped", "ping", "fallback-strict"])
@pytest.mark.parametrize("thinking", [False, True])
def test_the_declaration_is_the_one_sglang_serves(kimi_tok, tools, thinking):
    served = sglang_render([{"role": "user", "content": "q"}], tools, thinking, kimi_tok)
    assert render_prompt([Turn("user", "q")], kimi_tok, "kimi-k2.5", thinking, tools=tools) == kimi_tok(
        served, add_special_tokens=False)["input_ids"]


def test_a_result_with_no_id_and_no_call_to_answer_renders_sglangs_empty_id(kimi_tok):
    """SGLang drops a message's null fields, so K2.5's template finds no `tool_call_id` and prints nothing. The
    message must not carry the null either: transformers 5.25 drops it too, but 5.19 (SGLang 0.5.23's) prints
    `## Return of None`."""
    turns = [Turn("user", "q"), Turn("assistant", "a"), Turn("tool", "r", name="log")]
    assert chat_messages(turns, False, resolve_template("kimi-k2.5", kimi_tok))[2] == {
        "role": "tool", "content": "r", "name": "log"}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "tool", "content": "r", "tool_call_id": None, "name": "log"}]
    served = sglang_render(messages, TOOLS, False, kimi_tok)
    assert "<|im_system|>log<|im_middle|>## Return of \nr<|im_end|>" in served
    assert render_prompt(turns, kimi_tok, "kimi-k2.5", False, tools=TOOLS) == kimi_tok(
        served, add_special_tokens=False)["input_ids"]


def test_the_tools_are_declared_once_per_conversation(kimi_tok, monkeypatch):
    """`answer_spans` renders about two prompts per assistant turn; the tools are sorted and encoded once."""
    import eagle3.data.templates as templates

    expected = render(REUSED, kimi_tok, "kimi-k2.5", True)
    seen: list[str] = []
    for name in ("typescript_declaration", "deep_sorted"):
        real = getattr(templates, name)
        monkeypatch.setattr(templates, name, lambda x, _real=real, _name=name: seen.append(_name) or _real(x))
    assert render(REUSED, kimi_tok, "kimi-k2.5", True) == expected
    assert sorted(seen) == ["deep_sorted", "typescript_declaration"]


def test_declaration_tokens_and_mask(kimi_tok):
    conv = Conversation("d", [Turn("user", "Trip?"), Turn("assistant", "Sure.")], tools=[TRIP, PING])
    ids, mask = render(conv, kimi_tok, "kimi-k2.5", False)
    assert (ids, mask) == golden(
        ("<|im_system|>tool_declare<|im_middle|>" + namespace(TRIP_TS, "type ping = (_: {}) => any;")
         + "<|im_end|><|im_user|>user<|im_middle|>Trip?<|im_end|><|im_assistant|>assistant<|im_middle|>"
           "<think></think>", 0),
        ("Sure.<|im_end|>", 1))
    assert ids[:3] == [163594, *b"to"] and ids.count(163586) == 3


# ---------------------------------------------------------------------------------- conversations and goldens
def call(name: str, args: dict, cid: str | None) -> ToolCall:
    return ToolCall(name, json.dumps(args, separators=(",", ":")), cid)  # compact: servers re-render it spaced


TOOLS = [WEATHER, SEARCH]
DECLARE = "<|im_system|>tool_declare<|im_middle|>" + namespace(WEATHER_TS, SEARCH_TS) + "<|im_end|>"
HEAD_OFF = "<|im_assistant|>assistant<|im_middle|><think></think>"
HEAD_ON = "<|im_assistant|>assistant<|im_middle|><think>"


def user(text: str) -> str:
    return f"<|im_user|>user<|im_middle|>{text}<|im_end|>"


def calls(*items: tuple[str, str]) -> str:
    body = "".join(f"<|tool_call_begin|>{cid}<|tool_call_argument_begin|>{args}<|tool_call_end|>" for cid, args in items)
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def result(name: str, cid: str, text: str) -> str:
    return f"<|im_system|>{name}<|im_middle|>## Return of {cid}\n{text}<|im_end|>"


PARALLEL = Conversation("parallel", [
    Turn("user", "Paris and Rome?"),
    Turn("assistant", "Checking.", reasoning="two cities", tool_calls=(
        call("get_weather", {"city": "Paris"}, "call_a"), call("get_weather", {"city": "Rome", "unit": "c"}, "call_b"))),
    Turn("tool", "18C", tool_call_id="call_a", name="get_weather"),
    Turn("tool", "21C", tool_call_id="call_b", name="get_weather"),
    Turn("assistant", "Paris 18C, Rome 21C.", reasoning="done"),
], tools=TOOLS)

# Three call turns whose source numbered its ids per turn: "call_0" is reused by every turn.
REUSED = Conversation("reused", [
    Turn("user", "Plan my day."),
    Turn("assistant", "", reasoning="r1", tool_calls=(
        call("get_weather", {"city": "Oslo"}, "call_0"), call("search", {"q": "museums"}, "call_1"))),
    Turn("tool", "rain", tool_call_id="call_0", name="get_weather"),
    Turn("tool", "3 museums", tool_call_id="call_1", name="search"),
    Turn("assistant", "", reasoning="r2", tool_calls=(call("search", {"q": "cafes"}, "call_0"),)),
    Turn("tool", "2 cafes", tool_call_id="call_0", name="search"),
    Turn("assistant", "", reasoning="r3", tool_calls=(call("get_weather", {"city": "Bergen"}, "call_0"),)),
    Turn("tool", "sun", tool_call_id="call_0", name="get_weather"),
    Turn("assistant", "Museums in Oslo, then Bergen.", reasoning="r4"),
], tools=TOOLS)

# A user speaks between calls with no answer in between: K2.5 keeps the earlier call's reasoning.
USER_AFTER_CALLS = Conversation("interject", [
    Turn("user", "Book a table."),
    Turn("assistant", "", reasoning="need a place", tool_calls=(call("search", {"q": "tables"}, "s1"),)),
    Turn("tool", "3 places", tool_call_id="s1", name="search"),
    Turn("user", "Only vegan ones."),
    Turn("assistant", "", reasoning="filter vegan", tool_calls=(call("search", {"q": "vegan tables"}, "s2"),)),
    Turn("tool", "1 place", tool_call_id="s2", name="search"),
    Turn("assistant", "Green Fork has one.", reasoning="answer"),
], tools=TOOLS)

# Two agent loops: the first loop's reasoning is history for the second.
TWO_LOOPS = Conversation("loops", [
    Turn("user", "Weather in Oslo?"),
    Turn("assistant", "", reasoning="look it up", tool_calls=(call("get_weather", {"city": "Oslo"}, "w"),)),
    Turn("tool", "rain", tool_call_id="w", name="get_weather"),
    Turn("assistant", "", reasoning="in celsius", tool_calls=(call("get_weather", {"city": "Oslo", "unit": "c"}, "w2"),)),
    Turn("tool", "4C", tool_call_id="w2", name="get_weather"),
    Turn("assistant", "Rain, 4C.", reasoning="report"),
    Turn("user", "And Bergen?"),
    Turn("assistant", "", reasoning="same again", tool_calls=(call("get_weather", {"city": "Bergen"}, "w"),)),
    Turn("tool", "sun", tool_call_id="w", name="get_weather"),
    Turn("assistant", "Sunny.", reasoning="report 2"),
], tools=TOOLS)

CONVERSATIONS = {c.id: c for c in (PARALLEL, REUSED, USER_AFTER_CALLS, TWO_LOOPS)}


@pytest.mark.parametrize("thinking", [False, True])
def test_parallel_calls_golden(kimi_tok, thinking):
    head = HEAD_ON if thinking else HEAD_OFF
    first, last = ("two cities</think>", "done</think>") if thinking else ("", "")
    expected = golden(
        (DECLARE + user("Paris and Rome?") + head, 0),
        (first + "Checking." + calls(("functions.get_weather:0", '{"city": "Paris"}'),
                                     ("functions.get_weather:1", '{"city": "Rome", "unit": "c"}')) + "<|im_end|>", 1),
        (result("get_weather", "functions.get_weather:0", "18C") + result("get_weather", "functions.get_weather:1",
                                                                           "21C") + head, 0),
        (last + "Paris 18C, Rome 21C.<|im_end|>", 1))
    assert render(PARALLEL, kimi_tok, "kimi-k2.5", thinking) == expected


@pytest.mark.parametrize("thinking", [False, True])
def test_reused_ids_count_up_across_three_call_turns(kimi_tok, thinking):
    head = HEAD_ON if thinking else HEAD_OFF

    def think(r: str) -> str:
        return f"{r}</think>" if thinking else ""

    expected = golden(
        (DECLARE + user("Plan my day.") + head, 0),
        (think("r1") + calls(("functions.get_weather:0", '{"city": "Oslo"}'), ("functions.search:1", '{"q": "museums"}'))
         + "<|im_end|>", 1),
        (result("get_weather", "functions.get_weather:0", "rain") + result("search", "functions.search:1", "3 museums")
         + head, 0),
        (think("r2") + calls(("functions.search:2", '{"q": "cafes"}')) + "<|im_end|>", 1),
        (result("search", "functions.search:2", "2 cafes") + head, 0),
        (think("r3") + calls(("functions.get_weather:3", '{"city": "Bergen"}')) + "<|im_end|>", 1),
        (result("get_weather", "functions.get_weather:3", "sun") + head, 0),
        (think("r4") + "Museums in Oslo, then Bergen.<|im_end|>", 1))
    assert render(REUSED, kimi_tok, "kimi-k2.5", thinking) == expected


def test_missing_ids_are_numbered_and_results_follow_their_call_in_order(kimi_tok):
    conv = Conversation("m", [
        Turn("user", "q"),
        Turn("assistant", "", tool_calls=(call("search", {"q": "a"}, None), call("search", {"q": "b"}, None))),
        Turn("tool", "A", name="search"), Turn("tool", "B", name="search"),
        Turn("assistant", "", tool_calls=(call("search", {"q": "c"}, None),)),
        Turn("tool", "C", name="search"),
        Turn("assistant", "done")], tools=TOOLS)
    text, _ = answer_spans(conv, kimi_tok, "kimi-k2.5", False)
    assert re.findall(r"<\|tool_call_begin\|>(.*?)<", text) == ["functions.search:0", "functions.search:1",
                                                               "functions.search:2"]
    assert re.findall(r"Return of (\S+)\n(\w)", text) == [("functions.search:0", "A"), ("functions.search:1", "B"),
                                                          ("functions.search:2", "C")]


def test_ids_read_from_a_source_file_whatever_it_carried(tmp_path, kimi_tok):
    """Per-turn ids reused by later turns, and calls with no id whose results name none: read by prepare's reader
    (which links each result to its call), rendered with the servers' ids."""
    from eagle3.config import SourceConfig
    from eagle3.data.sources import read_conversations

    def turn_calls(*calls_: tuple[str | None, str]) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": [
            {**({"id": cid} if cid else {}), "type": "function", "function": {"name": "search", "arguments": q}}
            for cid, q in calls_]}

    def res(cid: str | None, text: str) -> dict:
        return {"role": "tool", "content": text, **({"tool_call_id": cid} if cid else {})}

    records = [
        {"id": "per-turn", "tools": TOOLS, "messages": [
            {"role": "user", "content": "q"}, turn_calls(("0", '{"q": "a"}'), ("1", '{"q": "b"}')),
            res("1", "B"), res("0", "A"), turn_calls(("0", '{"q": "c"}')), res("0", "C"),
            turn_calls(("0", '{"q": "d"}')), res("0", "D"), {"role": "assistant", "content": "done"}]},
        {"id": "no-ids", "tools": TOOLS, "messages": [
            {"role": "user", "content": "q"}, turn_calls((None, '{"q": "a"}'), (None, '{"q": "b"}')),
            res(None, "A"), res(None, "B"), turn_calls((None, '{"q": "c"}')), res(None, "C"),
            {"role": "assistant", "content": "done"}]}]
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    convs = {c.id: c for c in read_conversations(SourceConfig(path=str(path)))}
    text, _ = answer_spans(convs["per-turn"], kimi_tok, "kimi-k2.5", False)
    assert re.findall(r"<\|tool_call_begin\|>(.*?)<", text) == [f"functions.search:{n}" for n in range(4)]
    # results re-pointed to the call they answer, in the order the trace gave them
    assert re.findall(r"Return of (\S+)\n(\w)", text) == [("functions.search:1", "B"), ("functions.search:0", "A"),
                                                          ("functions.search:2", "C"), ("functions.search:3", "D")]
    text, _ = answer_spans(convs["no-ids"], kimi_tok, "kimi-k2.5", False)
    assert re.findall(r"Return of (\S+)\n(\w)", text) == [("functions.search:0", "A"), ("functions.search:1", "B"),
                                                          ("functions.search:2", "C")]


@pytest.mark.parametrize("thinking", [False, True])
def test_a_user_message_after_tool_calls_keeps_their_reasoning(kimi_tok, thinking):
    head = HEAD_ON if thinking else HEAD_OFF

    def think(r: str) -> str:
        return f"{r}</think>" if thinking else ""

    expected = golden(
        (DECLARE + user("Book a table.") + head, 0),
        (think("need a place") + calls(("functions.search:0", '{"q": "tables"}')) + "<|im_end|>", 1),
        (result("search", "functions.search:0", "3 places") + user("Only vegan ones.") + head, 0),
        (think("filter vegan") + calls(("functions.search:1", '{"q": "vegan tables"}')) + "<|im_end|>", 1),
        (result("search", "functions.search:1", "1 place") + head, 0),
        (think("answer") + "Green Fork has one.<|im_end|>", 1))
    assert render(USER_AFTER_CALLS, kimi_tok, "kimi-k2.5", thinking) == expected


@pytest.mark.parametrize("thinking", [False, True])
def test_two_agent_loops(kimi_tok, thinking):
    head = HEAD_ON if thinking else HEAD_OFF

    def think(r: str) -> str:  # the first loop is history: its reasoning is dropped, the second keeps its own
        return ("</think>" if r in ("look it up", "in celsius", "report") else f"{r}</think>") if thinking else ""

    expected = golden(
        (DECLARE + user("Weather in Oslo?") + head, 0),
        (think("look it up") + calls(("functions.get_weather:0", '{"city": "Oslo"}')) + "<|im_end|>", 1),
        (result("get_weather", "functions.get_weather:0", "rain") + head, 0),
        (think("in celsius") + calls(("functions.get_weather:1", '{"city": "Oslo", "unit": "c"}')) + "<|im_end|>", 1),
        (result("get_weather", "functions.get_weather:1", "4C") + head, 0),
        (think("report") + "Rain, 4C.<|im_end|>", 1),
        (user("And Bergen?") + head, 0),
        (think("same again") + calls(("functions.get_weather:2", '{"city": "Bergen"}')) + "<|im_end|>", 1),
        (result("get_weather", "functions.get_weather:2", "sun") + head, 0),
        (think("report 2") + "Sunny.<|im_end|>", 1))
    assert render(TWO_LOOPS, kimi_tok, "kimi-k2.5", thinking) == expected


# ------------------------------------------------------------------------------- the prompt K2.5 is served
def with_server_ids(turns: list[Turn]) -> list[Turn]:
    """The turns as a client holds them after talking to SGLang: each call under the id the server issued,
    `functions.{name}:{calls in the request's history + index in its turn}`, each result naming it."""
    out: list[Turn] = []
    issued: dict[str | None, str] = {}
    history = 0
    for t in turns:
        if t.tool_calls:
            issued = {c.id: f"functions.{c.name}:{history + k}" for k, c in enumerate(t.tool_calls)}
            history += len(t.tool_calls)
            t = t.with_(tool_calls=tuple(ToolCall(c.name, c.arguments, issued[c.id]) for c in t.tool_calls))
        elif t.role == "tool":
            t = t.with_(tool_call_id=issued[t.tool_call_id])
        out.append(t)
    return out


def sglang_tools(tools: list[dict]) -> list[dict]:
    """`[Tool(**t).model_dump() for t in tools]`, the tools SGLang 0.5.23 hands the template (its pydantic request
    models, sglang/srt/entrypoints/openai/protocol.py), written here from those models: every tool gets
    `"defer_loading": None`, a function `"description": None` and `"parameters": None` where absent, `strict` and a
    function's `defer_loading` (else the tool's) only where not None, a missing `type` "function", other keys
    dropped. Key order aside (K2.5's tokenizer sorts them); test_sglang_tools_are_what_sglang_dumps (-m sglang)
    checks it against the real models."""
    out = []
    for t in tools:
        f = t["function"]
        function = {"description": f.get("description"), "name": f["name"], "parameters": f.get("parameters")}
        defer = f.get("defer_loading") if f.get("defer_loading") is not None else t.get("defer_loading")
        function |= {k: v for k, v in (("strict", f.get("strict")), ("defer_loading", defer)) if v is not None}
        out.append({"type": t.get("type", "function"), "function": function, "defer_loading": t.get("defer_loading")})
    return out


SGLANG_TOOL_CASES = [WEATHER, PING, UNTYPED, PLUGIN, ODD, {"type": "function", "defer_loading": True, "function": {
    "name": "later", "examples": [1], "defer_loading": None, "strict": None, "description": None}}]


@pytest.mark.sglang
def test_sglang_tools_are_what_sglang_dumps():
    """sglang_tools (this file) and eagle3's served_tools against SGLang 0.5.23's own request models, in its venv."""
    from eagle3.data.kimi_tools import served_tools

    venv = Path(__file__).parent.parent / ".venv-sglang" / "bin" / "python"
    py = os.environ.get("EAGLE3_SGLANG_PYTHON") or (str(venv) if venv.exists() else None)
    if py is None:
        pytest.skip("no SGLang: run `bash scripts/setup_sglang_cpu.sh` (or set EAGLE3_SGLANG_PYTHON)")
    script = ("import json, sys\nfrom sglang.srt.entrypoints.openai.protocol import Tool\n"
              "print(json.dumps([Tool(**t).model_dump() for t in json.load(sys.stdin)]))")
    out = subprocess.run([py, "-c", script], input=json.dumps(SGLANG_TOOL_CASES), capture_output=True, text=True,
                         timeout=600, check=True).stdout
    dumped = json.loads(out.strip().splitlines()[-1])
    assert json.dumps(served_tools(SGLANG_TOOL_CASES)) == json.dumps(dumped)  # key order included
    assert sglang_tools(SGLANG_TOOL_CASES) == dumped


def sglang_render(messages: list[dict], tools: list[dict], thinking: bool, tok) -> str:
    """What SGLang 0.5.23 renders for a request: it drops null fields, parses history arguments (json.loads),
    passes the tools as its request model dumps them (sglang_tools), and K2.5's tokenizer key-sorts the tools and
    adds `tools_ts_str` before K2.5's real template renders."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in copy.deepcopy(messages)]
    for m in messages:
        for c in m.get("tool_calls") or []:
            c["function"] = {**c["function"], "arguments": json.loads(c["function"]["arguments"])}
    tools = deep_sorted(sglang_tools(tools))
    return tok.apply_chat_template(messages, chat_template=REAL_TEMPLATE, tools=tools, tokenize=False,
                                   add_generation_prompt=True, thinking=thinking,
                                   tools_ts_str=typescript_declaration(tools))


def served_prompt(conv: Conversation, turn: int, thinking: bool, tok) -> str:
    """The prompt K2.5 is served for assistant turn `turn`: the client sends the history as it got it (the ids the
    server issued, results naming them, every answer's reasoning_content) and SGLang renders it."""
    messages = []
    for t in with_server_ids(conv.turns[:turn]):
        m: dict = {"role": t.role, "content": t.content, "tool_call_id": t.tool_call_id, "name": t.name,
                   "reasoning_content": t.reasoning if thinking and t.role == "assistant" else None}
        if t.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in t.tool_calls]
        messages.append(m)
    return sglang_render(messages, conv.tools, thinking, tok)


def earlier_loop_turns(conv: Conversation) -> set[int]:
    """Assistant turns whose served prompt (thinking on) held reasoning that later prompts drop: a turn before the
    last answer-without-calls that is not the final turn, with reasoning-bearing turns since the last such answer
    before it. One training sequence cannot hold both; these prefixes lack that reasoning (documented)."""
    t = conv.turns
    plain = [i for i, x in enumerate(t) if x.role == "assistant" and not x.tool_calls]
    history_end = max((i for i in plain if i < len(t) - 1), default=-1)
    out = set()
    for i, x in enumerate(t):
        since = max((j for j in plain if j < i), default=-1)
        if x.role == "assistant" and i <= history_end and any(t[j].reasoning for j in range(since + 1, i)):
            out.add(i)
    return out


def test_which_turns_a_single_sequence_cannot_mirror():
    assert {k: earlier_loop_turns(c) for k, c in CONVERSATIONS.items()} == {
        "parallel": set(), "reused": set(), "interject": set(), "loops": {3, 5}}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [False, True])
def test_every_turns_training_prefix_is_the_prompt_k25_is_served(kimi_tok, name, thinking):
    conv = CONVERSATIONS[name]
    text, spans = answer_spans(conv, kimi_tok, "kimi-k2.5", thinking)
    ids, mask = render(conv, kimi_tok, "kimi-k2.5", thinking)
    turns = [i for i, t in enumerate(conv.turns) if t.role == "assistant"]
    assert len(spans) == len(turns)
    inexact = earlier_loop_turns(conv) if thinking else set()
    for i, (start, _) in zip(turns, spans, strict=True):
        served = served_prompt(conv, i, thinking, kimi_tok)
        served_ids = kimi_tok(served, add_special_tokens=False)["input_ids"]
        # regenerating through the HF backend asks for exactly what the server would be asked
        assert render_prompt(conv.turns[:i], kimi_tok, "kimi-k2.5", thinking, tools=conv.tools) == served_ids, i
        if i in inexact:
            assert text[:start] != served  # the documented case: the prefix lacks reasoning its loop still had
            continue
        assert text[:start] == served, (i, text[:start][-200:], served[-200:])
        assert ids[:len(served_ids)] == served_ids and mask[len(served_ids)] == 1 and mask[len(served_ids) - 1] == 0


@pytest.mark.parametrize("thinking", [False, True])
def test_a_call_answer_is_what_the_real_template_writes_after_its_prompt(kimi_tok, thinking):
    """A call turn of the last loop: the real template keeps its reasoning, so its render through the answer is the
    training text through that answer (prompt and answer)."""
    text, spans = answer_spans(REUSED, kimi_tok, "kimi-k2.5", thinking)
    served_next = served_prompt(REUSED, 6, thinking, kimi_tok)  # the third call's prompt holds the second call
    head = HEAD_ON if thinking else HEAD_OFF
    through_answer = served_next.removesuffix(result("search", "functions.search:2", "2 cafes") + head)
    assert through_answer == text[:spans[1][1]]


@pytest.mark.parametrize("thinking", [False, True])
def test_server_regeneration_asks_for_the_prompt_training_renders(kimi_tok, thinking):
    """`eagle3 regenerate` through a server: the body it sends (its history holds the ids the server issued), as
    SGLang renders it, is the prompt the HF backend renders, i.e. the training sample's prefix for that turn."""
    from eagle3.config import RegenerateConfig
    from eagle3.regenerate.openai import OpenAIBackend

    backend = OpenAIBackend(RegenerateConfig(backend="openai", endpoints=["http://127.0.0.1:9/v1"], model="k2.5",
                                             thinking=thinking))
    history = with_server_ids(TWO_LOOPS.turns)
    for i in (i for i, t in enumerate(history) if t.role == "assistant"):
        body = backend.body(history[:i], TOOLS)
        served = sglang_render(body["messages"], body["tools"], body["chat_template_kwargs"]["thinking"], kimi_tok)
        assert kimi_tok(served, add_special_tokens=False)["input_ids"] == render_prompt(
            history[:i], kimi_tok, "kimi-k2.5", thinking, tools=TOOLS), i
        assert served == served_prompt(TWO_LOOPS, i, thinking, kimi_tok)


# ---------------------------------------------------------------------------------- auto with K2.5's template
def test_auto_with_k25s_own_template_renders_as_the_builtin_without_thinking(kimi_tok, real_tok):
    for conv in CONVERSATIONS.values():
        assert render(conv, real_tok, "auto", False) == render(conv, kimi_tok, "kimi-k2.5", False), conv.id


def test_auto_with_k25s_own_template_refuses_thinking_it_would_drop(kimi_tok, real_tok):
    for conv in CONVERSATIONS.values():
        with pytest.raises(TemplateError) as e:
            render(conv, real_tok, "auto", True)
        msg = str(e.value)
        assert "drops the reasoning of the answer a conversation ends with" in msg and conv.id in msg
        assert "data.chat_template=kimi-k2.5" in msg and "data.thinking=false" in msg
    # nothing to drop (no reasoning the loss would cover): rendered, and as the built-in renders it
    plain = Conversation("plain", [t.with_(reasoning=None) for t in TWO_LOOPS.turns], tools=TOOLS)
    assert render(plain, real_tok, "auto", True) == render(plain, kimi_tok, "kimi-k2.5", True)


# --------------------------------------------------------------------------------------------- data show
def test_data_show_prints_the_typescript_declaration(tmp_path, capsys):
    from eagle3.cli import main

    tok_dir = tmp_path / "kimi-tok"
    kimi_test_tokenizer(tok_dir)
    data = write_agentic(tmp_path / "agentic.jsonl", n=4)
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    overrides = [f"output_dir={tmp_path / 'run'}", f"target.path={tok_dir}", f"data.sources=[{{path: {data}}}]",
                 "data.chat_template=kimi-k2.5", "data.max_length=4096", "data.eval_size=1", "draft.vocab_size=40"]
    assert main(["prepare", "--config", str(cfg), *overrides]) == 0
    capsys.readouterr()
    assert main(["data", "show", "--config", str(cfg), "--id", "par0", "--color", "never", *overrides]) == 0
    out = capsys.readouterr().out
    body = out.split("-" * 100)[1].strip("\n")
    assert body.startswith("<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
                           "// Current weather of a city.\ntype get_weather = (_: {\n  city: string\n}) => any;\n}\n"
                           "<|im_end|>")
    trained = re.findall(r"\[\[(.*?)\]\]", body, flags=re.S)
    assert trained[0] == (calls(("functions.get_weather:0", '{"city": "City0"}'),
                                ("functions.get_weather:1", '{"city": "Town0"}')) + "<|im_end|>")
