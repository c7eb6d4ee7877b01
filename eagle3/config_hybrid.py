"""The hybrid drafter's section of the one schema (`eval.hybrid`), apart from eagle3/config.py, which re-exports it.

    eval:
      engine: vllm
      hybrid: {rule: suffix-score, threshold: 1.0}
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from eagle3.config_sglang import Section


class HybridConfig(Section):
    """eagle3's hybrid drafter (eagle3.engines.vllm_hybrid): each round, per request, the head's draft or a
    model-free one, as `rule` picks; its ceiling on traces: benchmarks/bench_hybrid.py (eagle3.replay)."""

    rule: Literal["suffix-score", "ngram-match", "router"] = "suffix-score"
    """`suffix-score`: suffix decoding's draft (arctic-inference's tree; scripts/setup_suffix_decoding.sh builds it)
    where its score (the sum of its tokens' path probabilities) reaches `threshold`, else the head's;
    `ngram-match`: prompt lookup's draft where an n-gram of at least `length` tokens (up to eval.ngram_max) ending
    the context occurred earlier, else the head's; `router`: the linear router in the file `router` names
    (benchmarks/bench_hybrid.py fits one on traces: `router.json`; on the head's confidence and the model-free
    drafters' signals)."""
    threshold: float = Field(1.0, gt=0)
    """The suffix draft's score from which it is chosen (`suffix-score`)."""
    length: int = Field(3, ge=1)
    """The shortest n-gram match for which prompt lookup's draft is chosen (`ngram-match`)."""
    router: str | None = None
    """`router`: the JSON file holding the router rule (as EAGLE3_HYBRID reads it)."""

    @model_validator(mode="after")
    def _router_file(self) -> HybridConfig:
        if (self.rule == "router") != (self.router is not None):
            raise ValueError("eval.hybrid.router (a router rule's JSON file) goes with rule: router, and only there")
        return self

    def engine_rule(self, ngram_max: int) -> dict[str, Any]:
        """The rule as the vLLM plugin reads it (EAGLE3_HYBRID)."""
        if self.router is not None:
            from eagle3.engines.hybrid_rule import parse_rule

            return parse_rule(self.router, "eval.hybrid.router")
        if self.rule == "suffix-score":
            return {"rule": self.rule, "threshold": self.threshold}
        return {"rule": self.rule, "length": self.length, "max": max(ngram_max, self.length)}
