"""The hybrid drafter inside vLLM: each round, per request, the EAGLE-3 head's draft or a model-free one.

    pip install eagle3 (into vLLM's environment; or eagle3's folder on its PYTHONPATH with an entry point, as
    eagle3.engines.vllm_eval does), then serve the head as usual with two more settings:
    EAGLE3_HYBRID='{"rule": "suffix-score", "threshold": 1}' vllm serve TARGET --speculative-config \
        '{"method": "eagle3", "model": HEAD, "num_speculative_tokens": 3, "disable_padded_drafter_batch": true}'

vLLM runs one speculative method per server. This module is a `vllm.general_plugins` entry point (pyproject.toml)
that vLLM loads in every process; with EAGLE3_HYBRID set it wraps the model runner's `propose_draft_token_ids`:
the head drafts as always (its KV cache and state stay whole), a model-free drafter proposes beside it, and a rule
picks one draft per request. The target verifies whatever it is handed, so greedy output is the target's own
(lossless), and the draft probabilities vLLM keeps for probabilistic verification are dropped, so only greedy
drafts (`draft_sample_method` greedy, vLLM's default) are served.

Rules (eagle3.replay measures the same ones on traces, benchmarks/bench_hybrid.py):
- `{"rule": "suffix-score", "threshold": t}`: suffix decoding's draft (arctic-inference's tree, fed as vLLM's
  `method=suffix` feeds it, its `suffix_decoding_*` settings) where its score reaches t, else the head's;
- `{"rule": "ngram-match", "length": L, "max": M}`: prompt lookup's draft (vLLM's own matcher) where an n-gram of
  L..M tokens ending the context occurred earlier, else the head's;
- `{"rule": "router", "features": [...], "weights": {"suffix": [...], "ngram": [...]}}`: a linear router over a
  round's signals (`features`, names from FEATURES; the model-free ones by default; a constant last in each weight
  list): the draft with the largest predicted gain in accepted tokens over the head's where it is positive, else
  the head's. The head's own signals (`head_p1`, `head_expected`) are the probabilities its softmax gave its draft
  tokens, read off the proposer's logits (vLLM computes them and drops them in greedy mode). Fitted on traces by
  eagle3.replay.fit_router (benchmarks/bench_hybrid.py writes one; `eagle3 export --hybrid` puts it beside the head);
- `{"rule": "head"}`: the head's alone, through this path (the control).
EAGLE3_HYBRID holds the rule as JSON, or the path of a JSON file holding it, or `auto`: the rule `eagle3 export
--hybrid RULE` wrote into the exported head's folder (RULE_FILE), so one command serves the head with its router:
    EAGLE3_HYBRID=auto vllm serve TARGET --speculative-config '{"method": "eagle3", "model": EXPORT, ...}'

Only the standard library and vLLM are imported (vLLM's environment need not hold eagle3's dependencies), and only
vLLM 0.32.0 is patched: another version is refused by name, since the runner's internals this relies on change
between releases (`disable_padded_drafter_batch`: drafts as lists, sampled tokens on the host).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from eagle3.engines.hybrid_rule import (
    ENV,
    HEAD_PROBS,
    RULE_FILE,
    SuffixTrees,
    exported_rule,
    ngram_range,
    pick,
    settings,
    suffix_dir,
    uses_suffix,
)

TESTED = ("0.32.0",)
log = logging.getLogger("eagle3.hybrid")


def register() -> None:
    """vLLM's general-plugin hook: patches the model runner where EAGLE3_HYBRID is set (idempotent)."""
    rule = settings()
    if rule is None:
        return
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    version = getattr(vllm, "__version__", "?").split("+")[0]
    if version not in TESTED:
        raise RuntimeError(f"eagle3's hybrid drafter was tested on vLLM {', '.join(TESTED)}, not {version}: unset "
                           f"{ENV} to serve the head alone")
    if getattr(GPUModelRunner.propose_draft_token_ids, "eagle3_hybrid", False):
        return
    inner = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self: Any, scheduler_output: Any, sampled_token_ids: Any, *args: Any,
                                **kwargs: Any) -> Any:
        spec = self.speculative_config
        if spec is None or not spec.use_eagle():
            return inner(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        hybrid = getattr(self, "_eagle3_hybrid", None)
        if hybrid is None:
            hybrid = self._eagle3_hybrid = Hybrid(self.vllm_config, rule, self.drafter)
        hybrid.head_probs.clear()
        drafts = inner(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        self._draft_probs = None  # another draft than the head's: its probabilities no longer describe it
        self._draft_prob_req_ids = None
        return hybrid.choose(drafts, self.input_batch, sampled_token_ids)

    propose_draft_token_ids.eagle3_hybrid = True  # type: ignore[attr-defined]
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    log.info("eagle3 hybrid drafter: %s", rule)


class Hybrid:
    """The model-free drafter a rule names, and the per-request choice."""

    def __init__(self, vllm_config: Any, rule: dict[str, Any], proposer: Any = None):
        spec = vllm_config.speculative_config
        if rule["rule"] == "auto":
            rule = exported_rule(spec.model)
            log.info("eagle3 hybrid drafter: %s (%s)", rule, Path(spec.model) / RULE_FILE)
        if not spec.disable_padded_drafter_batch:
            raise ValueError(f"{ENV} needs speculative_config.disable_padded_drafter_batch=true (the drafts per "
                             "request as lists, the sampled tokens on the host)")
        if getattr(spec, "draft_sample_method", "greedy") not in ("greedy", None):
            raise ValueError(f"{ENV} serves greedy drafts only: speculative_config.draft_sample_method is "
                             f"{spec.draft_sample_method!r}")
        self.rule = rule
        self.k = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.head_probs: list[Any] = []
        """The head's draft-token probabilities of this round, one [requests] tensor per draft step."""
        self._warned = False
        self.watching = rule["rule"] == "router" and bool(set(rule["features"]) & set(HEAD_PROBS))
        if self.watching:
            self._watch(proposer)
        self.ngram_range = ngram_range(self.rule)
        self.suffix = None
        if uses_suffix(self.rule):
            self.suffix = SuffixTrees(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                                      spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)

    def choose(self, drafts: Any, batch: Any, sampled: list[list[int]]) -> list[list[int]]:
        head = drafts.tolist() if hasattr(drafts, "tolist") else [list(d) for d in drafts]
        n = len(head)
        suffix = self._suffix(batch, sampled) if self.suffix is not None else [None] * n
        ngram = self._ngram(batch, sampled, *self.ngram_range) if self.ngram_range else [None] * n
        probs = self._head(n)
        out = []
        for h, p, sx, ng, s in zip(head, probs, suffix, ngram, sampled, strict=True):
            if not s:  # a partial prefill: no draft, as vLLM's own drafters
                out.append([])
                continue
            other = pick(self.rule, h, p, sx, (ng[1], ng[0]) if ng else None)
            out.append(other if other is not None else h)
        return out

    def _watch(self, proposer: Any) -> None:
        """Keeps the top probability of each draft step's logits: the EAGLE proposer's greedy path computes the
        head's logits (`model.compute_logits`, once per draft step, a row per request) and keeps only their argmax."""
        model = getattr(proposer, "model", None)
        if model is None or getattr(proposer, "use_local_argmax_reduction", False):
            raise ValueError(f"{ENV}: a router on the head's confidence needs vLLM's EAGLE proposer computing full "
                             "logits (not use_local_argmax_reduction)")
        logits_of = model.compute_logits

        def compute_logits(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            logits = logits_of(hidden_states, *args, **kwargs)
            self.head_probs.append(logits.float().softmax(-1).amax(-1).cpu())
            return logits

        model.compute_logits = compute_logits

    def _head(self, n: int) -> list[list[float]]:
        """Per request, the head's draft-token probabilities of this round (empty lists where none were kept)."""
        if not self.watching:
            return [[] for _ in range(n)]
        if len(self.head_probs) != self.k:
            if not self._warned:
                log.warning("eagle3 hybrid: %d head logits kept for %d draft steps: the router reads no head "
                            "confidence this round", len(self.head_probs), self.k)
                self._warned = True
            return [[] for _ in range(n)]
        import torch

        return torch.stack([p[:n] for p in self.head_probs], dim=1).tolist()

    def _suffix(self, batch: Any, sampled: list[list[int]]) -> list[tuple[list[int], float, int] | None]:
        """vLLM's `method=suffix` proposer (v1/spec_decode/suffix_decoding.py): per request (its draft, score, match
        length), None where it has none."""
        out: list[tuple[list[int], float, int] | None] = []
        for i, ids in enumerate(sampled):
            num_tokens = int(batch.num_tokens_no_spec[i])
            if not ids or num_tokens >= self.max_model_len:
                out.append(None)
                continue
            out.append(self.suffix.propose(batch.req_ids[i], batch.token_ids_cpu[i, :batch.num_prompt_tokens[i]], ids,
                                           batch.token_ids_cpu[i, :num_tokens],
                                           min(self.k, self.max_model_len - num_tokens - 1)))
        self.suffix.retire(batch.req_id_to_index.keys())
        return out

    def _ngram(self, batch: Any, sampled: list[list[int]], lo: int, hi: int) -> list[tuple[int, list[int]] | None]:
        """vLLM's prompt lookup (its own matcher): per request (the matched n-gram's length, its draft) for the
        longest n-gram of lo..hi tokens ending the context that occurred earlier, None where none did. The matcher
        takes the longest match capped at its max, so asked for exactly n tokens it finds one iff the longest is
        at least n long, and the same draft."""
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as match

        out: list[tuple[int, list[int]] | None] = []
        for i, ids in enumerate(sampled):
            num_tokens = int(batch.num_tokens_no_spec[i])
            found = None
            if ids and num_tokens < self.max_model_len:
                context = batch.token_ids_cpu[i, :num_tokens]
                for n in range(hi, lo - 1, -1):
                    d = match(context, n, n, self.max_model_len, self.k)
                    if len(d):
                        found = (n, [int(t) for t in d])
                        break
            out.append(found)
        return out


# ------------------------------------------------------------------------------------ eagle3's side (not vLLM's)
def child_hybrid_args(env: dict[str, str], folder: Path, method: str) -> list[str]:
    """vLLM's processes find eagle3's hybrid plugin as an installed package's `vllm.general_plugins` entry point
    would offer it: eagle3's folder and, in `folder`, a distribution's metadata naming the entry point
    (importlib.metadata reads `*.dist-info` on the path), so nothing is installed into vLLM's environment. The suffix
    tree (scripts/setup_suffix_decoding.sh) goes on the path too where it was built. -> the vLLM child's arguments
    (eagle3.engines.vllm_eval) that make the plugin read the rule exported beside the head (EAGLE3_HYBRID=auto)."""
    if method != "eagle3":
        raise ValueError(f"the hybrid drafter pairs the head with a model-free drafter: method {method!r}")

    dist = folder / "eagle3_hybrid-0.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: eagle3-hybrid\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\neagle3_hybrid = eagle3.engines.vllm_hybrid:register\n")
    paths = [str(folder), str(Path(__file__).resolve().parents[2]), str(suffix_dir()), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(x for x in paths if x)
    return ["--hybrid", "auto"]  # the rule: exported beside the head (eagle3.engines.vllm_eval)
