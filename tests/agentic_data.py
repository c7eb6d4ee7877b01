"""Agentic conversations for tests: tools, calls, results, in the spellings real datasets use.

    from agentic_data import write_agentic   # tests/ is on sys.path under pytest
    path = write_agentic(tmp_path / "agentic.jsonl", n=20)      # n good records, then the bad ones

Good records cycle through: an OpenAI `messages` record with two parallel calls, their results and a final answer
(content null on the call turn); one with text before its call and thinking (`reasoning_content`); a ShareGPT-style
record (`from: function_call` / `observation`, `tools` as a JSON string); a call-only answer (what BFCL-style data
is). Then one record for each kind of bad tool data, each skipped with its reason (BAD_REASONS).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"name": "search", "description": "Search the web.",  # a bare function, as some datasets give it
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


def good_records(n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        city, other = f"City{i}", f"Town{i}"
        kind = i % 4
        if kind == 0:
            out.append({"id": f"par{i}", "tools": [WEATHER], "messages": [
                {"role": "user", "content": f"Weather in {city} and {other}?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"c{i}a", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}},
                    {"id": f"c{i}b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": other}}},
                ]},
                {"role": "tool", "tool_call_id": f"c{i}a", "name": "get_weather", "content": f"{i} C, sunny"},
                {"role": "tool", "tool_call_id": f"c{i}b", "name": "get_weather", "content": {"temp": i + 1}},
                {"role": "assistant", "content": f"{city}: {i} C and sunny; {other}: {i + 1} C."},
            ]})
        elif kind == 1:
            out.append({"id": f"text{i}", "tools": [WEATHER, SEARCH], "messages": [
                {"role": "system", "content": "You are a travel agent."},
                {"role": "user", "content": f"Should I pack an umbrella for {city}?"},
                {"role": "assistant", "content": "Let me look that up.", "reasoning_content": "Need the forecast.",
                 "tool_calls": [{"id": "x", "function": {"name": "search", "arguments": f'{{"q": "{city} rain"}}'}}]},
                {"role": "tool", "tool_call_id": "x", "content": "rain expected"},
                {"role": "assistant", "content": "Yes, rain is expected.", "reasoning_content": "It rains."},
            ]})
        elif kind == 2:
            out.append({"id": f"sg{i}", "tools": json.dumps([WEATHER]), "conversations": [
                {"from": "human", "value": f"How warm is it in {city}?"},
                {"from": "gpt", "value": "Checking."},
                {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": city}})},
                {"from": "observation", "value": f"{20 + i} C"},
                {"from": "gpt", "value": f"It is {20 + i} C in {city}."},
            ]})
        else:
            out.append({"id": f"call{i}", "tools": [WEATHER], "messages": [
                {"role": "user", "content": f"Get me the weather for {city}."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "only", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}]},
            ]})
    return out


BAD_RECORDS: list[dict[str, Any]] = [
    {"id": "bad-args", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "get_weather", "arguments": "{city: x"}}]}]},
    {"id": "bad-orphan", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "nope", "content": "r"},
        {"role": "assistant", "content": "a"}]},
    {"id": "bad-user-calls", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "q", "tool_calls": [{"id": "a", "function": {"name": "get_weather",
                                                                                 "arguments": "{}"}}]},
        {"role": "assistant", "content": "a"}]},
    {"id": "bad-tools", "tools": [{"type": "function", "function": {"description": "no name"}}], "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
]
BAD_REASONS = {"tool_arguments_not_json": 1, "tool_result_without_call": 1, "tool_calls_on_non_assistant": 1,
               "tools_not_functions": 1}


def write_agentic(path: Path, n: int = 8, bad: bool = True) -> Path:
    recs = good_records(n) + (BAD_RECORDS if bad else [])
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path
