"""eagle3's hybrid drafter, the part every engine plugin shares: the rule (EAGLE3_HYBRID, or the one exported beside
a head), a round's signals and the router's gain, the choice per request, and the model-free drafters as the engines
run them (arctic-inference's suffix tree fed as vLLM's `method=suffix` feeds it; prompt lookup by vLLM's rule).

Only the standard library is imported here (numpy where prompt lookup runs): the plugins run inside an engine's
environment, which need not hold eagle3's dependencies. eagle3.replay reads the same signals and rules on traces.
The plugins: eagle3.engines.vllm_hybrid (vLLM 0.32.0), eagle3.engines.sglang_hybrid (SGLang 0.5.23).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV = "EAGLE3_HYBRID"
SUFFIX_DIR = Path(__file__).resolve().parents[2] / ".vllm-suffix"
"""Where scripts/setup_suffix_decoding.sh puts arctic-inference's suffix tree by default (git-ignored)."""

MODEL_FREE = ("suffix_score", "suffix_match", "suffix_len", "ngram_match", "ngram_len")
"""The model-free drafters' own signals: the suffix tree's score and match length, prompt lookup's n-gram length,
each draft's length."""
HEAD = ("head_p1", "head_expected", "suffix_agree", "ngram_agree")
"""The head's side: its softmax probability of its first draft token, its draft's expected accepted length under
its own probabilities (the sum over j of p_1 ... p_j), and how many leading tokens the suffix / n-gram draft shares
with the head's (two drafters agreeing is evidence for both)."""
FEATURES = MODEL_FREE + HEAD
"""What a router may read of a round (a rule names the ones it uses, MODEL_FREE by default)."""
HEAD_PROBS = ("head_p1", "head_expected")
"""The features read off the head's softmax: SGLang's topk-1 chain keeps none (eagle3.engines.sglang_hybrid)."""
SGLANG_FEATURES = tuple(f for f in FEATURES if f not in HEAD_PROBS)
"""What a router served in SGLang may read."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two drafts share (what greedy verification accepts of a draft against the truth)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def signals(suffix: tuple[list[int], float, int] | None, ngram: tuple[list[int], int] | None,
            head: tuple[list[int], list[float]] | None) -> dict[str, float]:
    """A round's FEATURES for one request from the suffix draft (tokens, score, match length), the n-gram draft
    (tokens, n) and the head's (tokens, their probabilities); zeros where a drafter has none. eagle3.replay reads
    the same."""
    sx, ng, (hd, p) = suffix or ([], 0.0, 0), ngram or ([], 0), head or ([], [])
    expected, run = 0.0, 1.0
    for q in p:
        run *= q
        expected += run
    return {"suffix_score": float(sx[1]), "suffix_match": float(sx[2]), "suffix_len": float(len(sx[0])),
            "ngram_match": float(ng[1]), "ngram_len": float(len(ng[0])), "head_p1": float(p[0]) if p else 0.0,
            "head_expected": expected, "suffix_agree": float(common_prefix(sx[0], hd)),
            "ngram_agree": float(common_prefix(ng[0], hd))}


def router_gain(weights: list[float], values: dict[str, float], features: tuple[str, ...] | list[str] = MODEL_FREE
                ) -> float:
    """A linear router's predicted gain: `weights` (one per name in `features`, then a constant) on a round's
    `signals`; eagle3.replay fits and replays the same."""
    if len(weights) != len(features) + 1:
        raise ValueError(f"a router's weights are {len(features) + 1} numbers ({', '.join(features)}, constant): got "
                         f"{weights}")
    return sum(w * values[f] for w, f in zip(weights, features)) + weights[-1]


RULE_FILE = "eagle3_hybrid/rule.json"
"""Where `eagle3 export --hybrid` writes the rule inside an exported head's folder: a subfolder, which vLLM ignores
(it refuses unknown tensors in an EAGLE-3 checkpoint, not unknown files)."""


def parse_rule(raw: str, source: str = ENV) -> dict[str, Any]:
    """A hybrid rule from JSON, or from the path of a JSON file; an error naming `source` where it is malformed."""
    raw = raw.strip()
    if not raw.startswith(("{", "[")):
        if not os.path.isfile(raw):
            raise ValueError(f"{source}={raw!r}: neither a JSON rule nor a file holding one")
        with open(raw) as f:
            raw = f.read()
    rule = json.loads(raw)
    kinds = {"suffix-score": ("threshold",), "ngram-match": ("length",), "router": ("weights",), "head": ()}
    if not isinstance(rule, dict) or rule.get("rule") not in kinds:
        raise ValueError(f"{source}={raw!r}: expected {{\"rule\": one of {sorted(kinds)}, ...}}")
    missing = [k for k in kinds[rule["rule"]] if k not in rule]
    if missing:
        raise ValueError(f"{source}: rule {rule['rule']!r} needs {missing}")
    if rule["rule"] == "router":
        features = rule.setdefault("features", list(MODEL_FREE))
        unknown = sorted(set(features) - set(FEATURES))
        if unknown:
            raise ValueError(f"{source}: a router's features are among {list(FEATURES)}: got {unknown}")
        bad = {n: w for n, w in rule["weights"].items() if n not in ("suffix", "ngram") or len(w) != len(features) + 1}
        if bad:
            raise ValueError(f"{source}: a router weighs `suffix` and/or `ngram`, each with {len(features) + 1} "
                             f"numbers ({', '.join(features)}, constant): got {bad}")
    return rule


def settings() -> dict[str, Any] | None:
    """The hybrid's rule from EAGLE3_HYBRID (JSON, or a JSON file's path, or `auto`: the rule exported beside the
    head, read once the head's folder is known), None where unset; a malformed value is an error."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    if raw == "auto":
        return {"rule": "auto"}
    return parse_rule(raw)


def exported_rule(head: str | Path) -> dict[str, Any]:
    """The rule `eagle3 export --hybrid` wrote beside the head in `head` (EAGLE3_HYBRID=auto)."""
    f = Path(head) / RULE_FILE
    if not f.is_file():
        raise ValueError(f"{ENV}=auto: {head} has no {RULE_FILE} (export the head with `eagle3 export --to "
                         f"vllm|sglang --hybrid RULE`, or set {ENV} to the rule itself)")
    return parse_rule(str(f), str(f))


def pick(rule: dict[str, Any], head: list[int], probs: list[float],
         suffix: tuple[list[int], float, int] | None, ngram: tuple[list[int], int] | None) -> list[int] | None:
    """The model-free draft `rule` takes over the head's at one request's round, None where the head's stands.
    `suffix`: the suffix tree's (draft, score, match length); `ngram`: prompt lookup's (draft, n) for the longest
    n-gram it matched; `head`: the head's draft and `probs` its tokens' probabilities (may be empty)."""
    kind = rule["rule"]
    if kind == "suffix-score":
        return suffix[0] if suffix and suffix[0] and suffix[1] >= rule["threshold"] else None
    if kind == "ngram-match":
        return ngram[0] if ngram and ngram[0] and ngram[1] >= int(rule["length"]) else None
    if kind == "router":
        values = signals(suffix, ngram, (head, probs))
        drafts = {"suffix": suffix[0] if suffix else [], "ngram": ngram[0] if ngram else []}
        gains = {n: router_gain(w, values, rule["features"]) for n, w in rule["weights"].items() if drafts.get(n)}
        best = max(gains, key=gains.__getitem__, default=None)
        return drafts[best] if best is not None and gains[best] > 0 else None
    return None


def ngram_range(rule: dict[str, Any]) -> tuple[int, int] | None:
    """The n-gram lengths prompt lookup tries for `rule` (None: the rule reads no n-gram)."""
    if rule["rule"] == "ngram-match":
        lo = int(rule["length"])
        return lo, int(rule.get("max", max(4, lo)))
    if rule["rule"] == "router":
        return int(rule.get("min", 2)), int(rule.get("max", 4))
    return None


def uses_suffix(rule: dict[str, Any]) -> bool:
    return rule["rule"] in ("suffix-score", "router")


def ngram_match(tokens: Sequence[int], k: int, min_n: int = 2, max_n: int = 4) -> tuple[int, list[int]]:
    """vLLM's prompt lookup with the length n of the n-gram it matched: the longest n-gram (max_n down to min_n)
    ending the context that occurred earlier, its earliest occurrence, the k tokens that followed it; (0, []) where
    none did."""
    import numpy as np

    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[: total - 1], n)  # every n-gram ending before the last
        hits = np.flatnonzero((windows == seq[total - n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return n, [int(t) for t in seq[start:start + k]]
    return 0, []


def suffix_dir() -> Path:
    """Where arctic-inference's suffix tree was built: EAGLE3_SUFFIX_DIR, else SUFFIX_DIR."""
    return Path(os.environ.get("EAGLE3_SUFFIX_DIR", SUFFIX_DIR))


def suffix_cache_class() -> Any:
    """arctic-inference's SuffixDecodingCache: installed, or built by scripts/setup_suffix_decoding.sh into
    .vllm-suffix (or the folder EAGLE3_SUFFIX_DIR names), which goes on sys.path here."""
    import importlib
    import sys

    folder = suffix_dir()
    if folder.is_dir() and str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        return importlib.import_module("arctic_inference.suffix_decoding").SuffixDecodingCache
    except ImportError as e:
        raise ImportError(f"arctic-inference's suffix tree does not import ({e}): build it with `PYTHON={sys.executable}"
                          f" bash scripts/setup_suffix_decoding.sh {folder}`") from e


class SuffixTrees:
    """Suffix decoding as vLLM's `method=suffix` runs it (v1/spec_decode/suffix_decoding.py): each request's prompt in
    a tree of its own, every response, as the rounds produce it, in one global tree; vLLM's defaults (tree depth 24,
    10,000 cached responses, spec factor 1, min token prob 0.1)."""

    def __init__(self, depth: int = 24, cached: int = 10_000, factor: float = 1.0, min_prob: float = 0.1):
        self.cache = suffix_cache_class()(max_tree_depth=depth, max_cached_requests=cached)
        self.depth, self.factor, self.min_prob = depth, factor, min_prob

    def propose(self, req: str, prompt: Sequence[int], new: Sequence[int], context: Sequence[int], max_tokens: int
                ) -> tuple[list[int], float, int] | None:
        """After the round that produced `new` (the request's tokens since its last round; `context` ends with them):
        the tree's (draft, score, match length), None where it has none."""
        cache = self.cache
        if req not in cache.active_requests:
            if req in cache.cached_requests:
                cache.evict_cached_response(req)
            cache.start_request(req, prompt)
        cache.add_active_response(req, new)
        d = cache.speculate(req, context[max(0, len(context) - self.depth):], max_spec_tokens=max_tokens,
                            max_spec_factor=self.factor, min_token_prob=self.min_prob)
        return (list(d.token_ids), float(d.score), int(d.match_len)) if d.token_ids else None

    def retire(self, active: set[str] | Any) -> None:
        """Ends the requests that are no longer in the batch (their responses stay in the global tree)."""
        for req in self.cache.active_requests - set(active):
            self.cache.stop_request(req)
