"""One conversation being re-answered, turn by turn, whatever backend produces the answers.

The system and user turns are kept; every original assistant turn that follows a user turn is replaced by a
generated answer, so later turns see the *regenerated* earlier answers (the target's own distribution is what the
draft must learn). A trailing user turn without an answer gets one too; an assistant turn that answers nothing
(a conversation that opens with the assistant) is dropped.

Tool use. Tools cannot run here, so the record's tool results are the only results there are, and they answer the
record's calls: they are replayed only while the regenerated answer makes the same calls as the recorded answer
(ToolCall.same_call: same function, same arguments as JSON values). Parallel calls compare as a multiset: the same
calls, as many, in any order (a turn's parallel calls are independent, so their order changes no result); the
results are then replayed in the regenerated calls' order, each `tool_call_id` rewritten to the id of the
regenerated call it answers, and the next answer is generated after them. At the first difference (other calls, a
call where the record answered in text, text where it called) the conversation ends with the regenerated answer (a
call without its result is a valid last turn: it is what the model generates), and when the record went on past
it `Outcome.cut_at_different_call` says so. Prompts that end with a user turn or with tool results (tool prompts
read `for_generation`, BFCL-style: tools and a user turn, no answer) get an answer too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3.data.types import Conversation, ToolCall, Turn

_ROLE_TO_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}


@dataclass
class Answer:
    """One generated assistant turn, as a backend returns it."""

    content: str
    reasoning: str | None = None
    finish_reason: str | None = None
    """`stop`, `length` (cut at max_tokens) or `tool_calls`; None when the backend did not say."""
    tokens: int = 0
    """Generated tokens (reasoning included), for throughput."""
    prompt_tokens: int | None = None
    """Tokens of the prompt it answered, when the backend knows (for the `max_length` cut)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls the answer ends with, arguments as the JSON text generated; ids as the server or the model gave
    them (None where none was given: the dialogue numbers them)."""
    malformed_tool_calls: bool = False
    """The answer held calls that did not parse; it is kept as text (eagle3.data.tool_calls)."""


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
    cut_at_different_call: bool = False
    tool_call_answers: int = 0
    """Answers in the output that are tool calls."""
    replayed_results: int = 0
    """Recorded tool results in the output (replayed after an equal call)."""
    malformed_tool_calls: int = 0


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
    malformed_tool_calls: int = 0
    context_tokens: int = 0
    """Length of the conversation so far (last prompt + its answer), when the backend reports it."""
    cut_at_max_length: bool = False
    cut_at_different_call: bool = False
    _turns: list[Turn] = field(default_factory=list)
    _pos: int = 0
    """The next record turn to walk; right after an answer point, the recorded answer (if any)."""
    _due: bool = False
    """Replayed results end the history: the next answer is due without walking on."""
    _calls: int = 0

    def __post_init__(self) -> None:
        turns = list(self.source.turns)
        if self.system_prompt is not None and not any(t.role == "system" for t in turns):
            # Generate under the same system prompt `prepare` will render, and write it so the file says so.
            turns.insert(0, Turn("system", self.system_prompt))
        self._turns = turns

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self.source.tools

    def _answer_point(self, i: int) -> bool:
        """An answer follows record turn i: a user turn, or the last of a run of tool results, that the record
        follows with an assistant turn or with nothing."""
        t = self._turns
        return t[i].role in ("user", "tool") and (i + 1 == len(t) or t[i + 1].role == "assistant")

    @property
    def has_prompt(self) -> bool:
        return any(t.role == "user" and self._answer_point(i) for i, t in enumerate(self._turns))

    def next_prompt(self) -> list[Turn] | None:
        """The history the next answer must follow (ends with a user turn or tool results), or None when all are
        answered (or the conversation already reached `max_length`: it then ends with the last answer)."""
        if self.max_length is not None and self.context_tokens >= self.max_length:
            self.end_with_last_answer()
        if self._due:
            self._due = False
            return list(self.history)
        while self._pos < len(self._turns):
            i = self._pos
            self._pos += 1
            turn = self._turns[i]
            if turn.role in ("assistant", "tool"):
                continue  # answers nothing; (results are replayed by add_answer, after an equal call only)
            self.history.append(Turn(turn.role, turn.content))
            if self._answer_point(i):
                return list(self.history)
        return None

    def end_with_last_answer(self) -> None:
        """Drop every later turn (the conversation reached `max_length`); a no-op before the first answer."""
        answered = [i for i, t in enumerate(self.history) if t.role == "assistant"]
        if not answered:
            return
        rest = range(self._pos, len(self._turns))
        self.cut_at_max_length = (len(self.history) > answered[-1] + 1 or self._due
                                  or any(self._answer_point(i) for i in rest))
        del self.history[answered[-1] + 1:]
        self._pos, self._due = len(self._turns), False

    def add_answer(self, answer: Answer) -> None:
        if not self.history or self.history[-1].role not in ("user", "tool"):
            raise RuntimeError(f"conversation {self.source.id!r}: an answer arrived with no user turn to answer")
        calls = self._numbered(answer.tool_calls)
        self.history.append(Turn("assistant", answer.content, answer.reasoning, calls))
        self.tokens += answer.tokens
        self.truncated_turns += answer.finish_reason == "length"
        self.malformed_tool_calls += answer.malformed_tool_calls
        if answer.prompt_tokens is not None:
            self.context_tokens = answer.prompt_tokens + answer.tokens
        if self._pos >= len(self._turns):
            return  # a trailing prompt: nothing recorded after it
        recorded = self._turns[self._pos]
        self._pos += 1
        end = self._pos
        while end < len(self._turns) and self._turns[end].role == "tool":
            end += 1
        if not calls and not recorded.tool_calls:
            return  # text for text: walk on
        order = match_calls(calls, recorded.tool_calls)
        if order is None:
            self.cut_at_different_call = self._pos < len(self._turns)
            self._pos = len(self._turns)
            return
        replayed = replay_results(self._turns[self._pos:end], recorded.tool_calls, calls, order)
        self.history += replayed
        self._pos = end
        self._due = bool(replayed) and self._answer_point(end - 1)

    def _numbered(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        """The calls with an id each, unique within the turn: the one given, else `call_<n>` (n counting the
        conversation's calls, as eagle3.data.sources numbers a record's)."""
        out: list[ToolCall] = []
        for c in calls:
            cid = c.id
            while cid is None or cid in {x.id for x in out}:
                cid, self._calls = f"call_{self._calls}", self._calls + 1
            out.append(c if cid == c.id else ToolCall(c.name, c.arguments, cid))
        return tuple(out)

    def outcome(self, attempts: int = 1) -> Outcome:
        conv = Conversation(self.source.id, list(self.history), tools=self.source.tools, source=self.source.source,
                            record=self.source.record)
        return Outcome(self.source.id, conv, attempts=attempts, tokens=self.tokens,
                       truncated_turns=self.truncated_turns, cut_at_max_length=self.cut_at_max_length,
                       cut_at_different_call=self.cut_at_different_call,
                       tool_call_answers=sum(bool(t.tool_calls) for t in self.history),
                       replayed_results=sum(t.role == "tool" for t in self.history),
                       malformed_tool_calls=self.malformed_tool_calls)


def match_calls(new: tuple[ToolCall, ...], recorded: tuple[ToolCall, ...]) -> list[int] | None:
    """For each regenerated call, the index of the recorded call it equals (each used once, any order); None when
    the two turns do not make the same calls (or either makes none)."""
    if not new or len(new) != len(recorded):
        return None
    free = list(range(len(recorded)))
    order = []
    for c in new:
        j = next((j for j in free if c.same_call(recorded[j])), None)
        if j is None:
            return None
        free.remove(j)
        order.append(j)
    return order


def replay_results(results: list[Turn], recorded: tuple[ToolCall, ...], new: tuple[ToolCall, ...],
                   order: list[int]) -> list[Turn]:
    """The recorded results of `recorded`'s calls, in the order of the regenerated calls they now answer, each
    carrying its regenerated call's id and name."""
    out = []
    for call, j in zip(new, order, strict=True):
        out += [r.with_(tool_call_id=call.id, name=call.name) for r in results if r.tool_call_id == recorded[j].id]
    return out


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


def openai_messages(turns: list[Turn], keep_reasoning: bool = False) -> list[dict[str, Any]]:
    """Turns in the OpenAI chat shape: what a server is sent, and what a tool record is written as (a plain turn
    is `{"role", "content"}` alone; calls as `tool_calls` with id, type and function; results with
    `tool_call_id` and `name`)."""
    out = []
    for t in turns:
        m: dict[str, Any] = {"role": t.role, "content": t.content}
        if keep_reasoning and t.role == "assistant" and t.reasoning:
            m["reasoning_content"] = t.reasoning
        if t.tool_calls:
            m["tool_calls"] = [c.to_openai() for c in t.tool_calls]
        if t.role == "tool":
            m["tool_call_id"] = t.tool_call_id
            if t.name is not None:
                m["name"] = t.name
        out.append(m)
    return out


def to_record(conv: Conversation, keep_reasoning: bool) -> dict[str, Any]:
    """The record `prepare` reads back (eagle3.data.sources). A conversation without tools: ShareGPT, {"id",
    "conversations": [{"from", "value"[, "reasoning"]}]}. With tools (declared, called or answered): OpenAI
    messages, {"id", "tools", "messages"}, the one shape that holds call ids and results."""
    if conv.has_tools:
        rec: dict[str, Any] = {"id": conv.id}
        if conv.tools:
            rec["tools"] = conv.tools
        rec["messages"] = openai_messages(conv.turns, keep_reasoning)
        return rec
    turns = []
    for t in conv.turns:
        r: dict[str, Any] = {"from": _ROLE_TO_SHAREGPT[t.role], "value": t.content}
        if keep_reasoning and t.role == "assistant" and t.reasoning:
            r["reasoning"] = t.reasoning
        turns.append(r)
    return {"id": conv.id, "conversations": turns}
