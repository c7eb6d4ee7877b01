"""The hybrid drafter inside SGLang: each round, per request, the EAGLE-3 head's chain or a model-free one.

    eagle3 export --to sglang --hybrid router.json CHECKPOINT EXPORT      # the rule beside the head
    EAGLE3_HYBRID=auto PYTHONPATH=.vllm-suffix python -m sglang.launch_server --model-path TARGET \
        --speculative-algorithm EAGLE3 --speculative-draft-model-path EXPORT --speculative-num-steps 3 \
        --speculative-eagle-topk 1 --speculative-num-draft-tokens 4

SGLang 0.5.23 runs one speculative algorithm per server, and a registered custom algorithm is not an EAGLE-3 one
to its scheduler (the aux-state capture, the draft's token map and KV sizing all ask `is_eagle3()`). So the server
stays an EAGLE-3 server, and this `sglang.srt.plugins` entry point (pyproject.toml; SGLang loads it in every
process) wraps `EagleDraftWorker.draft` through SGLang's HookRegistry where EAGLE3_HYBRID is set: the head drafts
its chain as always (its KV cache and hidden states stay whole; the next round's draft extend reads the target's
verified tokens, not the draft's), a model-free drafter proposes beside it, and the rule's choice overwrites that
request's row of the verify input's `draft_token` ([requests, 1 + k]: the last verified token, then the chain)
before the target verifies it. The tree mask, positions and retrieve indices depend only on the chain's shape, so
the target verifies the new tokens as it would the head's; greedy output is the target's own. A model-free chain
shorter than k keeps the head's tokens behind it (SGLang verifies a fixed width): a token there is accepted only
where it is the target's own next token, so it can only add.

The rules, the signals and the model-free drafters are eagle3.engines.hybrid_rule's (shared with the vLLM plugin
and eagle3.replay): suffix decoding as vLLM's `method=suffix` runs it, prompt lookup by vLLM's rule. The head's
softmax probabilities are not read here (SGLang's topk-1 chain keeps none: its draft steps set them to 1), so a
router on `head_p1` / `head_expected` is refused; one on the model-free signals and the drafts' agreement with the
head's is served.

Only the standard library, torch and SGLang are imported (SGLang's environment need not hold eagle3's
dependencies), and only SGLang 0.5.23 is patched: another version is refused by name at the first draft, since the
worker's internals this relies on change between releases. Greedy only: an SGLang server on a CPU verifies
greedily anyway; on a GPU at temperature > 0 the chain's probabilities would not describe a replaced chain, so a
sampling request is refused.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from eagle3.engines.hybrid_rule import (
    ENV,
    HEAD_PROBS,
    RULE_FILE,
    SuffixTrees,
    exported_rule,
    ngram_match,
    ngram_range,
    pick,
    settings,
    uses_suffix,
)

TESTED = ("0.5.23",)
TARGET = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.draft"
"""The method wrapped: the EAGLE-3 draft worker's round (v2, the only EAGLE worker 0.5.23 has)."""
ENTRY_POINT = "eagle3_hybrid"
"""Its name in the `sglang.srt.plugins` group."""


def _say(msg: str) -> None:
    """Server-side log line (SGLang owns the logging config)."""
    print(f"[eagle3 hybrid pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


def plugin() -> None:
    """The `sglang.srt.plugins` entry point: wraps the EAGLE draft worker's round where EAGLE3_HYBRID is set."""
    rule = settings()
    if rule is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, around_draft, HookType.AROUND)
    _say(f"hybrid drafter: {rule}")


def around_draft(original: Any, worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's HookRegistry AROUND hook on `EagleDraftWorker.draft`: the head's round, then the rule's choice
    written into the verify input. A misconfigured server fails at its first draft, naming why."""
    out = original(worker, batch, *args, **kwargs)
    hybrid = worker.__dict__.get("_eagle3_hybrid")
    if hybrid is None:
        hybrid = worker._eagle3_hybrid = Hybrid(worker)
    hybrid.apply(batch, out[0] if isinstance(out, tuple) else out)
    return out


class Hybrid:
    """One draft worker's rule, model-free drafters and per-request state."""

    def __init__(self, worker: Any):
        import sglang

        version = getattr(sglang, "__version__", "?").split("+")[0]
        if version not in TESTED:
            raise RuntimeError(f"eagle3's hybrid drafter was tested on SGLang {', '.join(TESTED)}, not {version}: "
                               f"unset {ENV} to serve the head alone")
        if type(worker).__name__ != "EagleDraftWorker":
            raise ValueError(f"{ENV} pairs an EAGLE-3 head's chain with a model-free one: this server's draft worker "
                             f"is {type(worker).__name__}")
        if worker.topk != 1 or worker.speculative_num_draft_tokens != worker.speculative_num_steps + 1:
            raise ValueError(f"{ENV} serves a chain: --speculative-eagle-topk 1 and --speculative-num-draft-tokens = "
                             f"--speculative-num-steps + 1 (got topk {worker.topk}, {worker.speculative_num_steps} "
                             f"steps, {worker.speculative_num_draft_tokens} draft tokens)")
        rule = settings() or {}
        if rule.get("rule") == "auto":
            head = worker.server_args.speculative_draft_model_path
            rule = exported_rule(head)
            _say(f"hybrid drafter: {rule} ({Path(head) / RULE_FILE})")
        if rule["rule"] == "router" and set(rule["features"]) & set(HEAD_PROBS):
            raise ValueError(f"{ENV}: SGLang's topk-1 chain keeps no probabilities of the head's tokens: a router on "
                             f"{sorted(set(rule['features']) & set(HEAD_PROBS))} is served by vLLM only (fit one on "
                             "the other features for SGLang)")
        self.rule, self.k = rule, worker.speculative_num_steps
        self.suffix = SuffixTrees() if uses_suffix(rule) else None
        self.ngram_range = ngram_range(rule)
        self.fed: dict[str, int] = {}
        """Per request, how many of its output tokens the suffix tree has seen."""

    def apply(self, batch: Any, verify: Any) -> None:
        """Overwrites, per request the rule hands to a model-free drafter, its chain in `verify.draft_token`."""
        import torch

        reqs = list(getattr(batch, "reqs", None) or [])
        if not reqs or batch.forward_mode.is_idle():
            return
        if any(r.sampling_params.top_k != 1 for r in reqs) and self.rule["rule"] != "head":  # SGLang: greedy = top-k 1
            raise ValueError(f"{ENV} serves greedy requests only (temperature 0): a replaced chain has no draft "
                             "probabilities for sampled verification")
        k = self.k
        tokens = verify.draft_token.view(len(reqs), k + 1)
        rows = tokens.tolist()
        for i, req in enumerate(reqs):
            prompt = list(getattr(req, "origin_input_ids_unpadded", None) or req.origin_input_ids)
            output = list(req.output_ids)
            context = prompt + output
            if not output or context[-1] != rows[i][0]:
                raise RuntimeError(f"{ENV}: request {req.rid}'s last token {context[-1:]} is not the verify row's "
                                   f"root {rows[i][0]}: SGLang's batch layout is not the one this plugin was "
                                   "written for")
            new = output[self.fed.get(req.rid, 0):]
            self.fed[req.rid] = len(output)
            sx = self.suffix.propose(req.rid, prompt, new, context, k) if self.suffix is not None else None
            ng = None
            if self.ngram_range is not None:
                n, draft = ngram_match(context, k, *self.ngram_range)
                ng = (draft, n) if n else None
            chain = pick(self.rule, rows[i][1:], [], sx, ng)
            if chain:
                tokens[i, 1:1 + len(chain)] = torch.tensor(chain, dtype=tokens.dtype, device=tokens.device)
        active = {r.rid for r in reqs}
        if self.suffix is not None:
            self.suffix.retire(active)
        for rid in set(self.fed) - active:
            del self.fed[rid]
