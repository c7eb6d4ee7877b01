"""BFCL (the Berkeley Function Calling Leaderboard, v4, Apache-2.0) questions as tool prompts.

    from eagle3.data.bfcl import questions
    for q in questions("simple_python"):      # {"id", "category", "tools", "messages"}
        ...

Two uses, disjoint on purpose:
- the `bfcl` prompt set (eagle3.prompts): the seven single-turn categories, each a card category;
- the `bundled:bfcl-live` data source (eagle3.data.sources): BFCL's `live_*` questions (user-contributed functions
  and queries, none of them in the seven) as tool prompts to train on once the target has answered them
  (`eagle3 regenerate`). BFCL's multi_turn_* files are used nowhere: they need the tools to run.
The question files come from the `bfcl-eval` wheel (eagle3.bundled.bfcl_file). Each question is turned into an
OpenAI chat request as BFCL prepares one for function-calling models: names with dots get underscores (OpenAI's
name pattern has none), BFCL's types become JSON-schema types (`dict` -> object, `float` -> number, ...; unknown ->
string) and each description gets BFCL's note on the function's language.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_TYPES = {"integer": "integer", "number": "number", "float": "number", "string": "string", "boolean": "boolean",
          "bool": "boolean", "array": "array", "list": "array", "dict": "object", "object": "object",
          "tuple": "array", "any": "string", "byte": "integer", "short": "integer", "long": "integer",
          "double": "number", "char": "string", "ArrayList": "array", "Array": "array", "HashMap": "object",
          "Hashtable": "object", "Queue": "array", "Stack": "array", "Any": "string", "String": "string",
          "Bigint": "integer"}
"""BFCL's parameter types -> JSON-schema types (bfcl_eval.constants.type_mappings.GORILLA_TO_OPENAPI)."""


def _language(category: str) -> str:
    return "Java 8 SDK" if "java" in category and "javascript" not in category else (
        "JavaScript" if "javascript" in category else "Python 3")


def _json_schema(schema: Any) -> Any:
    """BFCL's schema with the `type` of it, of each property and of array items mapped to JSON schema's (an
    unknown one to string); other keys as they are (a property may itself be named `type`)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("type"), str):
        out["type"] = _TYPES.get(out["type"], "string")
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _json_schema(v) for k, v in out["properties"].items()}
    if "items" in out:
        out["items"] = _json_schema(out["items"])
    return out


def tools(functions: list[dict[str, Any]], category: str) -> list[dict[str, Any]]:
    """BFCL functions as OpenAI tools, the way BFCL hands them to function-calling models."""
    note = f" Note that the provided function is in {_language(category)} syntax."
    out = []
    for fn in functions:
        params = _json_schema(fn.get("parameters") or {"type": "dict", "properties": {}})
        params["type"] = "object"
        out.append({"type": "function", "function": {"name": fn["name"].replace(".", "_"),
                                                     "description": fn.get("description", "") + note,
                                                     "parameters": params}})
    return out


def questions(category: str) -> Iterator[dict[str, Any]]:
    """One category's questions as `{"id", "category", "tools", "messages"}` (the first turn of each: the
    single-turn categories have only it)."""
    from eagle3.bundled import bfcl_file

    for line in bfcl_file(category).read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            messages = [{"role": "system" if m["role"] == "system" else "user", "content": m["content"]}
                        for m in rec["question"][0]]
            yield {"id": rec["id"], "category": category, "tools": tools(rec["function"], category),
                   "messages": messages}


def live_source() -> Path:
    """`bundled:bfcl-live`: every live_* question as a JSONL of tool prompts (written once, beside the files), the
    categories interleaved (a question of each in turn, while they last) so that the first N (`max_records`) cover
    them all."""
    from itertools import chain, zip_longest

    from eagle3.bundled import BFCL_LIVE, bfcl_file

    path = bfcl_file(BFCL_LIVE[0]).parent / "bfcl-live-prompts.jsonl"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        mixed = (q for q in chain.from_iterable(zip_longest(*(questions(c) for c in BFCL_LIVE))) if q is not None)
        tmp.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in mixed), encoding="utf-8")
        os.replace(tmp, path)  # a reader sees all of it or nothing
    return path
