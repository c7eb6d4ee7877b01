"""OpenMP threads for each CPU stage: 1 vs 2 threads (and 2 with a passive wait policy), idle and beside a busy process.

    python benchmarks/bench_threads.py --dtype float32 --rounds 2
    python benchmarks/bench_threads.py --dtype bfloat16 --stages train eval --modes 1 2 2p

On the bundled SmolLM2-135M (configs/smollm2-135m-quickstart.yaml, 40 conversations at 256 tokens into a scratch
folder), each stage runs the real code in its own process, once per thread mode and machine state, alternating
(every mode of a round runs before the next round starts), so drifts in the VM's speed hit every mode alike:

- extract: `eagle3 extract` into a fresh cache (tokens/s of the whole stage, target load included);
- train: the trainer for --train-steps steps on that cache (tokens/s of the steps after the first);
- eval: the built-in evaluator, --eval-prompts MT-bench questions x 2 turns (tokens/s of speculative decoding).

Modes: `1` and `2` fix the count (EAGLE3_CPU_THREADS); `2p` is 2 threads with OMP_WAIT_POLICY=PASSIVE (a thread
waiting at an OpenMP barrier sleeps instead of spinning); `auto` is the default `cpu_threads: auto`
(eagle3/threads.py). "loaded" runs a second CPU-bound process (a pure-Python busy loop, one core's worth) for
the whole run, as a test run or another job beside the stage would. Prints one table row
per stage, mode and state, with the median over rounds, and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "smollm2-135m-quickstart.yaml"
MODES = {"1": {"EAGLE3_CPU_THREADS": "1"}, "2": {"EAGLE3_CPU_THREADS": "2"},
         "2p": {"EAGLE3_CPU_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}, "auto": {}}
BUSY = "while True: pass"


def overrides(work: Path, dtype: str, samples: int) -> list[str]:
    return [f"output_dir={work}", f"data.max_samples={samples}", "data.eval_size=4", f"target.dtype={dtype}",
            "tracking.backend=none"]


def one(stage: str, work: Path, dtype: str, samples: int, steps: int, prompts: int, out: Path) -> None:
    """Run one stage in this process (its thread settings came in the environment) and write its throughput."""
    import torch

    from eagle3 import threads
    from eagle3.config import load_config
    from eagle3.logs import setup_logging

    setup_logging()
    ov = overrides(work, dtype, samples)
    threads.configure(load_config(str(CONFIG), ov).cpu_threads)  # what the CLI does for every stage
    if stage == "extract":
        from eagle3 import extract

        cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
        cfg = load_config(str(CONFIG), [*ov, f"extract.cache_dir={cache}"])
        t0 = time.perf_counter()
        extract.run(cfg)
        dt = time.perf_counter() - t0
        from eagle3.cache import manifests

        tokens = sum(e.num_tokens for split in ("train", "eval") for m in manifests(cache, split)[0] for e in m.shards)
        result = {"tokens_per_s": tokens / dt}
    elif stage == "train":
        from eagle3.trainer import run

        cfg = load_config(str(CONFIG), ov)
        cfg.output_dir = str(Path(tempfile.mkdtemp(prefix="train-", dir=work)))
        cfg.extract.cache_dir, cfg.data.output_dir = str(work / "cache"), str(work / "prepared")
        t = cfg.train
        t.max_steps, t.save_every, t.eval_every, t.resume, t.mixed_precision = steps, 10**9, 10**9, False, "auto"
        run(cfg)
        from bench_train import summarise  # this folder's: tokens/s of the logged steps after the first

        result = {"tokens_per_s": summarise(Path(cfg.output_dir), warmup=1)["tokens_per_s"]}
    else:
        from eagle3.engines import EngineRun
        from eagle3.evaluate import run_builtin

        cfg = load_config(str(CONFIG), [*ov, f"eval.max_prompts={prompts}", "eval.max_new_tokens=48",
                                        "eval.temperature=0", "eval.prompt_sets=[mt-bench]"])
        cfg.eval.checkpoint = str(work / "head")
        report, _, _ = run_builtin(EngineRun(cfg.target, cfg.eval, cfg.paths), cfg.data)
        r = report["sets"]["mt-bench"]
        result = {"tokens_per_s": r["tokens_per_s"]["spec"], "plain_tokens_per_s": r["tokens_per_s"]["baseline"]}
    out.write_text(json.dumps({**result, "threads": torch.get_num_threads()}))


def setup(work: Path, dtype: str, samples: int) -> None:
    """Prepare, extract and a 10-step head once (not timed): the cache train reads and the head eval drafts with."""
    ov = overrides(work, dtype, samples)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    for cmd in (["prepare"], ["extract"]):
        subprocess.run([sys.executable, "-m", "eagle3.cli", *cmd, "--config", str(CONFIG), *ov], check=True, env=env)
    subprocess.run([sys.executable, "-m", "eagle3.cli", "train", "--config", str(CONFIG), *ov, "train.max_steps=10",
                    "train.save_every=10", "train.eval_every=10", f"output_dir={work}"], check=True, env=env)
    best = work / "checkpoints" / "best"
    (work / "head").symlink_to(best if best.exists() else sorted((work / "checkpoints").glob("step_*"))[-1])


def measure(a: argparse.Namespace, work: Path, stage: str, mode: str, loaded: bool) -> dict:
    out = work / f"result-{stage}-{mode}-{int(loaded)}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "EAGLE3_CPU_THREADS")}
    env = {**env, **MODES[mode], "PYTHONPATH": str(REPO)}
    busy = subprocess.Popen([sys.executable, "-c", BUSY]) if loaded else None
    try:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--one", stage, "--work", str(work), "--dtype", a.dtype,
                        "--samples", str(a.samples), "--train-steps", str(a.train_steps),
                        "--eval-prompts", str(a.eval_prompts), "--out", str(out)],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return {**json.loads(out.read_text()), "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--stages", nargs="+", default=["extract", "train", "eval"], choices=["extract", "train", "eval"])
    p.add_argument("--modes", nargs="+", default=["1", "2", "2p", "auto"], choices=list(MODES))
    p.add_argument("--states", nargs="+", default=["idle", "loaded"], choices=["idle", "loaded"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--train-steps", type=int, default=8)
    p.add_argument("--eval-prompts", type=int, default=2)
    p.add_argument("--work", help="scratch folder (default: a new temporary one)")
    p.add_argument("--one", choices=["extract", "train", "eval"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        one(a.one, Path(a.work), a.dtype, a.samples, a.train_steps, a.eval_prompts, Path(a.out))
        return
    from eagle3.precision import cpu_native_bf16

    work = Path(a.work or tempfile.mkdtemp(prefix="bench-threads-"))
    if not (work / "head").exists():
        setup(work, a.dtype, a.samples)
    native, why = cpu_native_bf16()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, native bf16: {native} "
          f"({why}); load before the run: {os.getloadavg()[0]:.2f}; dtype {a.dtype}", flush=True)
    results: dict[str, list[dict]] = {}
    for r in range(a.rounds):
        for stage in a.stages:
            for state in a.states:
                for mode in a.modes:
                    res = measure(a, work, stage, mode, state == "loaded")
                    results.setdefault(f"{stage}|{state}|{mode}", []).append(res)
                    print(f"round {r + 1} {stage:7s} {state:6s} mode {mode:2s}: {res['tokens_per_s']:7.1f} tok/s "
                          f"(wall {res['wall_s']:.0f} s)", flush=True)
    print("\n| stage | machine | mode | tokens/s (median) | vs 1 thread, same state |")
    print("|---|---|---|---|---|")
    summary = {}
    for stage in a.stages:
        for state in a.states:
            one_t = statistics.median(x["tokens_per_s"] for x in results.get(f"{stage}|{state}|1", [{"tokens_per_s": 0}]))
            for mode in a.modes:
                med = statistics.median(x["tokens_per_s"] for x in results[f"{stage}|{state}|{mode}"])
                summary[f"{stage}|{state}|{mode}"] = med
                ratio = f"{med / one_t:.2f}x" if one_t else "-"
                print(f"| {stage} | {state} | {mode} | {med:.1f} | {ratio} |")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
