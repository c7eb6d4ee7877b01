"""Acceptance measured inside the serving engines, to compare with eagle3's built-in evaluator.

`vllm_eval` runs vLLM offline (in a subprocess, possibly in vLLM's own virtualenv) and reads its spec-decode
counters; `sglang_eval` asks a running SGLang server. Both replay the exact prompts the built-in evaluator used.
Each takes an `EngineRun`: the three things of a run an engine needs (the target it serves, the eval settings, the
run's folders), so both share one call shape and neither sees the data, draft or training sections.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3.config import EvalConfig, TargetConfig
    from eagle3.paths import RunPaths

log = logging.getLogger("eagle3")


@dataclass(frozen=True)
class EngineRun:
    """EngineRun(cfg.target, cfg.eval, cfg.paths)."""

    target: TargetConfig
    eval: EvalConfig
    paths: RunPaths


def prompt_agreement(engine: str, sent: list[int], seen: list[int | None]) -> dict[str, int]:
    """How many prompts the engine read as exactly the tokens it was sent (its own count of prompt tokens vs the
    rendered prompt's), so a τ is never compared across engines that saw different prompts (a chat template
    applied twice, a tokenizer adding a BOS). A disagreement is logged as an error and counted in the report."""
    known = [(a, b) for a, b in zip(sent, seen, strict=True) if b is not None]
    same = sum(a == b for a, b in known)
    if same != len(known):
        first = next(i for i, (a, b) in enumerate(known) if a != b)
        log.error("%s read %d of %d prompts with a different token count than sent (first: prompt %d, %d sent, "
                  "%d read): its τ is not comparable", engine, len(known) - same, len(known), first, *known[first])
    return {"prompts_checked": len(known), "prompts_same_tokens": same}
