"""A trained head against drafting methods that need no training, inside vLLM, on the same prompts in one run.

    EAGLE3_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/bench_vs_ngram.py \
        --config configs/smollm2-135m.yaml --checkpoint runs/smollm2-135m/checkpoints/best \
        --sets mt-bench humaneval code-edit --max-prompts 80
    # bfcl needs a template that renders tools: --config configs/smollm2-135m-agentic.yaml (chatml-tools)

For each prompt set (and its categories), vLLM 0.32 (CPU) decodes the same rendered prompts three ways: with the
EAGLE-3 head, with its n-gram prompt lookup (k = eval.num_steps, lookup eval.ngram_min..ngram_max: 2-4), and with
suffix decoding where arctic-inference's suffix tree imports in vLLM's interpreter (it has no wheel:
`PYTHON=.venv-vllm/bin/python bash scripts/setup_suffix_decoding.sh` builds it into .vllm-suffix; the line says so
when it cannot). The table gives tokens per target forward (the figure that compares methods: n-gram's τ counts only the
steps that found a match) and τ for each, and head / n-gram. The built-in evaluator runs first (it renders the
prompts and checks the head is lossless against plain greedy decoding, and gives its own n-gram figures on the
same turns; its report is written under the run's eval folder). `--engine-only` skips it (`eval.builtin=false`):
vLLM answers each dialogue's earlier turns plainly to render the next, then decodes every turn with each method;
all of MT-bench, HumanEval and code-edit take minutes instead of about an hour per set on a 2-core CPU.
`--hybrid RULE ...` adds one vLLM run per rule of eagle3's hybrid drafter (the head paired with suffix decoding or
prompt lookup, eagle3.engines.vllm_hybrid) on the same prompts; benchmarks/bench_hybrid.py gives the rules' ceiling
by trace replay.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle3.config import load_config  # noqa: E402
from eagle3.logs import setup_logging  # noqa: E402
from eagle3.precision import cpu_native_bf16  # noqa: E402


def cpu_line() -> str:
    """The CPU's model name and whether it has native bf16 (eagle3.precision owns the flags that say so)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        info = []
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                 platform.processor() or "?")
    bf16, why = cpu_native_bf16()
    return f"{model}, native bf16: {'yes' if bf16 else 'no'} ({why})"


def suffix_available(python: str, folder: Path) -> bool:
    """Whether vLLM's interpreter imports arctic-inference's suffix tree, from `folder` (scripts/
    setup_suffix_decoding.sh) put first on the PYTHONPATH every vLLM process of this run inherits."""
    if folder.is_dir():
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    r = subprocess.run([python, "-c", "import arctic_inference.suffix_decoding"], capture_output=True, timeout=300)
    return r.returncode == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--sets", nargs="+", default=["mt-bench", "humaneval", "code-edit"])
    p.add_argument("--max-prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--suffix", default=str(REPO / ".vllm-suffix"),
                   help="arctic-inference's suffix tree built by scripts/setup_suffix_decoding.sh (a folder that "
                        "does not exist, e.g. none: no suffix run, unless vLLM's interpreter imports it by itself)")
    p.add_argument("--hybrid", nargs="*", default=[], metavar="RULE",
                   help="eagle3's hybrid drafter in vLLM, one run per rule (JSON or a JSON file, as EAGLE3_HYBRID reads it, e.g. "
                        "'{\"rule\": \"suffix-score\", \"threshold\": 1}'; eagle3.engines.vllm_hybrid)")
    p.add_argument("--engine-only", action="store_true",
                   help="vLLM alone (eval.builtin=false): no built-in run, no HF greedy reference")
    p.add_argument("--out", default=None, help="where the run's report goes (default: <checkpoint>/../../bench-vs-ngram)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    setup_logging()
    from eagle3.engines import EngineRun
    from eagle3.engines.hybrid_rule import parse_rule
    from eagle3.engines.vllm_eval import pooled_groups, run_vllm
    from eagle3.evaluate import run

    out = Path(a.out or Path(a.checkpoint).resolve().parent.parent / "bench-vs-ngram")
    cfg = load_config(a.config, [*a.overrides, f"output_dir={out}", f"eval.checkpoint={a.checkpoint}",
                                 f"eval.prompt_sets={json.dumps(a.sets)}", f"eval.max_prompts={a.max_prompts}",
                                 f"eval.max_new_tokens={a.max_new_tokens}", "eval.engine=vllm", "eval.ngram=true",
                                 "eval.temperature=0", f"eval.builtin={str(not a.engine_only).lower()}"])
    report = run(cfg)
    vllm = report["engines"]["vllm"]
    if a.engine_only:  # the card's own rows are vLLM's: the head's figures and n-gram's beside them
        methods = {"head": {r["set"]: r for r in report["card"]},
                   "ngram": {r["set"]: {"tau": r.get("ngram_tau"), "tokens_per_forward": r.get("ngram_tokens_per_forward")}
                             for r in report["card"]}}
    else:
        methods = {"head": vllm["groups"], "ngram": vllm["ngram_groups"]}
    python = os.environ.get("EAGLE3_VLLM_PYTHON") or sys.executable
    suffix_note = ("suffix decoding: arctic-inference does not import in vLLM's interpreter (no wheel on PyPI: "
                   "bash scripts/setup_suffix_decoding.sh builds its suffix tree)")
    if suffix_available(python, Path(a.suffix)):
        rendered = json.loads((cfg.eval_dir / "rendered_prompts.json").read_text())
        prompts = [x for name in report["sets"] for x in rendered[name]]
        sfx = run_vllm(EngineRun(cfg.target, cfg.eval, cfg.paths), None, prompts, groups=vllm["prompt_groups"],
                       method="suffix", check_greedy=False)
        g = sfx.pop("groups", {})
        methods["suffix"] = g | {name: pooled_groups(g, name) for name in report["sets"]}
        suffix_note = "suffix decoding: vLLM's method=suffix (arctic-inference)"

    for spec in a.hybrid:
        rule = parse_rule(spec, "--hybrid")
        rendered = json.loads((cfg.eval_dir / "rendered_prompts.json").read_text())
        prompts = [x for name in report["sets"] for x in rendered[name]]
        hy = run_vllm(EngineRun(cfg.target, cfg.eval, cfg.paths), Path(a.checkpoint), prompts,
                      groups=vllm["prompt_groups"], check_greedy=False, hybrid=rule)
        g = hy.pop("groups", {})
        name = "hybrid:" + (spec if not spec.lstrip().startswith("{") else  # a file: its path
                            ",".join(str(v) for k, v in rule.items() if k != "rule"))
        methods[name] = g | {n: pooled_groups(g, n) for n in report["sets"]}
        same = sum(x == y for x, y in zip(hy.get("outputs") or [], vllm.get("outputs") or [], strict=False))
        print(f"{name} ({rule}): {same} of {len(prompts)} outputs equal the head's")

    rows = [r["set"] for r in report["card"] if r["set"] in methods["head"]]  # sets and categories
    names = list(methods)
    print(f"\nCPU: {cpu_line()}; vLLM {vllm.get('vllm_version')}, {cfg.target.dtype}, k={cfg.eval.num_steps}, greedy, "
          f"{a.max_new_tokens} new tokens; {suffix_note}")
    width = max(len(r) for r in rows)
    head = f"{'prompt set':<{width}}  " + "  ".join(f"{m + ' tok/fwd':>14}" for m in names) + "  head/ngram  " + \
        "  ".join(f"{m + ' τ':>9}" for m in names)
    if a.hybrid:
        print("hybrid:<rule args or file>: eagle3's hybrid drafter, the head paired by that rule (suffix-score: "
              "suffix decoding where its score >= the threshold; ngram-match: prompt lookup on a match of >= that "
              "length; a file: the rule it holds, e.g. a router)")
    print(head)
    for row in rows:
        tpf = [methods[m].get(row, {}).get("tokens_per_forward", float("nan")) for m in names]
        tau = [methods[m].get(row, {}).get("tau", float("nan")) for m in names]
        ratio = tpf[0] / tpf[1] if tpf[1] else float("nan")
        print(f"{row:<{width}}  " + "  ".join(f"{x:14.3f}" for x in tpf) + f"  {ratio:9.2f}x  "
              + "  ".join(f"{x:9.3f}" for x in tau))
    print(f"report: {cfg.eval_dir / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
