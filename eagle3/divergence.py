"""Why a speculative answer parted from plain greedy decoding: rounding at a near-tie, or a bug.

At temperature 0 speculative decoding must give the target's own greedy text. The two paths run the target on
different shapes (a verify forward over a tree of draft tokens, one token at a time), so in finite precision their
logits differ by rounding, and where the plain path's two best logits are closer than that rounding can move
them, the paths may legitimately pick different tokens. A bug (a stale or shifted KV entry, a wrong position, an
off-by-one in acceptance) moves logits by far more than rounding, and shows where the margin is clear. Both print
the same "output differs" line; the gap at the first differing position tells them apart.

The bound (`near_tie_bound`): a logit is l = w . h, with h the final normed state. On its way there, h goes
through L decoder layers, each adding its output into the residual stream and rounding it to the dtype (unit
roundoff u: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32), plus the final norm and the lm_head: L + 1 roundings of relative
size <= u. Rounding errors of different operations are independent, so they add as a random walk, ~sqrt(L+1) u
of |h| per path; the two paths' errors are independent too (x sqrt 2), and a logit moves by that times |w||h|,
for which the larger of the two logits stands in (at least 1). A 2-3 sigma margin on top gives

    bound = 4 * sqrt(L + 1) * u * max(|l1|, |l2|, 1)

(a 30-layer target with top logits near 20: ~0.4 in bf16, ~3e-5 in float32). A gap within it is a near-tie:
counted and logged at INFO. A gap beyond it is a clear margin: an ERROR naming the prompt, turn, position and gap,
and `eagle3 eval` exits non-zero unless `eval.allow_divergence` is set.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def near_tie_bound(dtype: torch.dtype, num_layers: int, top1: float, top2: float) -> float:
    """How far apart rounding alone can push the plain path's two best logits (see the module docstring)."""
    u = UNIT_ROUNDOFF.get(dtype, 2.0**-8)
    return 4.0 * math.sqrt(num_layers + 1) * u * max(abs(top1), abs(top2), 1.0)


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where the two token lists differ (the shorter one's length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass
class Divergence:
    """Where one turn's speculative output first parts from plain greedy decoding, and by how much the plain path
    preferred its own token there."""

    prompt: str
    turn: int
    position: int
    """Index into the turn's generated tokens."""
    spec_token: int | None
    plain_token: int | None
    gap: float
    """The plain path's top-1 minus top-2 logit at `position` (inf where it had ended)."""
    bound: float

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.bound

    def line(self) -> str:
        what = ("a near-tie (within the dtype's rounding)" if self.near_tie else
                "a CLEAR MARGIN: rounding cannot explain it; an evaluator or head-format bug")
        return (f"{self.prompt} turn {self.turn}: speculative output parts from plain greedy decoding at generated "
                f"token {self.position} (speculative {self.spec_token}, plain {self.plain_token}); the plain path's "
                f"top-2 logit gap there is {self.gap:.3g}, the rounding bound {self.bound:.3g}: {what}")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "near_tie": self.near_tie}


def explain(dec: Any, prompt_id: str, turn: int, prompt: list[int], spec: list[int], plain: list[int],
            num_layers: int, images: list[str] | None = None) -> Divergence:
    """The Divergence of one turn (`dec`: the eagle3.specdec.SpeculativeDecoder that produced both outputs;
    `images`: the prompt's)."""
    p = first_difference(spec, plain)
    spec_tok = spec[p] if p < len(spec) else None
    plain_tok = plain[p] if p < len(plain) else None
    if plain_tok is None:  # the plain path had stopped: nothing it chose between
        return Divergence(prompt_id, turn, p, spec_tok, None, math.inf, 0.0)
    top1, top2 = dec.top2(prompt, plain[:p], images or [])
    return Divergence(prompt_id, turn, p, spec_tok, plain_tok, top1 - top2,
                      near_tie_bound(dec.target.dtype, num_layers, top1, top2))
