"""In-process transformers backend: batched `generate` with left padding, for small targets and tests.

Prompts are rendered by eagle3.data.templates exactly as `prepare` renders conversations (`data.chat_template`:
the tokenizer's own template or a built-in one), so the answers are generated in the format trained on. With the
built-in `kimi-k2.5` each prompt is the one K2.5's server builds for that turn (TypeScript tool declaration, the
servers' call ids, every answer's reasoning kept or dropped by K2.5's rule): the training sample's prefix for the
turn, except for an earlier agent loop's turns with thinking (templates module docstring).
A batch of conversations advances in lockstep: round r generates the r-th answer of every conversation that
still has one to give, so multi-turn conversations stay batched and each answer sees the regenerated history.

Tools: prompts are rendered with the conversation's `tools`, and a template that drops them is refused before
anything is generated (templates.check_renders_tools). The answer is decoded with its special tokens, the calls
are parsed out of that raw text in the template's format (eagle3.data.tool_calls: Kimi's marker tokens or Hermes'
`<tool_call>` JSON), and only then are the other special tokens stripped from the text.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from eagle3 import threads
from eagle3.config import RegenerateConfig, TargetConfig
from eagle3.data.templates import check_renders_tools, render_prompt, resolve_template
from eagle3.data.tool_calls import KIMI_MARKERS, parse_tool_calls
from eagle3.regenerate.dialogue import Answer, Dialogue, Outcome, split_reasoning

log = logging.getLogger("eagle3")


class HFBackend:
    """Generates answers with an AutoModelForCausalLM loaded from `target.path`."""

    def __init__(self, target: TargetConfig, rc: RegenerateConfig, chat_template: str, model: Any = None,
                 tokenizer: Any = None):
        """chat_template: data.chat_template, what the prompts are rendered with."""
        from eagle3.targets.hf import load_target

        self.rcfg = rc
        if model is None or tokenizer is None:
            model, tokenizer = load_target(target)
            log.info("regenerate: loaded %s (%s, %s)", target.path, target.dtype, target.device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.eos_ids = self._eos_ids()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.template = resolve_template(chat_template, tokenizer)
        # Think tags and call markers are the answer's own format (split_reasoning, parse_tool_calls read them).
        keep = ("<think>", "</think>", *KIMI_MARKERS)
        self._specials = [s for s in tokenizer.all_special_tokens if s not in keep]

    def _eos_ids(self) -> set[int]:
        from eagle3.targets.hf import eos_ids

        ids = set(eos_ids(self.tokenizer, getattr(self.model, "generation_config", None)))
        if not ids:
            raise RuntimeError("regenerate: the target defines no eos_token_id; generation could never stop")
        return ids

    def generate(self, prompts: list[list[int]]) -> list[Answer]:
        """One batched `generate` over left-padded prompts; answers cut at the first EOS."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        threads.adjust()
        r = self.rcfg
        sampling: dict[str, Any] = {"do_sample": False}
        if r.temperature > 0:
            sampling = {"do_sample": True, "temperature": r.temperature, "top_p": r.top_p}
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=r.max_tokens,
                pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids), **sampling,
            )
        answers = []
        for row in out[:, width:].tolist():
            stop = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            new = row if stop is None else row[:stop]
            # Keep special tokens while decoding so `<think>` and Kimi's call markers survive where they are
            # special tokens, read the calls, then drop the other special tokens from the text.
            text = self.tokenizer.decode(new, skip_special_tokens=False)
            parsed = parse_tool_calls(text, self.template.tool_style)
            content, reasoning = split_reasoning(self._strip_specials(parsed.content))
            finish = "length" if stop is None else "tool_calls" if parsed.tool_calls else "stop"
            answers.append(Answer(content, reasoning, finish, len(new), tool_calls=parsed.tool_calls,
                                  malformed_tool_calls=parsed.malformed))
        return answers

    def _strip_specials(self, text: str) -> str:
        for s in self._specials:
            text = text.replace(s, "")
        return text

    def outcomes(self, dialogues: Iterable[Dialogue]) -> Iterator[Outcome]:
        """Up to `batch_size` conversations in flight; each round generates the next answer of every one of
        them, and a finished conversation's slot is refilled at once, so rounds stay full."""
        dialogues = list(dialogues)
        check_renders_tools(self.tokenizer, self.template, sum(d.source.has_tools for d in dialogues),
                            len(dialogues), "conversations to regenerate")
        it = iter(dialogues)
        active: list[tuple[Dialogue, list[int]]] = []
        while True:
            while len(active) < self.rcfg.batch_size and (d := next(it, None)) is not None:
                item = self._next(d)
                if isinstance(item, Outcome):
                    yield item
                else:
                    active.append((d, item))
            if not active:
                return
            try:
                answers = self.generate([ids for _, ids in active])
            except Exception as e:  # noqa: BLE001 - a failed batch is recorded as failed, the run goes on
                log.exception("regenerate: generating for %d conversations failed", len(active))
                yield from (Outcome(d.source.id, error=f"{type(e).__name__}: {e}", attempts=1) for d, _ in active)
                active = []
                continue
            still: list[tuple[Dialogue, list[int]]] = []
            for (d, ids), ans in zip(active, answers, strict=True):
                ans.prompt_tokens = len(ids)
                d.add_answer(ans)
                item = self._next(d)
                if isinstance(item, Outcome):
                    yield item
                else:
                    still.append((d, item))
            active = still

    def _next(self, d: Dialogue) -> list[int] | Outcome:
        """The next prompt's token ids, or the conversation's outcome when it is finished (or cannot render)."""
        try:
            history = d.next_prompt()
            if history is None:
                return d.outcome()
            ids = render_prompt(history, self.tokenizer, self.template, self.rcfg.thinking, tools=d.tools)
        except Exception as e:  # noqa: BLE001 - e.g. a template error on this conversation only
            return Outcome(d.source.id, error=f"rendering the prompt: {type(e).__name__}: {e}", attempts=1)
        if d.max_length is not None and len(ids) >= d.max_length and any(t.role == "assistant" for t in d.history):
            d.end_with_last_answer()  # the prompt alone is past max_length: end with the answers so far
            return d.outcome()
        return ids
