"""The one in-memory shape of a conversation, whatever file it came from.

Tool use follows the OpenAI chat shape, which every agentic dataset and serving engine can be mapped onto: a
conversation may declare `tools` (OpenAI function objects), an assistant turn may end with `tool_calls`, and a
`tool` turn carries one call's result (`tool_call_id` names the call, `name` the function).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    """One function call of an assistant turn."""

    name: str
    arguments: str
    """The arguments as JSON text, as the model generated it (an object given as a dict in the source is written
    with `json.dumps(..., ensure_ascii=False)`, which is what the chat templates' `tojson` writes)."""
    id: str | None = None

    def same_call(self, other: ToolCall) -> bool:
        """Same function, same arguments as JSON values (key order and spacing aside)."""
        if self.name != other.name:
            return False
        try:
            return json.loads(self.arguments) == json.loads(other.arguments)
        except ValueError:
            return self.arguments == other.arguments

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Turn:
    role: Role
    content: str
    reasoning: str | None = None
    """Thinking text of an assistant turn (Kimi-K2.5 thinking mode); None when absent."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls an assistant turn ends with (after its text, if any)."""
    tool_call_id: str | None = None
    """A `tool` turn: the id of the call it answers."""
    name: str | None = None
    """A `tool` turn: the function whose result it is."""
    images: tuple[str, ...] = ()
    """The images of a user (or system) turn, in the order of the IMAGE_MARKs in `content` (eagle3.data.images): an
    absolute path or a `data:` URL each."""

    def with_(self, **changes: Any) -> Turn:
        return replace(self, **changes)


@dataclass
class Conversation:
    id: str
    turns: list[Turn] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    """OpenAI function objects (`{"type": "function", "function": {"name", "description", "parameters"}}`) the
    conversation declares; None when it declares none."""
    source: str | None = None
    """Where the record came from: the source's name (eagle3.data.sources.source_name)."""
    record: int | None = None
    """The record's index in that source (its line among the JSONL records, its element of a JSON array, its row
    of a datasets folder), so `eagle3 data show` can print the record a sample was made from."""

    @property
    def images(self) -> list[str]:
        """Every image of the conversation, in the order a render meets them."""
        return [i for t in self.turns for i in t.images]

    @property
    def has_tools(self) -> bool:
        return bool(self.tools) or any(t.tool_calls or t.role == "tool" for t in self.turns)


def turn_to_row(t: Turn) -> dict[str, Any]:
    """A JSON/Arrow-friendly dict of a turn (the prepare workers' and the output files' shape)."""
    return {"role": t.role, "content": t.content, "reasoning": t.reasoning,
            "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in t.tool_calls],
            "tool_call_id": t.tool_call_id, "name": t.name, "images": list(t.images)}


def turn_from_row(r: dict[str, Any]) -> Turn:
    calls = tuple(ToolCall(c["name"], c["arguments"], c.get("id")) for c in r.get("tool_calls") or [])
    return Turn(r["role"], r["content"], r.get("reasoning"), calls, r.get("tool_call_id"), r.get("name"),
                tuple(r.get("images") or ()))
