"""Exact trace replay: what each drafter, and each rule choosing among them per step, would accept on a greedy run.

Under greedy decoding a draft's accepted length is its common prefix with the target's own continuation, and the
continuation does not depend on the drafts (speculative decoding is lossless). So one greedy trace per turn (the
prompt and the target's answer) decides, for every drafter and every position, how much a draft there would accept;
a decoding run is then a walk over the trace: at a round whose root is at position m (the last token the target
produced), the rule picks a drafter, its draft accepts `a` tokens, and the next root is at m + a + 1. Tokens per
target forward (the prefill included, one forward per round) compares methods as the engines count them.

The drafters, as the engines draft (eagle3.engines.vllm_eval runs them in vLLM with the same settings):
- `head`: the EAGLE-3 head's k-token chain. Its draft at every position of the trace comes from one unrolled forward
  (the training-time test, eagle3.ttt): step j at position t reads the head's own hidden state of step j-1 and the
  trace's token x_{t+1+j}, and predicts x_{t+2+j}. A draft token counts only while those before it were accepted, so
  the trace's tokens are exactly the tokens the head drafted itself, and the unroll's attention is inference's (the
  prefix from the target's states, the chain from the head's own): the replay's drafts are the engine's.
- `ngram`: vLLM's prompt lookup (eagle3.specdec.ngram_match: the longest n-gram, min_n..max_n, ending the context
  that occurred earlier, its earliest occurrence).
- `suffix`: arctic-inference's suffix tree as vLLM's `method=suffix` feeds it (v1/spec_decode/suffix_decoding.py):
  each request's prompt in its own tree, every response, token by token as the steps produce it, in one global tree
  shared by all requests in the run's order; a chain of at most `max_tokens`, cut where the path's probability falls
  under min_token_prob. It is built by scripts/setup_suffix_decoding.sh (`suffix_tree()` says where it looks).

    replayer = Replayer(k=3, rules=default_rules(3))
    for trace in traces:                     # in the run's order: the global suffix tree learns as it goes
        replayer.add(trace, head_chains(draft, aux, trace.tokens, 3))
    replayer.table()                         # tokens per forward, per rule, per set and category
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3.engines.hybrid_rule import (
    MODEL_FREE,
    common_prefix,
    ngram_match,
    router_gain,
    signals,
    suffix_cache_class,
)


def suffix_tree() -> Any:
    """arctic-inference's SuffixDecodingCache class (eagle3.engines.hybrid_rule.suffix_cache_class): an ImportError
    saying how to build it where it is missing."""
    return suffix_cache_class()


@dataclass
class Trace:
    """One greedy turn: its prompt, the target's answer, and where it belongs on the card."""

    prompt: list[int]
    output: list[int]
    set: str = ""
    category: str = ""
    stop: int | None = None
    """How many output tokens the run keeps (max_new_tokens, or up to its stop token); `output` may go on past it:
    an engine's last round verifies drafts past where the run stops and counts those it accepts, which the replay
    can only count where the trace holds the target's tokens there. None: all of `output`."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Proposal:
    """One drafter's draft at one round: its tokens, how many the target accepts, and the features a rule reads."""

    tokens: list[int]
    accepted: int = 0
    score: float = 0.0
    """The suffix tree's score (the sum of its tokens' path probabilities); 0 for the others."""
    match: int = 0
    """The length of the context suffix the draft was looked up by (n-gram's n, the suffix tree's match length)."""
    probs: list[float] = field(default_factory=list)
    """The drafter's own probability of each draft token (the head's softmax), where it has one."""


@dataclass
class HeadChains:
    """The head's chain after every position of a trace (`head_chains`)."""

    tokens: torch.Tensor
    """[T, k] target ids: row t is the chain drafted after position t (-1 past the trace's end)."""
    probs: torch.Tensor
    """[T, k]: the head's softmax probability of each of those tokens (its top one: the chains are greedy)."""


Rule = Callable[[dict[str, Proposal]], str]
"""Picks, from each drafter's proposal at a round, the drafter whose draft the target verifies."""


def accepted_length(draft: list[int], truth: list[int]) -> int:
    """The common prefix of a draft and the target's continuation: what greedy verification accepts."""
    return common_prefix(draft, truth)


@torch.inference_mode()
def head_chains(draft: Any, aux: torch.Tensor, tokens: list[int], k: int, extra: torch.Tensor | None = None,
                ) -> HeadChains:
    """The head's chain after each position t, predicting x_{t+2}..x_{t+1+k}, and its probabilities (one TTT unroll
    of k steps over the trace). `draft`: an eagle3.model.Eagle3Draft; `aux`: the target's [T, 3H] states over
    `tokens`; `extra`: the embeddings of ids past the vocab (image rows)."""
    from eagle3.rows import plan_rows

    t = len(tokens)
    ids = torch.tensor([tokens], dtype=torch.long, device=aux.device)
    rows = plan_rows(torch.ones(1, t, dtype=torch.long), torch.zeros(1, t, dtype=torch.long), k, False)
    dtype = next(iter(draft.parameters())).dtype
    logits = draft(aux.to(dtype)[None], ids, rows.to(aux.device), extra=extra)
    out = torch.full((t, k), -1, dtype=torch.long)
    probs = torch.zeros(t, k)
    for j, lg in enumerate(logits):
        pos = rows.keep[j][rows.score[j]].cpu()
        top = lg.float().softmax(-1).max(-1)
        out[pos, j] = draft.draft_to_target(top.indices).cpu()
        probs[pos, j] = top.values.cpu()
    return HeadChains(out, probs)


class Drafter:
    """One drafting method over one trace at a time: `start` a turn, `propose` at a root, `observe` what the round
    produced (the suffix tree learns from it), `stop` the turn."""

    def start(self, trace: Trace, chains: HeadChains | None) -> None: ...

    def propose(self, context: list[int]) -> Proposal:
        """The draft after `context` (which ends with the round's root), its `accepted` left for `walk`."""
        raise NotImplementedError

    def observe(self, tokens: list[int]) -> None: ...

    def stop(self) -> None: ...


class HeadDrafter(Drafter):
    """The head's chain at the round's root, read off the trace's unroll (`head_chains`)."""

    def start(self, trace: Trace, chains: HeadChains | None) -> None:
        if chains is None:
            raise ValueError("the head drafter needs the trace's head chains")
        self.chains = chains

    def propose(self, context: list[int]) -> Proposal:
        row = self.chains.tokens[len(context) - 2].tolist()
        tokens = [t for t in row if t >= 0]
        return Proposal(tokens, probs=self.chains.probs[len(context) - 2, :len(tokens)].tolist())


class NgramDrafter(Drafter):
    """vLLM's prompt lookup, k tokens, n-grams of min_n..max_n (eval.ngram_min / ngram_max)."""

    def __init__(self, k: int, min_n: int = 2, max_n: int = 4):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, context: list[int]) -> Proposal:
        n, tokens = ngram_match(context, self.k, self.min_n, self.max_n)
        return Proposal(tokens, match=n)


class SuffixDrafter(Drafter):
    """vLLM's suffix decoding: one global tree of the run's responses (requests in order), each prompt in a tree of
    its own; vLLM's defaults (tree depth 24, 10,000 cached responses, spec factor 1, min token prob 0.1)."""

    def __init__(self, max_tokens: int, depth: int = 24, cached: int = 10_000, factor: float = 1.0,
                 min_prob: float = 0.1):
        self.cache = suffix_tree()(max_tree_depth=depth, max_cached_requests=cached)
        self.max_tokens, self.depth, self.factor, self.min_prob = max_tokens, depth, factor, min_prob
        self.n = 0

    def start(self, trace: Trace, chains: HeadChains | None) -> None:
        self.n += 1
        self.req = f"r{self.n}"
        self.cache.start_request(self.req, trace.prompt)

    def propose(self, context: list[int]) -> Proposal:
        d = self.cache.speculate(self.req, context[-self.depth:], max_spec_tokens=self.max_tokens,
                                 max_spec_factor=self.factor, min_token_prob=self.min_prob)
        return Proposal(list(d.token_ids), score=float(d.score), match=int(d.match_len))

    def observe(self, tokens: list[int]) -> None:
        self.cache.add_active_response(self.req, tokens)

    def stop(self) -> None:
        self.cache.stop_request(self.req)


@dataclass
class Tally:
    """One rule's counters over some traces."""

    generated: int = 0
    forwards: int = 0
    rounds: int = 0
    drafted: int = 0
    """Rounds whose chosen draft held a token (an engine's `num_drafts`)."""
    accepted: int = 0
    chosen: dict[str, int] = field(default_factory=dict)

    def add(self, other: Tally) -> None:
        self.generated += other.generated
        self.forwards += other.forwards
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        for k, v in other.chosen.items():
            self.chosen[k] = self.chosen.get(k, 0) + v

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.forwards if self.forwards else float("nan")


def walk(trace: Trace, drafters: dict[str, Drafter], rule: Rule, chains: HeadChains | None = None,
         steps: list[tuple[str, int]] | None = None) -> Tally:
    """One turn decoded with `rule` choosing among `drafters` each round: the prefill gives the first token, each
    round one target forward. `steps` (optional) collects (chosen drafter, accepted) per round."""
    for d in drafters.values():
        d.start(trace, chains)
    kept = len(trace.output) if trace.stop is None else trace.stop
    tally = Tally(generated=kept, forwards=1)
    tokens, m = trace.tokens, len(trace.prompt)  # the root: the token the prefill produced, at position m
    end = len(trace.prompt) + kept
    for d in drafters.values():
        d.observe(tokens[m:m + 1])
    while m + 1 < end:
        context = tokens[:m + 1]
        truth = tokens[m + 1:]
        props = {}
        for name, d in drafters.items():
            props[name] = p = d.propose(context)
            p.accepted = accepted_length(p.tokens, truth)
        name = rule(props)
        a = props[name].accepted
        tally.forwards += 1
        tally.rounds += 1
        tally.drafted += bool(props[name].tokens)
        tally.accepted += a
        tally.chosen[name] = tally.chosen.get(name, 0) + 1
        if steps is not None:
            steps.append((name, a))
        new = tokens[m + 1:m + 2 + a]
        for d in drafters.values():
            d.observe(new)
        m += a + 1
    for d in drafters.values():
        d.stop()
    return tally


def always(name: str) -> Rule:
    return lambda props: name


def oracle(props: dict[str, Proposal]) -> str:
    """The drafter that accepts most (the head where several tie): the ceiling of any rule over these drafters."""
    return max(props, key=lambda n: (props[n].accepted, n == "head"))


def suffix_if_score(threshold: float) -> Rule:
    """Arctic Inference's pairing: the suffix tree's draft where its score reaches `threshold`, else the head's."""
    return lambda props: "suffix" if props["suffix"].score >= threshold else "head"


def suffix_if_more_expected(props: dict[str, Proposal]) -> str:
    """The draft each drafter expects to be accepted further: the suffix tree's score (the sum of its tokens' path
    probabilities: its expected accepted length under the tree's counts) against the head's own (the sum of the
    products of its tokens' softmax probabilities); the head's where they tie. No fitting: both are expectations."""
    values = features_of(props)
    return "suffix" if props["suffix"].tokens and values["suffix_score"] > values["head_expected"] else "head"


def ngram_if_match(length: int) -> Rule:
    """Prompt lookup where it matched an n-gram of at least `length` tokens, else the head."""
    return lambda props: "ngram" if props["ngram"].tokens and props["ngram"].match >= length else "head"


def features_of(props: dict[str, Proposal]) -> dict[str, float]:
    """A round's signals (eagle3.engines.vllm_hybrid.signals, which owns them) as the engine plugin computes them."""
    sx, ng, hd = props.get("suffix"), props.get("ngram"), props.get("head")
    return signals((sx.tokens, sx.score, sx.match) if sx and sx.tokens else None,
                   (ng.tokens, ng.match) if ng and ng.tokens else None, (hd.tokens, hd.probs) if hd else None)


class Recorder:
    """A rule that follows `rule` and records each round's features and every drafter's accepted length: the
    data a router is fitted on (`fit_router`)."""

    def __init__(self, rule: Rule):
        self.rule, self.rows = rule, []
        self.group = 0
        """Set by the caller before a trace (e.g. its fold): kept with each row."""

    def __call__(self, props: dict[str, Proposal]) -> str:
        self.rows.append((self.group, features_of(props), {n: p.accepted for n, p in props.items()}))
        return self.rule(props)


def fit_router(rows: list[tuple[int, dict[str, float], dict[str, int]]], features: tuple[str, ...] | list[str]
               = MODEL_FREE, ridge: float = 1.0) -> dict[str, list[float]]:
    """Per model-free drafter, the least-squares weights (ridge) predicting its accepted length minus the head's
    from a round's `features` (a constant last): a router that takes the drafter with the largest predicted gain,
    the head where none is positive (`learned`)."""
    x = torch.tensor([[f[n] for n in features] + [1.0] for _, f, _ in rows], dtype=torch.float64)
    reg = ridge * torch.eye(x.shape[1], dtype=torch.float64)
    reg[-1, -1] = 0.0  # the constant is not shrunk
    out = {}
    for name in sorted({n for _, _, acc in rows for n in acc} - {"head"}):
        y = torch.tensor([acc[name] - acc["head"] for _, _, acc in rows], dtype=torch.float64)
        out[name] = torch.linalg.solve(x.T @ x + reg, x.T @ y).tolist()
    return out


def learned(weights: dict[str, list[float]], features: tuple[str, ...] | list[str] = MODEL_FREE) -> Rule:
    """The router `fit_router` fitted: the model-free draft with the largest predicted gain over the head's where
    that gain is positive, else the head's."""
    def rule(props: dict[str, Proposal]) -> str:
        values = features_of(props)
        gains = {d: router_gain(w, values, features) for d, w in weights.items() if d in props and props[d].tokens}
        best = max(gains, key=gains.__getitem__, default=None)
        return best if best is not None and gains[best] > 0 else "head"

    return rule


def engine_rule(rule: dict[str, Any]) -> Rule:
    """The replay of a rule as the engine plugins read it (eagle3.engines.hybrid_rule.parse_rule's dict; the n-gram
    drafter's own lookup range stands for the rule's)."""
    kind = rule["rule"]
    if kind == "suffix-score":
        return suffix_if_score(float(rule["threshold"]))
    if kind == "ngram-match":
        return ngram_if_match(int(rule["length"]))
    if kind == "router":
        return learned(rule["weights"], rule.get("features", MODEL_FREE))
    return always("head")


def default_rules(k: int, suffix: bool = True) -> dict[str, Rule]:
    """The single methods and the rules over them the card compares (`suffix`: the suffix tree is available)."""
    rules: dict[str, Rule] = {"head": always("head"), "ngram": always("ngram")}
    if suffix:
        rules |= {"suffix": always("suffix"), f"suffix-score>={k}": suffix_if_score(k),
                  "suffix-score>=1": suffix_if_score(1.0), "suffix-score>head": suffix_if_more_expected}
    rules |= {"ngram-match>=3": ngram_if_match(3), "ngram-match>=4": ngram_if_match(4), "oracle": oracle}
    return rules


class Replayer:
    """Every rule over the same traces, each with drafters of its own (a suffix tree learns from the rounds its own
    run produced), traces taken in the run's order; tallies per (set, category)."""

    def __init__(self, k: int, rules: dict[str, Rule], make_drafters: Callable[[], dict[str, Drafter]] | None = None,
                 suffix_tokens: int | None = None, suffix: bool = True):
        """Each rule's drafters: `make_drafters()`, or the head, n-gram and (`suffix`) the suffix tree with at most
        `suffix_tokens` tokens (default k)."""
        def default() -> dict[str, Drafter]:
            out: dict[str, Drafter] = {"head": HeadDrafter(), "ngram": NgramDrafter(k)}
            if suffix:
                out["suffix"] = SuffixDrafter(suffix_tokens or k)
            return out

        self.rules = rules
        self.drafters = {r: (make_drafters or default)() for r in rules}
        self.tallies: dict[tuple[str, str, str], Tally] = {}

    def add(self, trace: Trace, chains: torch.Tensor | None) -> dict[str, Tally]:
        out = {}
        for r, rule in self.rules.items():
            t = walk(trace, self.drafters[r], rule, chains)
            out[r] = t
            for key in ((trace.set, "", r), (trace.set, trace.category, r)):
                self.tallies.setdefault(key, Tally()).add(t)
        return out

    def rows(self) -> Iterable[tuple[str, str, dict[str, Tally]]]:
        """(set, category, {rule: tally}) for each set, then its categories."""
        groups = sorted({(s, c) for s, c, _ in self.tallies}, key=lambda x: (x[0], x[1] != "", x[1]))
        for s, c in groups:
            if c == "" or len({cc for ss, cc, _ in self.tallies if ss == s and cc}) > 1:
                yield s, c, {r: self.tallies[(s, c, r)] for r in self.rules}
