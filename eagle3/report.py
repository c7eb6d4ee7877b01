"""The evaluation report: `report.json` (every number) and `report.png` (the three charts people look at).

The chart shows, per prompt set: the mean acceptance length τ (engines' definition, bonus token included), the
acceptance rate at each draft position, and decoding speed with and without speculation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from eagle3.fsutil import write_json_atomic


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, report, default=_jsonable)
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def _num(x: float | None) -> float:
    return float("nan") if x is None else float(x)


def plot(report: dict[str, Any], path: str | Path) -> Path:
    """Three panels (τ, acceptance per position, tokens/s) for every prompt set of `report["sets"]`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets: dict[str, dict[str, Any]] = report["sets"]
    names = list(sets)
    s = report.get("settings", {})
    with_categories = [n for n in names if shown_categories(sets[n])]
    with_buckets = [n for n in names if shown_buckets(sets[n])]
    extra = bool(with_categories) + bool(with_buckets)
    fig, axes = plt.subplots(1, 3 + extra, figsize=(15 + 5 * extra, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    ceiling = s.get("num_steps", 0) + 1
    _tau_panel(axes[0], sets, names, colors, ceiling)
    _acceptance_panel(axes[1], sets, names, colors, ceiling)
    _speed_panel(axes[2], sets, names, colors, str(report.get("device", "cpu")))
    if with_categories:
        _categories_panel(axes[3], sets, with_categories, colors)
    if with_buckets:
        _buckets_panel(axes[3 + bool(with_categories)], sets, with_buckets, colors)

    shape = (f"steps {s.get('num_steps')} · topk {s.get('topk')} · draft tokens {s.get('num_draft_tokens')} · "
             f"T={s.get('temperature')} · max_new {s.get('max_new_tokens')}")
    target = Path(str(report.get("target", {}).get("path", "target"))).name
    draft = "/".join(Path(str(report.get("draft", ""))).parts[-2:])
    fig.suptitle(f"target {target} + draft {draft}"
                 f"   ({shape})", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tau_panel(ax: Any, sets: dict[str, dict[str, Any]], names: list[str], colors: list[str], ceiling: int) -> None:
    taus = [_num(sets[n].get("tau")) for n in names]
    bars = ax.bar(names, taus, color=colors[: len(names)])
    for b, t in zip(bars, taus, strict=True):
        if not math.isnan(t):
            ax.annotate(f"{t:.2f}", (b.get_x() + b.get_width() / 2, t), ha="center", va="bottom", fontsize=10)
    if ceiling > 1:
        ax.axhline(ceiling, color="gray", ls="--", lw=1)
        ax.text(-0.4, ceiling, f" max {ceiling}", va="bottom", color="gray", fontsize=9)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylim(0, max([ceiling, *[t for t in taus if not math.isnan(t)]]) * 1.15 or 1)
    ax.set_ylabel("τ: tokens per verify step")
    ax.set_title("Mean acceptance length τ")


def _acceptance_panel(ax: Any, sets: dict[str, dict[str, Any]], names: list[str], colors: list[str],
                      ceiling: int) -> None:
    for i, n in enumerate(names):
        rate = sets[n].get("acceptance_rate") or []
        if rate:
            ax.plot(range(1, len(rate) + 1), [100 * r for r in rate], marker="o", color=colors[i % len(colors)],
                    label=n)
    ax.set_xlabel("draft position")
    ax.set_ylabel("verify steps accepting ≥ this many (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Acceptance rate per draft position")
    if ceiling > 1:
        ax.set_xticks(range(1, ceiling))
    if ax.get_legend_handles_labels()[0]:  # none where no set has a verify step (every turn ended at once)
        ax.legend(fontsize=9)


def _speed_panel(ax: Any, sets: dict[str, dict[str, Any]], names: list[str], colors: list[str], device: str) -> None:
    width = 0.38
    xs = list(range(len(names)))
    base = [_num(sets[n].get("tokens_per_s", {}).get("baseline")) for n in names]
    spec = [_num(sets[n].get("tokens_per_s", {}).get("spec")) for n in names]
    ax.bar([x - width / 2 for x in xs], base, width, label="without speculation", color="#999999")
    ax.bar([x + width / 2 for x in xs], spec, width, label="EAGLE-3", color=colors[0])
    for x, b, sp in zip(xs, base, spec, strict=True):
        if b and not math.isnan(b) and not math.isnan(sp):
            ax.annotate(f"{sp / b:.2f}×", (x + width / 2, sp), ha="center", va="bottom", fontsize=10)
    ax.set_xticks(xs, names)
    top = max([v for v in base + spec if not math.isnan(v)] or [1.0])
    ax.set_ylim(0, top * 1.3)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Decoding speed ({device})")
    ax.legend(fontsize=9, loc="upper center", ncol=2)


def _categories_panel(ax: Any, sets: dict[str, dict[str, Any]], names: list[str], colors: list[str]) -> None:
    """τ per prompt category (MT-Bench's eight), one group of bars per category, one bar per set."""
    cats = sorted({c for n in names for c in sets[n]["categories"]})
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        taus = [_num(sets[n]["categories"].get(c, {}).get("tau")) for c in cats]
        ax.bar([x + (i - (len(names) - 1) / 2) * width for x in range(len(cats))], taus, width,
               color=colors[i % len(colors)], label=n)
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right", fontsize=9)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylabel("τ")
    ax.set_title("τ per prompt category")
    ax.legend(fontsize=9)


def _buckets_panel(ax: Any, sets: dict[str, dict[str, Any]], names: list[str], colors: list[str]) -> None:
    """τ by the context length a verify step drafts at, one line per set (a head trained short falls off long)."""
    for i, n in enumerate(names):
        b = sets[n]["context_buckets"]
        ax.plot(list(b), [_num(x.get("tau")) for x in b.values()], marker="o", color=colors[i % len(colors)], label=n)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("context length at the verify step")
    ax.set_ylabel("τ")
    ax.set_title("τ by context length")
    ax.legend(fontsize=9)


def by_category(per_turn: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """τ per prompt category (MT-Bench's eight: coding and extraction draft easily, writing and roleplay do not),
    pooled over the category's verify steps as the set's τ is; {} when the prompts name no category."""
    out: dict[str, dict[str, Any]] = {}
    for t in per_turn:
        if t.get("category") is None:
            continue
        c = out.setdefault(t["category"], {"turns": 0, "verify_steps": 0, "accepted_plus_bonus": 0.0})
        c["turns"] += 1
        if t["verify_steps"]:
            c["verify_steps"] += t["verify_steps"]
            c["accepted_plus_bonus"] += t["tau"] * t["verify_steps"]
    for c in out.values():
        c["tau"] = c.pop("accepted_plus_bonus") / c["verify_steps"] if c["verify_steps"] else float("nan")
    return dict(sorted(out.items()))


def shown_categories(r: dict[str, Any]) -> dict[str, Any]:
    """A set's categories as the card, summary and PNG show them: none where there is only one, whose row would
    repeat the set's (report.json keeps it)."""
    cats = r.get("categories") or {}
    return cats if len(cats) > 1 else {}


def shown_buckets(r: dict[str, Any]) -> dict[str, Any]:
    """A set's context-length buckets as the card and PNG show them: none where all its steps fall in one."""
    b = r.get("context_buckets") or {}
    return b if len(b) > 1 else {}


def _row(name: str, r: dict[str, Any], turns: Any) -> dict[str, Any]:
    row = {"set": name, "turns": turns, "tau": r.get("tau"), "acceptance_rate": r.get("acceptance_rate") or [],
           "tokens_per_forward": r.get("tokens_per_forward"), "speedup": r.get("speedup")}
    if ng := r.get("ngram"):
        row.update(ngram_tau=ng.get("tau"), ngram_tokens_per_forward=ng.get("tokens_per_forward"))
    if r.get("out_of_vocab") is not None:
        row.update(out_of_vocab=r["out_of_vocab"], out_of_vocab_in_prompt=r.get("out_of_vocab_in_prompt"))
    return row


def card(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows a published head's card gives: one per prompt set, then one per category of a set that has them
    (`set/category`), then one per context-length bucket of a set whose steps span several (`set@<2K`), at the
    report's settings: turns, τ, acceptance per draft position, tokens per target forward and speed-up (a
    category of the built-in has them all; one an engine reports has τ and turns), and n-gram drafting's τ and
    tokens per target forward on the same turns where it ran; the share of plain decoding's tokens outside the
    head's draft vocab (and of those, in the prompt) where the built-in evaluator ran."""
    rows = [_row(name, r, r.get("turns")) for name, r in report["sets"].items()]
    for name, r in report["sets"].items():
        rows += [_row(f"{name}/{cat}", c, c["turns"]) for cat, c in shown_categories(r).items()]
    for name, r in report["sets"].items():
        rows += [_row(f"{name}@{b}", c, None) for b, c in shown_buckets(r).items()]
    for engine, e in (report.get("engines") or {}).items():
        for row in rows:  # an engine that ran the same prompts group by group (vLLM): its τ on each row
            if row["set"] in (e.get("groups") or {}):
                row[f"{engine}_tau"] = e["groups"][row["set"]]["tau"]
                if e.get("hybrid_groups"):  # the head's tokens per forward beside the hybrid's
                    row[f"{engine}_tokens_per_forward"] = e["groups"][row["set"]].get("tokens_per_forward")
            for method in ("hybrid", "suffix"):  # eagle3's hybrid, and suffix decoding alone beside it
                if row["set"] in (e.get(f"{method}_groups") or {}):
                    g = e[f"{method}_groups"][row["set"]]
                    row[f"{engine}_{method}_tau"] = g["tau"]
                    row[f"{engine}_{method}_tokens_per_forward"] = g.get("tokens_per_forward")
            if row["set"] in (e.get("ngram_groups") or {}):
                g = e["ngram_groups"][row["set"]]
                row[f"{engine}_ngram_tau"] = g["tau"]
                row[f"{engine}_ngram_tokens_per_forward"] = g.get("tokens_per_forward")
    return rows


_EXTRA = {"ngram_tau": "ngram τ", "ngram_tokens_per_forward": "ng tok/fwd"}


def _extra_columns(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(key, header) of the optional columns present: each engine's τ, then n-gram drafting's, built-in first."""
    keys = {k for r in rows for k, v in r.items() if v is not None}
    engines = sorted({k.removesuffix("_tau") for k in keys if k.endswith("_tau") and "ngram" not in k})
    cols = [(f"{e}_tau", f"{e.replace('_', ' ')} τ") for e in engines]
    cols += [(f"{e}_tokens_per_forward", f"{e.replace('_', ' ')} tok/fwd") for e in engines
             if f"{e}_tokens_per_forward" in keys]
    cols += [(k, h) for k, h in _EXTRA.items() if k in keys]
    for e in engines:
        cols += [(f"{e}_{k}", f"{e} {h}") for k, h in _EXTRA.items() if f"{e}_{k}" in keys]
    cols += [(k, h) for k, h in _SHARES.items() if k in keys]
    return cols


_SHARES = {"out_of_vocab": "out of vocab", "out_of_vocab_in_prompt": "oov in prompt"}
"""Card columns printed as percentages."""


def _cell(key: str, value: Any, width: int) -> str:
    if key in _SHARES:
        return f"{100 * _num(value):{width - 1}.2f}%"
    return f"{_num(value):{width}.3f}"


def card_lines(rows: list[dict[str, Any]]) -> list[str]:
    """`card` as a fixed-width table."""
    positions = max((len(r.get("acceptance_rate") or []) for r in rows), default=0)
    width = max([len("prompt set"), *(len(r["set"]) for r in rows)])
    extra = _extra_columns(rows)
    head = (f"{'prompt set':<{width}}  turns      τ  " + "".join(f"acc@{j + 1:<3}" for j in range(positions))
            + "tok/fwd  speed-up" + "".join(f"  {h:>{max(8, len(h))}}" for _, h in extra))
    lines = [head]
    for r in rows:
        acc = r.get("acceptance_rate") or []
        cells = "".join(f"{100 * a:5.0f}% " if j < len(acc) else "     - " for j, a in
                        enumerate(acc + [0.0] * (positions - len(acc))))
        fwd, up = r.get("tokens_per_forward"), r.get("speedup")
        turns = "-" if r.get("turns") is None else r["turns"]
        lines.append(f"{r['set']:<{width}}  {turns:>5}  {_num(r['tau']):5.3f}  {cells}"
                     + (f"{fwd:7.2f}  {up:7.2f}x" if fwd is not None and up is not None else "      -         -")
                     + "".join(f"  {_cell(k, r.get(k), max(8, len(h)))}" for k, h in extra))
    return lines


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One human line per prompt set (what `eagle3 eval` prints)."""
    lines = []
    for name, r in report["sets"].items():
        rate = " ".join(f"{100 * x:.0f}%" for x in r.get("acceptance_rate") or [])
        tps = r.get("tokens_per_s", {})
        line = (f"{name}: τ={r.get('tau', float('nan')):.3f} (accept per position: {rate}) "
                f"tokens/forward={r.get('tokens_per_forward', float('nan')):.2f} "
                f"tokens/s spec={tps.get('spec', float('nan')):.1f} baseline={tps.get('baseline', float('nan')):.1f} "
                f"speedup={r.get('speedup', float('nan')):.2f}x over {r.get('turns')} turns")
        if ng := r.get("ngram"):  # printed here too: a one-row card (the quickstart's) is not printed
            line += (f"; n-gram drafting on the same turns: tokens/forward={_num(ng.get('tokens_per_forward')):.2f} "
                     f"τ={_num(ng.get('tau')):.3f}")
        if r.get("out_of_vocab") is not None:
            line += (f"; {100 * r['out_of_vocab']:.2f}% of plain decoding's tokens are outside the draft vocab "
                     f"({100 * r['out_of_vocab_in_prompt']:.2f}% also in the prompt)")
        if r.get("near_ties"):
            line += (f"; {r['near_ties']} turn(s) part from plain greedy at a near-tie (top-2 logit gap within the "
                     "dtype's rounding: not a bug)")
        if r.get("clear_divergences"):
            line += f"; ERROR: {r['clear_divergences']} turn(s) part from plain greedy at a clear margin (a bug)"
        if r.get("turns_past_context_window"):
            line += f"; {r['turns_past_context_window']} turn(s) left out: past the target's context window"
        lines.append(line)
        if cats := shown_categories(r):
            lines.append(f"  {name} per category: " + ", ".join(
                f"{cat} τ={c['tau']:.3f} ({c['turns']} turns)" for cat, c in cats.items()))
    rows = report.get("card") or card(report)
    if len(rows) > 1:
        lines += card_lines(rows)
    for engine, r in (report.get("engines") or {}).items():
        line = f"{engine}: τ={r.get('tau', float('nan')):.3f}"
        if r.get("sglang_accept_length") is not None:
            line += f" (SGLang's own accept length, prefill token included: {r['sglang_accept_length']:.3f})"
        if r.get("builtin_tau") is not None:
            line += f" (built-in τ on the same prompts: {r['builtin_tau']:.3f})"
        if isinstance(ng := r.get("ngram"), dict) and ng.get("tau") is not None:
            line += (f"; its n-gram drafting: tokens/forward={_num(ng.get('tokens_per_forward')):.2f} "
                     f"τ={_num(ng['tau']):.3f}")
        if r.get("untrusted"):
            line += f"; UNTRUSTED: {r['untrusted']}"
        lines.append(line)
    return lines
