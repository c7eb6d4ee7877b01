"""The hybrid drafter's ceiling, by exact trace replay: the head, n-gram, suffix decoding and rules over them.

    python benchmarks/bench_hybrid.py --config configs/smollm2-135m.yaml \
        --checkpoint runs/smollm2-135m/checkpoints/best --sets mt-bench humaneval code-edit --max-prompts 80

Every turn of every prompt set is decoded once by the built-in speculative decoder with the head (greedy, k =
eval.num_steps, chain): its output is the target's greedy answer (lossless), and its own tokens per target forward
are printed beside the replay's head column, which must equal it (eagle3.replay: the same drafts, the same rounds).
The trace (prompt + answer) then goes through one target forward (the aux states) and one TTT unroll of the head
(its chain at every position), and eagle3.replay walks it once per rule, each with drafters of its own: the head
alone, vLLM's n-gram (lookup eval.ngram_min..ngram_max), vLLM's suffix decoding (arctic-inference's tree with vLLM's
settings, responses fed in the run's order, at most --suffix-tokens tokens: k by default, as eagle3's vLLM runs
capped it), and rules that pick one draft per round (suffix where its score reaches a threshold, n-gram where it
matched a long n-gram, a learned router, the oracle that takes the longest accepted). MT-bench's second turns follow
the head's (greedy) answer to the first, as the built-in evaluator renders them. The learned routers (eagle3.replay
.fit_router: per model-free drafter, a least-squares fit of its accepted length minus the head's on a round's
signals, which the engine plugin has too) are fitted on half the prompts and measured on the other half, both ways:
`learned` on the model-free drafters' own signals, `learned+agree` on those and how far each model-free draft
agrees with the head's (what SGLang's plugin can read), `learned+head` on those and the head's confidence too (its
draft tokens' softmax probabilities: vLLM's plugin). `--router FILE ...` replays rules as they are (a router fitted
on another run's traces: its figure out of sample).

`--from-vllm DIR` replays vLLM's own greedy texts instead (a `bench_vs_ngram.py --engine-only` run's folder): the
replay's single methods then meet vLLM's counters for the same turns (the reproduction check), the head column being
vLLM's. Prints tokens per target forward per set and category, the oracle over the best single method, and writes
`replay.json`, `router.json` (the learned+head router fitted on every turn: `eagle3 export --to vllm --hybrid
router.json` serves it) and `router-sglang.json` (learned+agree, for `--to sglang`) under --out. The suffix tree: `PYTHON=.venv/bin/python bash scripts/setup_suffix_decoding.sh` (into
.vllm-suffix); without it the suffix columns are left out, said so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from bench_vs_ngram import cpu_line  # noqa: E402

from eagle3.config import load_config  # noqa: E402
from eagle3.logs import setup_logging  # noqa: E402


def vllm_traces(folder: Path):
    """(trace, fold) per turn of a `bench_vs_ngram.py --engine-only` run, in its order (set, prompt, turn): the
    rendered prompt and vLLM's greedy answer with the head, cut where vLLM cut it (its counters also count drafts
    accepted past the cut, at most one round per turn). Folds alternate by turn."""
    from eagle3.replay import Trace

    rendered = json.loads((folder / "eval" / "rendered_prompts.json").read_text())
    vllm = json.loads((folder / "eval" / "report.json").read_text())["engines"]["vllm"]
    prompts = [p for name in rendered for p in rendered[name]]
    for i, (ids, out, group) in enumerate(zip(prompts, vllm["outputs"], vllm["prompt_groups"], strict=True)):
        name, _, category = group.partition("/")
        yield Trace(ids, out, name, category), i % 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--sets", nargs="+", default=["mt-bench", "humaneval", "code-edit"])
    p.add_argument("--max-prompts", type=int, default=20)
    p.add_argument("--suffix-tokens", type=int, default=None, help="the suffix tree's longest draft (default: k)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--from-vllm", metavar="DIR", help="replay vLLM's own texts: a bench_vs_ngram.py --engine-only run's "
                   "--out folder (its rendered prompts and the head's outputs), instead of decoding here")
    p.add_argument("--router", nargs="*", default=[], metavar="FILE",
                   help="rules to replay as they are (JSON files as EAGLE3_HYBRID reads them: e.g. a router another run "
                        "fitted, for its figure on prompts it was not fitted on)")
    p.add_argument("--out", default="runs/bench-hybrid")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    setup_logging()

    from eagle3.data.types import Turn
    from eagle3.engines.hybrid_rule import FEATURES, MODEL_FREE, SGLANG_FEATURES, parse_rule
    from eagle3.evaluate import PromptRenderer, draft_for_target, settings_from
    from eagle3.prompts import load_prompt_set
    from eagle3.replay import (
        Recorder,
        Replayer,
        Trace,
        always,
        default_rules,
        engine_rule,
        fit_router,
        head_chains,
        learned,
        suffix_tree,
    )
    from eagle3.specdec import HFTargetDecoder, SpeculativeDecoder
    from eagle3.targets.hf import eos_ids, load_target

    cfg = load_config(a.config, a.overrides)
    ev = cfg.eval
    k = ev.num_steps
    if ev.topk != 1 or ev.temperature > 0:
        raise SystemExit("the replay is exact for greedy chains: eval.topk=1, eval.temperature=0")
    try:
        suffix_tree()
        suffix = True
    except ImportError as e:
        print(f"suffix decoding left out: {e}")
        suffix = False
    model, tokenizer = load_target(cfg.target)
    draft = draft_for_target(Path(a.checkpoint), model, cfg.target.aux_layer_ids)
    target = HFTargetDecoder(model, list(draft.config.aux_layer_ids))
    t0 = time.monotonic()

    def chains_of(trace: Trace) -> torch.Tensor:
        with torch.inference_mode():
            _, aux = target.forward(torch.tensor(trace.tokens), torch.arange(len(trace.tokens)), target.new_cache())
        return head_chains(draft, aux, trace.tokens, k)

    done: list[tuple[Trace, torch.Tensor, int]] = []  # in the run's order: (trace, head chains, fold)
    if a.from_vllm:
        source, reference = "vLLM head", {}
        for trace, fold in vllm_traces(Path(a.from_vllm)):
            done.append((trace, chains_of(trace), fold))
            print(f"\rvLLM's traces: {len(done)} turns, {time.monotonic() - t0:.0f} s", end="", flush=True)
        report = json.loads((Path(a.from_vllm) / "eval" / "report.json").read_text())
        for row in report["card"]:
            s_, _, c = row["set"].partition("/")
            reference[(s_, c)] = row.get("tokens_per_forward") or float("nan")
    else:
        source, counts = "built-in head", {}  # (set, category) -> [generated, forwards]
        eos = set(eos_ids(tokenizer, model.generation_config))
        dec = SpeculativeDecoder(target, draft, settings_from(ev), eos)
        render = PromptRenderer(tokenizer, cfg.data)
        for name in a.sets:
            ps = load_prompt_set(name, cfg.paths.prepared_dir, a.max_prompts)
            for i, prompt in enumerate(ps.prompts):
                history: list[Turn] = list(prompt.messages or [])
                for text in prompt.to_generate():
                    ids = render.turn(prompt, history, text)
                    gen = dec.generate(ids)
                    trace = Trace(ids, gen.tokens, ps.name, prompt.category or "")
                    done.append((trace, chains_of(trace), i % 2))
                    for key in ((ps.name, ""), (ps.name, trace.category)):
                        c = counts.setdefault(key, [0, 0])
                        c[0] += len(gen.tokens)
                        c[1] += gen.target_forwards
                    if text is not None:
                        history.append(Turn("assistant", render.answer(gen.tokens, eos)))
                    print(f"\r{ps.name}: {len(done)} turns, {time.monotonic() - t0:.0f} s", end="", flush=True)
        reference = {key: g / f for key, (g, f) in counts.items()}
    turns = len(done)
    print()
    # The learned router, two folds over the prompts (a dialogue's turns in one fold): fitted on the rounds of one
    # fold's traces (walked by the head alone, every drafter proposing), applied to the other's.
    rules = default_rules(k, suffix)
    rec = Recorder(always("head"))
    rep = Replayer(k, {"record": rec}, suffix_tokens=a.suffix_tokens, suffix=suffix)
    for trace, chains, fold in done:
        rec.group = fold
        rep.add(trace, chains)
    fitted = {(f, feats): fit_router([r for r in rec.rows if r[0] != f], feats)
              for f in (0, 1) for feats in (MODEL_FREE, SGLANG_FEATURES, FEATURES)}
    fold_rules = {key: learned(w, key[1]) for key, w in fitted.items()}
    current = [0]
    rules["learned (2-fold)"] = lambda props: fold_rules[(current[0], MODEL_FREE)](props)
    rules["learned+agree (2-fold)"] = lambda props: fold_rules[(current[0], SGLANG_FEATURES)](props)
    rules["learned+head (2-fold)"] = lambda props: fold_rules[(current[0], FEATURES)](props)
    for f in a.router:
        rules[f"rule:{Path(f).parent.name}/{Path(f).name}"] = engine_rule(parse_rule(f, f))
    rules = {**{n: r for n, r in rules.items() if n != "oracle"}, "oracle": rules["oracle"]}
    rep = Replayer(k, rules, suffix_tokens=a.suffix_tokens, suffix=suffix)
    for trace, chains, fold in done:
        current[0] = fold
        rep.add(trace, chains)
    names = list(rules)
    singles = [n for n in ("head", "ngram", "suffix") if n in rules]
    print(f"{cpu_line()}; torch threads {a.threads}; k = {k}; suffix tokens {a.suffix_tokens or k}; "
          f"{turns} turns in {time.monotonic() - t0:.0f} s")
    print(f"| set | category | {source} | " + " | ".join(names) + " | oracle / best single |")
    print("|---|---|---|" + "---|" * len(names) + "---|")
    out = []
    for s, c, tallies in rep.rows():
        ref = reference.get((s, c), float("nan"))
        tpf = {n: t.tokens_per_forward for n, t in tallies.items()}
        best = max(tpf[n] for n in singles)
        print(f"| {s} | {c or 'all'} | {ref:.3f} | " + " | ".join(f"{tpf[n]:.3f}" for n in names)
              + f" | {tpf['oracle'] / best:.2f}x |")
        out.append({"set": s, "category": c, "traces_head": ref, "tokens_per_forward": tpf,
                    "chosen": {n: t.chosen for n, t in tallies.items()}})
    folder = Path(a.out)
    folder.mkdir(parents=True, exist_ok=True)
    folds = [{"fold": f, "features": list(feats), "weights": w} for (f, feats), w in fitted.items()]
    (folder / "replay.json").write_text(json.dumps({"k": k, "suffix_tokens": a.suffix_tokens or k, "rows": out,
                                                    "routers": folds}, indent=1))
    print("router weights per fold (features, then a constant):", json.dumps(folds))
    # fitted on every prompt, for serving (eagle3 export --hybrid <out>/router.json): its figure here would be in-sample
    for name, feats in (("router.json", FEATURES), ("router-sglang.json", SGLANG_FEATURES)):
        router = {"rule": "router", "features": list(feats), "weights": fit_router(rec.rows, feats),
                  "min": ev.ngram_min, "max": ev.ngram_max}
        (folder / name).write_text(json.dumps(router, indent=1))
    print(f"routers for serving (fitted on all prompts): {folder / 'router.json'} (vLLM), "
          f"{folder / 'router-sglang.json'} (SGLang: no head probabilities)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
