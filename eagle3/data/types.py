"""The one in-memory shape of a conversation, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["system", "user", "assistant"]


@dataclass
class Turn:
    role: Role
    content: str
    reasoning: str | None = None
    """Thinking text of an assistant turn (Kimi-K2.5 thinking mode); None when absent."""


@dataclass
class Conversation:
    id: str
    turns: list[Turn] = field(default_factory=list)
