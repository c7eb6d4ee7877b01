"""One conversation being re-answered, turn by turn, whatever backend produces the answers.

The user (and system) turns are kept; every original assistant turn that follows a user turn is replaced by a
generated answer, so later turns see the *regenerated* earlier answers (the target's own distribution is what the
draft must learn). A trailing user turn without an answer gets one too; an assistant turn that answers nothing
(a conversation that opens with the assistant) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3.data.types import Conversation, Turn

_ROLE_TO_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}


@dataclass
class Answer:
    """One generated assistant turn, as a backend returns it."""

    content: str
    reasoning: str | None = None
    finish_reason: str | None = None
    """`stop` or `length` (cut at max_tokens); None when the backend did not say."""
    tokens: int = 0
    """Generated tokens (reasoning included), for throughput."""
    prompt_tokens: int | None = None
    """Tokens of the prompt it answered, when the backend knows (for the `max_length` cut)."""


@dataclass
class Outcome:
    """The end of one conversation: the regenerated conversation, or the error that stopped it."""

    id: str
    conversation: Conversation | None = None
    error: str | None = None
    attempts: int = 0
    tokens: int = 0
    truncated_turns: int = 0
    cut_at_max_length: bool = False


@dataclass
class Dialogue:
    """Walks a conversation's prompt turns and collects generated answers in place of the original ones."""

    source: Conversation
    system_prompt: str | None = None
    max_length: int | None = None
    """Stop extending the conversation once it is this many tokens long (`data.max_length`): `prepare` would
    cut everything after that point anyway, so generating it is wasted work."""
    history: list[Turn] = field(default_factory=list)
    tokens: int = 0
    truncated_turns: int = 0
    context_tokens: int = 0
    """Length of the conversation so far (last prompt + its answer), when the backend reports it."""
    cut_at_max_length: bool = False
    _pos: int = 0
    _skeleton: list[tuple[Turn, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Prompt turns, each flagged True where an answer must follow it: where the original had an assistant
        # turn after a user turn, and after a trailing user turn.
        skeleton: list[tuple[Turn, bool]] = []
        for t in self.source.turns:
            if t.role != "assistant":
                skeleton.append((t, False))
            elif skeleton and skeleton[-1][0].role == "user":
                skeleton[-1] = (skeleton[-1][0], True)
        if skeleton and skeleton[-1][0].role == "user":
            skeleton[-1] = (skeleton[-1][0], True)
        if self.system_prompt is not None and not any(t.role == "system" for t, _ in skeleton):
            # Generate under the same system prompt `prepare` will render, and write it so the file says so.
            skeleton.insert(0, (Turn("system", self.system_prompt), False))
        self._skeleton = skeleton

    @property
    def has_prompt(self) -> bool:
        return any(answer for _, answer in self._skeleton)

    def next_prompt(self) -> list[Turn] | None:
        """The history the next answer must follow (ends with a user turn), or None when all are answered
        (or the conversation already reached `max_length`: it then ends with the last answer)."""
        if self.max_length is not None and self.context_tokens >= self.max_length:
            self.end_with_last_answer()
        while self._pos < len(self._skeleton):
            turn, answer_after = self._skeleton[self._pos]
            self._pos += 1
            self.history.append(Turn(turn.role, turn.content))
            if answer_after:
                return list(self.history)
        return None

    def end_with_last_answer(self) -> None:
        """Drop every later turn (the conversation reached `max_length`); a no-op before the first answer."""
        answered = [i for i, t in enumerate(self.history) if t.role == "assistant"]
        if not answered:
            return
        rest = self._skeleton[self._pos:]
        self.cut_at_max_length = len(self.history) > answered[-1] + 1 or any(a for _, a in rest)
        del self.history[answered[-1] + 1:]
        self._pos = len(self._skeleton)

    def add_answer(self, answer: Answer) -> None:
        if not self.history or self.history[-1].role != "user":
            raise RuntimeError(f"conversation {self.source.id!r}: an answer arrived with no user turn to answer")
        self.history.append(Turn("assistant", answer.content, answer.reasoning))
        self.tokens += answer.tokens
        self.truncated_turns += answer.finish_reason == "length"
        if answer.prompt_tokens is not None:
            self.context_tokens = answer.prompt_tokens + answer.tokens

    def outcome(self, attempts: int = 1) -> Outcome:
        conv = Conversation(self.source.id, list(self.history))
        return Outcome(self.source.id, conv, attempts=attempts, tokens=self.tokens,
                       truncated_turns=self.truncated_turns, cut_at_max_length=self.cut_at_max_length)


_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def split_reasoning(content: str | None, reasoning_content: str | None = None) -> tuple[str, str | None]:
    """(answer, reasoning) from a reply in any of the shapes servers produce.

    - a reasoning parser on the server: `reasoning_content` holds the thinking, `content` the answer;
    - no parser: `<think>…</think>answer` in content, or `…</think>answer` when the prompt already ended with
      `<think>` (Kimi-K2.5 thinking mode); with thinking off Kimi answers `<think></think>answer`;
    - cut at max_tokens while still thinking: `<think>…` with no close, so the answer is empty.
    """
    text = content or ""
    reasoning = reasoning_content.strip() if reasoning_content else None
    stripped = text.lstrip()
    if stripped.startswith(_THINK_OPEN):
        body = stripped[len(_THINK_OPEN):]
        head, sep, tail = body.partition(_THINK_CLOSE)
        think, text = (head, tail) if sep else (body, "")
        reasoning = _join(reasoning, think)
    elif _THINK_CLOSE in text:
        head, _, text = text.partition(_THINK_CLOSE)
        reasoning = _join(reasoning, head)
    return text.strip(), reasoning or None


def _join(a: str | None, b: str) -> str | None:
    b = b.strip()
    return "\n".join(x for x in (a, b) if x) or None


def to_sharegpt(conv: Conversation, keep_reasoning: bool) -> dict[str, Any]:
    """The ShareGPT record `prepare` reads: {"id", "conversations": [{"from", "value"[, "reasoning"]}]}."""
    turns = []
    for t in conv.turns:
        rec: dict[str, Any] = {"from": _ROLE_TO_SHAREGPT[t.role], "value": t.content}
        if keep_reasoning and t.role == "assistant" and t.reasoning:
            rec["reasoning"] = t.reasoning
        turns.append(rec)
    return {"id": conv.id, "conversations": turns}
