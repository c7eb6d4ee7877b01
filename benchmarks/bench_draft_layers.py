"""Llama vs MLA draft layer, each with and without EAGLE-3.1's fc_norm + norm_output: same data, budget and seed.

    python benchmarks/bench_draft_layers.py --root runs/bench-layers -- data.max_samples=400 train.epochs=1

One prepare + extract of the SmolLM2 recipe (configs/smollm2-135m.yaml plus the overrides after `--`), then for
each head kind: training from the same seed on the same cache (train tokens/s: the median of the logged steps),
the held-out simulated acceptance over the whole eval split (the trainer's own eval), and MT-bench τ with the
built-in evaluator next to an engine's on the same turns: SGLang (`--engine sglang`, needs .venv-sglang: it serves
both layers on CPU) and vLLM for the Llama layer (`--vllm`, needs a vLLM venv: vLLM's CPU build cannot pair an MLA
draft with a Llama target). Prints one table row per head and writes everything to <root>/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEADS = {
    "llama": [],
    "llama+3.1": ["draft.fc_norm=true", "draft.norm_output=true"],
    "mla": ["draft.arch=mla"],
    "mla+3.1": ["draft.arch=mla", "draft.fc_norm=true", "draft.norm_output=true"],
}


ENGINE_ENV = {
    # The real SGLang 0.5.23 on CPU with the GPU-kernel stand-ins of tests/sglang_cpu (its README)
    "sglang": {"EAGLE3_SGLANG_PYTHON": str(REPO / ".venv-sglang" / "bin" / "python"), "SGLANG_USE_CPU_ENGINE": "1",
               "PYTHONPATH": str(REPO / "tests" / "sglang_cpu"), "SGLANG_CPU_OMP_THREADS_BIND": "0",
               "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so", "HF_HUB_OFFLINE": "1"},
    "vllm": {"VLLM_CPU_KVCACHE_SPACE": "2"},
}
ENGINE_OVERRIDES = {
    "sglang": ['target.sglang.launch_args=["--device", "cpu", "--attention-backend", "torch_native", '
               '"--max-total-tokens", "8192"]', "target.sglang.startup_timeout_s=900"],
}


def eagle3(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "eagle3.cli", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, **(env or {})})


def train_rate(run: Path) -> float:
    rows = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="runs/bench-layers")
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--engine", choices=["none", "sglang"], default="sglang")
    p.add_argument("--vllm", action="store_true", help="also vLLM's τ for the Llama-layer heads")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    root = (REPO / a.root).resolve()
    shared = [f"output_dir={root / 'base'}", *a.overrides]
    eagle3("prepare", "--config", a.config, *shared)
    eagle3("extract", "--config", a.config, *shared)
    data = [f"data.output_dir={root / 'base' / 'prepared'}", f"extract.cache_dir={root / 'base' / 'cache'}"]
    results = {}
    for name in a.heads:
        run = root / name
        over = [*a.overrides, *data, f"output_dir={run}", *HEADS[name]]
        eagle3("train", "--config", a.config, *over)
        best = run / "checkpoints" / "best"
        heldout = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_heldout.py"), "--config", a.config,
                                  "--heads", str(best), "--", *over], check=True, cwd=REPO, capture_output=True, text=True)
        ev = json.loads(heldout.stdout[heldout.stdout.index("{"):])["heads"][str(best)]
        row = {"train_tokens_per_s": train_rate(run), "sim_accept_len": ev["sim_accept_len"]}
        engines = [a.engine] if a.engine != "none" else ["builtin"]
        if a.vllm and name.startswith("llama"):
            engines.append("vllm")
        for engine in engines:
            # float32 on both sides of the comparison: bf16 near-ties make any two implementations part
            eagle3("eval", "--config", a.config, *over, f"eval.checkpoint={best}", f"eval.engine={engine}",
                   "eval.builtin=true", "target.dtype=float32", *ENGINE_OVERRIDES.get(engine, []),
                   env=ENGINE_ENV.get(engine))
            report = json.loads((run / "eval" / "report.json").read_text())
            row["tau_builtin"] = report["sets"]["mt-bench"]["tau"]
            if engine != "builtin":
                row[f"tau_{engine}"] = report["engines"][engine]["tau"]
        results[name] = row
        print(name, json.dumps(row), flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("| head | held-out sim_accept_len | MT-bench τ built-in | SGLang | vLLM | train tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['sim_accept_len']:.3f} | {r['tau_builtin']:.3f} | {r.get('tau_sglang', float('nan')):.3f} "
              f"| {r.get('tau_vllm', float('nan')):.3f} | {r['train_tokens_per_s']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
