"""Self-distillation: the target re-answers every conversation, so the draft learns the target's own outputs.

    eagle3 regenerate --config configs/smollm2-135m.yaml regenerate.max_tokens=64 data.max_samples=20

Reads every source in `data.sources` as prompts (only those marked `regenerate: true` when any is; at most
`data.max_samples` conversations, taken in source order; a trailing user turn or tool result is kept, and a record without any answer is a prompt too), keeps the
system and user turns, and replaces each assistant turn with the target's answer, turn by turn (later turns see the
regenerated earlier answers). A conversation that reaches `data.max_length` tokens ends with the answer that got it
there: `prepare` would cut the later turns anyway. Writes JSONL to `regenerate.output` (default
`<output_dir>/regenerated.jsonl`), one line per finished conversation, in a shape `prepare` reads: ShareGPT, or
OpenAI `messages` with `tools` for a conversation that uses tools.

Tool use (eagle3.regenerate.dialogue): the conversation's `tools` go with every prompt, and a recorded tool result
is replayed only while the regenerated call equals the recorded one (same name, same arguments as JSON); at the
first different call the conversation ends there (`cut_at_different_call` in the summary).
To train on the result, point the data at it:

    eagle3 prepare --config configs/smollm2-135m.yaml 'data.sources=[{path: runs/smollm2-135m/regenerated.jsonl}]'

Backends (`regenerate.backend`): `hf` generates in process with transformers (small targets, tests) and parses
the calls out of the generated text in the template's format (eagle3.data.tool_calls); `openai` talks to
OpenAI-compatible servers (SGLang, vLLM) listed in `regenerate.endpoints`, sends `tools` and stores the returned
`tool_calls`. The server must parse calls itself, with its tool-call parser for the target's format; Kimi-K2.5:

    python -m sglang.launch_server --model-path moonshotai/Kimi-K2.5 --tp 8 --trust-remote-code \
        --tool-call-parser kimi_k2 --reasoning-parser kimi_k2
    vllm serve moonshotai/Kimi-K2.5 -tp 8 --trust-remote-code \
        --enable-auto-tool-choice --tool-call-parser kimi_k2 --reasoning-parser kimi_k2

(`hermes` is the parser for Qwen2.5-style `<tool_call>` JSON, eagle3's `chatml-tools`.) Without a tool-call parser
SGLang answers with the calls as text (markers stripped), and vLLM refuses a request that carries tools.

A killed run resumes where it stopped: finished conversations are skipped, a torn last line is cut off.
Conversations that fail after `regenerate.max_retries` retries are listed in `<output>.failed.jsonl` and the
summary, and are tried again by the next run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

from eagle3.config import Config, DataConfig, RegenerateConfig, SourceConfig, TargetConfig
from eagle3.data.types import Conversation
from eagle3.locks import writes
from eagle3.logs import Progress
from eagle3.regenerate.dialogue import Dialogue, Outcome, split_reasoning, to_record
from eagle3.regenerate.output import JsonlAppender, failed_path, recover

__all__ = ["Summary", "load_conversations", "make_backend", "regenerate", "run", "split_reasoning"]

log = logging.getLogger("eagle3")


class Backend(Protocol):
    def outcomes(self, dialogues: Iterable[Dialogue]) -> Iterator[Outcome]:
        """Finished conversations, in any order."""
        ...


@dataclass
class Summary:
    output: Path
    regenerated: int = 0
    failed: int = 0
    skipped_done: int = 0
    """Already in the output from an earlier run."""
    skipped_duplicate: int = 0
    """Ids seen earlier in the sources (only the first is regenerated)."""
    skipped_no_prompt: int = 0
    """Conversations without a user turn: nothing to answer."""
    skipped_images: int = 0
    """Conversations with images: regenerate sends text prompts only (their answers stay as recorded)."""
    truncated_turns: int = 0
    """Answers cut at regenerate.max_tokens (finish_reason "length")."""
    truncated_conversations: int = 0
    cut_at_max_length: int = 0
    """Conversations ended early because they reached data.max_length tokens (prepare would cut the rest)."""
    cut_at_different_call: int = 0
    """Conversations ended at an answer whose tool calls differ from the record's (other calls, a call for text,
    text for a call), where the record went on: its later results answer calls the model did not make."""
    tool_call_answers: int = 0
    """Answers written that are tool calls."""
    replayed_results: int = 0
    """Recorded tool results written after a regenerated call equal to the recorded one."""
    malformed_tool_calls: int = 0
    """Answers whose tool calls did not parse, kept as text (HF backend: the template's format; OpenAI: a call
    without a name or whose arguments are not a JSON object)."""
    tokens: int = 0
    seconds: float = 0.0
    total_in_output: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        failed = f" (listed in {failed_path(self.output)}; rerun to retry them)" if self.failed else ""
        return (
            f"regenerate: {self.regenerated} regenerated, {self.failed} failed{failed}, "
            f"{self.truncated_turns} answers truncated at max_tokens (in {self.truncated_conversations} "
            f"conversations), {self.cut_at_max_length} ended early at data.max_length, "
            f"{self.cut_at_different_call} ended at a tool call that differs from the record's{self._tool_detail()}, "
            f"{self.skipped_done} skipped as already done, {self.skipped_duplicate} duplicate ids "
            f"and {self.skipped_no_prompt} without a user turn skipped"
            f"{f', {self.skipped_images} with images skipped' if self.skipped_images else ''}; {self.tokens} tokens in "
            f"{self.seconds:.1f}s ({self.tokens_per_s:.1f} tok/s, "
            f"{self.regenerated / self.seconds if self.seconds else 0:.2f} conv/s). "
            f"{self.output} holds {self.total_in_output} conversations: train on it with "
            f"'data.sources=[{{path: {self.output}}}]'"
        )


    def _tool_detail(self) -> str:
        if not (self.tool_call_answers or self.replayed_results or self.malformed_tool_calls):
            return ""
        return (f" ({self.tool_call_answers} answers are tool calls, {self.replayed_results} recorded results "
                f"replayed, {self.malformed_tool_calls} answers with malformed calls kept as text)")


def regenerated_sources(data: DataConfig) -> list[SourceConfig]:
    """The sources to answer: those marked `regenerate: true` when any is (the opt-in), else every source."""
    chosen = [s for s in data.sources if s.regenerate]
    return chosen or list(data.sources)


def load_conversations(data: DataConfig) -> Iterator[Conversation]:
    """Every conversation of every source to answer (`regenerated_sources`), in order, capped at `data.max_samples`,
    read as prompts (`for_generation`: a trailing user turn or tool result stays, no answer is needed)."""
    from eagle3.data.sources import read_conversations

    def all_sources() -> Iterator[Conversation]:
        for src in regenerated_sources(data):
            yield from read_conversations(src, for_generation=True)

    return islice(all_sources(), data.max_samples)


def make_backend(rc: RegenerateConfig, target: TargetConfig, chat_template: str) -> Backend:
    """regenerate.backend's backend: OpenAI-compatible servers, or the target in process (rendering with the data's
    chat template)."""
    if rc.backend == "openai":
        from eagle3.regenerate.openai import OpenAIBackend

        return OpenAIBackend(rc)
    from eagle3.regenerate.hf import HFBackend

    return HFBackend(target, rc, chat_template)


@writes(lambda cfg, **_: cfg.regenerated_path, "regenerate")
def run(cfg: Config, conversations: Iterable[Conversation] | None = None, backend: Backend | None = None) -> Summary:
    """`eagle3 regenerate`: `conversations` (None: the data's sources, load_conversations) into
    `cfg.regenerated_path`, resuming from what is already there; `backend` (None: the config's, built only when
    there is work) answers them."""
    out = cfg.regenerated_path
    if conversations is None:
        conversations = load_conversations(cfg.data)
    done = recover(out)
    summary = Summary(out)
    todo: list[Dialogue] = []
    seen: set[str] = set()
    for conv in conversations:
        if conv.id in seen:
            summary.skipped_duplicate += 1
            continue
        seen.add(conv.id)
        if conv.id in done:
            summary.skipped_done += 1
            continue
        if conv.images:
            summary.skipped_images += 1
            continue
        d = Dialogue(conv, cfg.data.system_prompt, cfg.data.max_length)
        if not d.has_prompt:
            summary.skipped_no_prompt += 1
            continue
        todo.append(d)
    if summary.skipped_duplicate:
        log.warning("regenerate: %d conversations reuse an id seen earlier; only the first of each is used",
                    summary.skipped_duplicate)
    log.info("regenerate: %d to do, %d already in %s", len(todo), summary.skipped_done, out)
    summary.total_in_output = len(done)
    if todo:
        backend = backend or make_backend(cfg.regenerate, cfg.target, cfg.data.chat_template)
        _drive(cfg.regenerate, backend, todo, summary)
    else:
        failed_path(out).unlink(missing_ok=True)
    log.info(summary.line())
    return summary


def _drive(rc: RegenerateConfig, backend: Backend, todo: list[Dialogue], summary: Summary) -> None:
    out = summary.output
    keep = rc.keep_reasoning
    t0 = time.monotonic()
    # The sidecar lists this run's failures only: earlier failures are not in the output, so they are retried now.
    failed_file = failed_path(out)
    failed_file.unlink(missing_ok=True)
    failures: JsonlAppender | None = None
    try:
        with JsonlAppender(out) as writer, Progress(len(todo), "regenerate", unit="conv") as bar:
            for o in backend.outcomes(todo):
                if o.conversation is not None:
                    writer.write(to_record(o.conversation, keep))
                    summary.regenerated += 1
                    summary.total_in_output += 1
                    summary.tokens += o.tokens
                    summary.truncated_turns += o.truncated_turns
                    summary.truncated_conversations += o.truncated_turns > 0
                    summary.cut_at_max_length += o.cut_at_max_length
                    summary.cut_at_different_call += o.cut_at_different_call
                    summary.tool_call_answers += o.tool_call_answers
                    summary.replayed_results += o.replayed_results
                    summary.malformed_tool_calls += o.malformed_tool_calls
                else:
                    failures = failures or JsonlAppender(failed_file, fsync_every_s=0.0)
                    failures.write(_failure_record(o))
                    summary.failed += 1
                    log.warning("regenerate: conversation %r failed after %d attempts: %s", o.id, o.attempts, o.error)
                dt = time.monotonic() - t0
                bar.update(1, tok_s=f"{summary.tokens / dt:.1f}" if dt > 0 else "0", failed=summary.failed)
    finally:
        if failures is not None:
            failures.close()
        summary.seconds = time.monotonic() - t0


def _failure_record(o: Outcome) -> dict[str, Any]:
    return {"id": o.id, "error": o.error, "attempts": o.attempts, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}

