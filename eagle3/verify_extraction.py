"""Check extracted hidden states against an independent HF reference forward, and name what went wrong.

    eagle3 verify-extraction --config configs/smollm2-135m.yaml                      # the configured backend
    eagle3 verify-extraction --config configs/smollm2-135m.yaml --source runs/smollm2-135m/cache

The seed's first Kimi drafter trained on mismatched engine states and reached 15% acceptance, worse than no
speculation, and nothing errored. The usual culprits are silent: an engine whose id k means "output of layer k"
(off by one), a final state taken before the final norm, and tokens the engine never returned (prefix caching,
chunked prefill). This compares each sample with HF's own `output_hidden_states` (not eagle3's hooks) and, when
a layer does not match, tries the neighbouring layers and the pre-norm state to say which mistake it is.

PASS: every layer's mean per-token cosine >= 0.99 and its worst token's >= the bar of the states' dtype
(TOKEN_COSINE_MIN: a few wrong tokens, from a stale KV entry or a padding bug, hide in a mean), no neighbouring
layer matches better, final within 10% of the reference scale, and equal token counts; a failing token is named. Exit code 0 on PASS, 1 on FAIL. The same bar holds an fp8 cache
(extract.storage): e4m3 with a scale per token keeps a token's cosine near 0.9995, an adjacent layer's state is
further from the right one than that, and the neighbour test does not depend on the bar (BENCHMARKS.md "fp8 cache").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from eagle3.precision import DTYPES

if TYPE_CHECKING:
    from eagle3.config import Config

log = logging.getLogger("eagle3")

COSINE_MIN = 0.99
SCALE_TOL = 0.10
TOKEN_COSINE_MIN = {torch.float32: 0.999, torch.bfloat16: 0.95, torch.float16: 0.95}
"""The worst single token's cosine per states' dtype: float32 engines agree with HF to ~1e-6, 16-bit ones round
each element to 3-4 significant digits; a token whose state belongs to another position scores far below both."""
FP8_TOKEN_COSINE_MIN = 0.98
"""The same for an fp8 cache (e4m3 with a scale per token and state; BENCHMARKS.md "fp8 cache")."""


@dataclass
class Check:
    name: str
    cosine: float
    min_cosine: float
    max_rel_err: float
    ok: bool
    worst_token: int = -1
    cause: str = ""
    verdict: str = ""
    """The sample-independent diagnosis for the summary line."""


@dataclass
class SampleReport:
    sample_id: str
    prompt_tokens: int
    state_tokens: int
    checks: list[Check] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.causes and all(c.ok for c in self.checks)


def _stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float, float]:
    """(mean per-token cosine, min per-token cosine, max |a-b| / max |b|, ||a|| / ||b|| - 1)."""
    a, b = a.float(), b.float()
    cos = F.cosine_similarity(a, b, dim=-1)
    rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    scale = (a.norm() / b.norm().clamp_min(1e-12)).item() - 1
    return cos.mean().item(), cos.min().item(), rel, scale


def _worst_token(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(F.cosine_similarity(a.float(), b.float(), dim=-1).argmin())


def _gate_worst_token(check: Check, a: torch.Tensor, b: torch.Tensor, token_min: float) -> None:
    """A check whose mean passes but whose worst token does not: name the token (never hidden by the mean)."""
    check.worst_token = _worst_token(a, b)
    if check.ok and check.min_cosine < token_min:
        check.ok = False
        check.cause = f"token {check.worst_token}: cosine {check.min_cosine:.4f} < {token_min} (the mean passes)"
        check.verdict = ("single tokens' states are wrong while the rest match: a stale or shifted KV entry, a "
                         "padding or batching bug, or damaged storage")


@torch.inference_mode()
def reference(model: torch.nn.Module, ids: list[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """HF's `hidden_states` (entry k = input of layer k, last entry post-norm) for one unpadded sequence, and the
    pre-norm final state (only used to diagnose a failing final state)."""
    from eagle3.targets.hf import decoder_parts

    base, _, norm = decoder_parts(model)
    pre: dict[str, torch.Tensor] = {}
    h = norm.register_forward_hook(lambda _m, args, _o: pre.__setitem__("x", args[0]))
    try:
        device = next(model.parameters()).device
        out = base(input_ids=torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
    finally:
        h.remove()
    return tuple(x[0].cpu() for x in out.hidden_states), pre["x"][0].cpu()


def compare(sample_id: str, ids: list[int], aux: torch.Tensor, final: torch.Tensor, layer_ids: list[int],
            hs: tuple[torch.Tensor, ...], prenorm: torch.Tensor, token_min: float | None = None) -> SampleReport:
    """Compare one sample's states with the reference and diagnose mismatches (`token_min`: the worst token's
    cosine bar, by default TOKEN_COSINE_MIN of the states' dtype)."""
    token_min = TOKEN_COSINE_MIN.get(aux.dtype, 0.95) if token_min is None else token_min
    H = hs[0].shape[-1]
    L = len(hs) - 1
    rep = SampleReport(sample_id, len(ids), aux.shape[0])
    T = aux.shape[0]
    if T != len(ids) or final.shape[0] != T:
        rep.causes.append(
            f"missing tokens: states cover {T} (final {final.shape[0]}) of the prompt's {len(ids)} tokens; engines "
            "return only newly computed tokens (disable prefix/radix caching, reassemble chunked prefill)")
        if T > len(ids) or final.shape[0] != T:
            return rep
        hs, prenorm = tuple(x[-T:] for x in hs), prenorm[-T:]  # a cached prefix is missing: compare the tail
    for j, k in enumerate(layer_ids):
        a = aux[:, j * H:(j + 1) * H]
        cos, mn, rel, _ = _stats(a, hs[k])
        near = {d: _stats(a, hs[k + d])[0] for d in (-2, -1, 1, 2) if 0 <= k + d <= L}
        best = max(near, key=near.get) if near else 0
        check = Check(f"aux[{j}] id {k}", cos, mn, rel, cos >= COSINE_MIN)
        if near and near[best] > cos:
            check.ok = False
            what = "off by one" if abs(best) == 1 else f"off by {abs(best)}"
            meaning = "the output of layer k" if best > 0 else f"the input of layer k{best:+d}"
            check.cause = f"matches id {k + best} (cosine {near[best]:.4f}): {what}"
            check.verdict = (f"aux layers {what} (id {best:+d}): the source's id k likely means {meaning}; "
                             "fix the id convention where the states are produced")
        elif not check.ok:
            check.cause = "matches no neighbouring layer either"
            check.verdict = "aux states match no layer: wrong model or weights, dtype overflow, or other token ids"
        _gate_worst_token(check, a, hs[k], token_min)
        rep.checks.append(check)
    cos, mn, rel, scale = _stats(final, hs[L])
    check = Check("final (post-norm)", cos, mn, rel, cos >= COSINE_MIN and abs(scale) <= SCALE_TOL)
    if not check.ok:
        pcos, _, prel, pscale = _stats(final, prenorm)
        if pcos >= COSINE_MIN and abs(pscale) <= SCALE_TOL and pcos > cos:
            check.cause = f"matches the PRE-norm last layer output (cosine {pcos:.4f})"
            check.verdict = "final state is PRE-norm: take it after the final norm (what the lm_head reads)"
        else:
            d = max(range(L), key=lambda i: _stats(final, hs[i])[0])
            dcos = _stats(final, hs[d])[0]
            check.cause = (f"matches id {d} (the input of layer {d}, cosine {dcos:.4f}) better than the final norm "
                           "output" if dcos > cos and dcos >= COSINE_MIN else
                           f"differs from the post-norm state (scale off by {scale:+.1%})")
            check.verdict = "final state does not match the output of the final norm"
    _gate_worst_token(check, final, hs[L], token_min)
    rep.checks.append(check)
    return rep


def _cause_summary(cause: str) -> str:
    if cause.startswith("target_argmax"):
        return "target_argmax: not the target's own argmax (other weights?)"
    return cause.split(":")[0] + ": tokens dropped (prefix caching / chunked prefill?)"


def format_report(reports: list[SampleReport]) -> str:
    lines = []
    for r in reports:
        lines.append(f"sample {r.sample_id}: {r.state_tokens}/{r.prompt_tokens} tokens  {'ok' if r.ok else 'FAIL'}")
        for c in r.checks:
            lines.append(f"  {c.name:<20} cosine {c.cosine:.5f} (min {c.min_cosine:.5f} at token {c.worst_token})  "
                         "max rel err "
                         f"{c.max_rel_err:.2e}  {'ok' if c.ok else 'FAIL'}{'  <- ' + c.cause if c.cause else ''}")
        for cause in r.causes:
            lines.append(f"  FAIL: {cause}")
    causes = sorted({c.verdict for r in reports for c in r.checks if c.verdict}
                    | {_cause_summary(x) for r in reports for x in r.causes})
    if all(r.ok for r in reports):
        lines.append(f"PASS: {len(reports)} sample(s), every layer's cosine >= {COSINE_MIN} on average and its worst "
                     "token's above the dtype's bar, token counts equal")
    else:
        lines.append("FAIL: " + " | ".join(causes))
    return "\n".join(lines)


def _states_from_cache(cache_dir: str, prepared_train: Any, n: int) -> tuple[list, list[int]]:
    from eagle3.cache import HiddenStateDataset
    from eagle3.cache.codec import dense

    ds = HiddenStateDataset(cache_dir, "train", allow_incomplete=True)
    if len(ds) == 0:
        raise ValueError(f"cache {cache_dir} has no train samples yet")
    ids_col = prepared_train["id"]
    rows = []
    for i in range(min(n, len(ds))):
        item = dense(ds[i], ds.dtype)
        if item["sample_id"] not in ids_col:
            raise ValueError(f"cache sample {item['sample_id']!r} is not in the prepared data: different data set")
        prompt = prepared_train[ids_col.index(item["sample_id"])]["input_ids"]
        rows.append((item["sample_id"], prompt, item["aux"], item["final"], item.get("target_argmax")))
    return rows, ds.layer_ids, ds.storage


ARGMAX_REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
"""How far below the max logit a stored argmax's logit may be: a near-tie that another matmul shape may flip, not
a token from other weights."""
FP8_ARGMAX_REL_TOL = 0.1
"""The same for a cache whose final states are fp8: the stored argmax was taken over the exact states, the check
reads the dequantised ones (a few % per element), so the margin is wider; a random lm_head's pick still falls far
below it (tests/test_verify_extraction.py)."""


def check_argmax(report: SampleReport, stored: torch.Tensor, model: torch.nn.Module, final: torch.Tensor,
                 chunk: int, rel_tol: float | None = None) -> None:
    """The cache's target_argmax against the target's own lm_head over the cache's own final states (which the
    layer checks compare with HF's): each stored id must be their argmax, or tie with it within `rel_tol` (by
    default the dtype's rounding)."""
    from eagle3.targets.argmax import lm_head_max

    weight = model.get_output_embeddings().weight
    x = final.to(weight.device, weight.dtype)
    top, _ = lm_head_max(weight, x, chunk)
    n = min(len(stored), len(top))
    ids = stored[:n].to(weight.device).long()
    picked = (x[:n] * weight[ids]).sum(-1).float()
    tol = rel_tol if rel_tol is not None else ARGMAX_REL_TOL.get(weight.dtype, 2e-2)
    near = picked >= top[:n] - tol * top[:n].abs().clamp(min=1.0)
    if not bool(near.all()):
        bad = int((~near).sum())
        report.causes.append(f"target_argmax: {bad} of {n} stored ids are not the target lm_head's argmax (nor a "
                             "near-tie): the cache was extracted with other weights, or its states were changed")


def run(cfg: Config, source: str = "backend", num_samples: int = 4, backend: Any = None) -> int:
    """Verify `source` ('backend' or a cache folder) on `num_samples` prepared samples; 0 on PASS, 1 on FAIL."""
    from eagle3.bundled import resolve_target_path
    from eagle3.data.prepared import load_prepared
    from eagle3.targets.hf import HFTarget, load_causal_lm

    prepared = load_prepared(cfg.prepared_dir)
    model = None
    storage = "exact"
    if source == "backend":
        if backend is None:
            from eagle3.targets import make_backend

            backend = make_backend(cfg.target, cfg.extract, cfg.data.max_length, cfg.paths.logs_dir)
        n = min(num_samples, len(prepared.train))
        sel = prepared.train.select(range(n))
        caps = backend.capture([list(x) for x in sel["input_ids"]])
        rows = [(sid, ids, c.aux, c.final, None) for sid, ids, c in zip(sel["id"], sel["input_ids"], caps,
                                                                         strict=True)]
        layer_ids = list(backend.layer_ids)
        if isinstance(backend, HFTarget):
            model = backend.model  # output_hidden_states does not go through the capture hooks' results
    else:
        if not Path(source).is_dir():
            raise FileNotFoundError(f"--source {source}: not 'backend' and not a cache folder")
        rows, layer_ids, storage = _states_from_cache(source, prepared.train, num_samples)
    if model is None:
        model = load_causal_lm(resolve_target_path(cfg.target.path), DTYPES[cfg.target.dtype], cfg.target.device,
                               cfg.target.trust_remote_code, cfg.target.revision)
    reports = []
    for sid, ids, aux, final, top in rows:
        hs, prenorm = reference(model, list(ids))
        reports.append(compare(sid, list(ids), aux, final, layer_ids, hs, prenorm,
                               FP8_TOKEN_COSINE_MIN if storage != "exact" else None))
        if top is not None:
            check_argmax(reports[-1], top, model, final, cfg.extract.teacher_chunk,
                         FP8_ARGMAX_REL_TOL if storage == "fp8" else None)
    print(f"verify-extraction: {source} vs HF reference (output_hidden_states), layer ids {layer_ids} "
          f"(eagle3 convention: id k = input of decoder layer k)" + (f", {storage} storage" if storage != "exact"
                                                                      else ""))
    print(format_report(reports))
    return 0 if all(r.ok for r in reports) else 1
