"""Tool calls read back out of generated text: the inverse of what eagle3.data.templates renders.

    parsed = parse_tool_calls(text, "kimi")   # text decoded with special tokens kept
    parsed.content, parsed.tool_calls, parsed.malformed

A model served without a server-side tool parser (eagle3's HF backend) writes its calls as text in its template's
format (`ChatTemplate.tool_style`):
- `kimi`: after the turn's text, `<|tool_calls_section_begin|>`, per call `<|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{arguments}<|tool_call_end|>`, then `<|tool_calls_section_end|>` (the markers are
  special tokens: decode with them kept). The id is kept as written (`functions.NAME:IDX`, what SGLang's and vLLM's
  `kimi_k2` parsers issue); `NAME:IDX` is read too, a bare counter is not (it names no function).
- `hermes` (Qwen2.5 / `chatml-tools`): after the text and a newline, one `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>` per call, newline-separated. The calls carry no id.
The arguments are kept as the JSON text the model wrote, so that rendering the parsed turn through the same
template gives back the generated tokens. Parsing is all or nothing: a call section that does not parse (arguments
that are not a JSON object, a call without a name, a section cut off by max_tokens, text after the calls, which no
template renders) leaves the whole answer as text, and `malformed` says so, for the caller to count.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eagle3.data.types import ToolCall

if TYPE_CHECKING:
    from eagle3.data.templates import ToolStyle

KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARGUMENT_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_MARKERS = (KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_ARGUMENT_BEGIN, KIMI_CALL_END)
"""Kimi's tool-call special tokens: they are the answer's format, so they stay in the decoded text."""
HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"

# The engines' reading of a Kimi call (SGLang's KimiK2Detector): whitespace allowed around the id and arguments.
_KIMI_CALL = re.compile(
    re.escape(KIMI_CALL_BEGIN) + r"\s*(?P<id>[^\s<|]+)\s*" + re.escape(KIMI_ARGUMENT_BEGIN) + r"(?P<args>.*?)"
    + re.escape(KIMI_CALL_END), re.DOTALL)
_KIMI_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):\d+$")
_HERMES_CALL = re.compile(re.escape(HERMES_BEGIN) + r"(?P<body>.*?)" + re.escape(HERMES_END), re.DOTALL)


@dataclass(frozen=True)
class ParsedAnswer:
    content: str
    """The text before the calls (the whole text when there are none, or when they did not parse)."""
    tool_calls: tuple[ToolCall, ...] = ()
    malformed: bool = False
    """The text holds a call section that did not parse; it is kept as text."""


class _Malformed(ValueError):
    pass


def parse_tool_calls(text: str, style: ToolStyle | None) -> ParsedAnswer:
    """The text and calls of one generated answer, in the template's `style` (None: no calls to look for)."""
    try:
        if style == "kimi":
            return _parse_kimi(text)
        if style == "hermes":
            return _parse_hermes(text)
    except _Malformed:
        return ParsedAnswer(text, malformed=True)
    return ParsedAnswer(text)


def _arguments(raw: str) -> str:
    """The arguments' JSON text, as written (stripped); a call's arguments must be a JSON object."""
    raw = raw.strip()
    try:
        value = json.loads(raw)
    except ValueError:
        raise _Malformed from None
    if not isinstance(value, dict):
        raise _Malformed
    return raw


def _parse_kimi(text: str) -> ParsedAnswer:
    start = text.find(KIMI_SECTION_BEGIN)
    if start < 0:
        if KIMI_CALL_BEGIN in text:
            raise _Malformed  # a call outside any section
        return ParsedAnswer(text)
    section = text[start + len(KIMI_SECTION_BEGIN):]
    end = section.find(KIMI_SECTION_END)
    if end < 0 or section[end + len(KIMI_SECTION_END):].strip():
        raise _Malformed  # cut off before the section ends, or text after it
    calls, pos, body = [], 0, section[:end]
    for m in _KIMI_CALL.finditer(body):
        if body[pos:m.start()].strip():
            raise _Malformed
        name = _KIMI_ID.match(m["id"])
        if name is None:
            raise _Malformed
        calls.append(ToolCall(name["name"], _arguments(m["args"]), m["id"]))
        pos = m.end()
    if not calls or body[pos:].strip():
        raise _Malformed
    return ParsedAnswer(text[:start], tuple(calls))


def _parse_hermes(text: str) -> ParsedAnswer:
    start = text.find(HERMES_BEGIN)
    if start < 0:
        return ParsedAnswer(text)
    calls, pos = [], start
    for m in _HERMES_CALL.finditer(text, start):
        if text[pos:m.start()].strip():
            raise _Malformed
        calls.append(_hermes_call(m["body"].strip()))
        pos = m.end()
    if not calls or text[pos:].strip():
        raise _Malformed  # an unclosed <tool_call>, or text after the calls
    content = text[:start]
    return ParsedAnswer(content.removesuffix("\n"), tuple(calls))


_HERMES_HEAD, _HERMES_ARGS = '{"name": ', ', "arguments": '


def _hermes_call(body: str) -> ToolCall:
    """`{"name": "f", "arguments": {...}}` as chatml-tools writes it, the arguments' text kept exactly; any other
    JSON spelling of the same object (keys reordered, other spacing) with the arguments re-serialised."""
    decoder = json.JSONDecoder()
    if body.startswith(_HERMES_HEAD):
        try:
            name, pos = decoder.raw_decode(body, len(_HERMES_HEAD))
            if isinstance(name, str) and body.startswith(_HERMES_ARGS, pos):
                args, end = decoder.raw_decode(body, pos + len(_HERMES_ARGS))
                if isinstance(args, dict) and body[end:].strip() == "}" and name.strip():
                    return ToolCall(name, body[pos + len(_HERMES_ARGS):end])
        except ValueError:
            pass
    try:
        obj = json.loads(body)
    except ValueError:
        raise _Malformed from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        raise _Malformed
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], _arguments(args))
    if not isinstance(args, dict):
        raise _Malformed
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
