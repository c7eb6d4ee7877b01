"""Training throughput: tokens/s and the share of step time spent waiting on data, per mixed-precision mode.

    python benchmarks/bench_train.py --config configs/smollm2-135m.yaml --steps 20 --precision no bf16 \
        output_dir=/tmp/h3r256 data.max_samples=250 data.max_length=256 target.dtype=float32

Needs the config's prepared data and hidden-state cache (eagle3 prepare + eagle3 extract with the same
overrides). Each precision runs the real trainer (`eagle3.trainer.run`) in its own process (accelerate's state
is per process) for --steps optimizer steps into a scratch output folder; the first --warmup steps are not
counted. Prints one line per precision and a JSON summary.

    python benchmarks/bench_train.py --config configs/smollm2-135m.yaml --baseline [same overrides]

prints the unigram baseline instead: the share of valid step-0 positions (loss-masked label, in-vocab target
argmax) whose target argmax is the draft token most frequent among the train split's valid positions; acc_0 of
a trained head should be well above it.

    python benchmarks/bench_train.py --config configs/smollm2-135m.yaml --against a6e3953~1 --ttt 3 7 \
        --precision no bf16 --steps 24 -- [same overrides]

runs the trainer of git revision REV (checked out into a scratch worktree) and this tree's side by side,
alternating, on the same cache and config, for each TTT depth and precision: tokens/s of each and the ratio,
over all counted steps and over the steps after the first epoch, and the loss of both after the same steps.
bf16 is skipped where the CPU has no native bf16 (emulated bf16 measures the emulation). Where the cache
format changed between REV and this tree, `--against-overrides "extract.cache_dir=<REV's cache>"` points REV's
trainer at a cache its own extraction wrote from the same prepared data (BENCHMARKS.md "Training", the
redesign's before/after).

    python benchmarks/bench_train.py --config configs/smollm2-135m.yaml --precision bf16 --steps 40 --rounds 2 \
        --variant "exact:extract.cache_dir=runs/smollm2-135m/cache" \
        --variant "fp8:extract.cache_dir=runs/smollm2-135m/cache-fp8 extract.storage=fp8" -- [same overrides]

runs this tree on each variant's overrides (here: the same data stored exact and fp8), alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trees import REPO, check_imported, checkout  # noqa: E402


def one(config: str, overrides: list[str], out: str, steps: int, precision: str) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    import eagle3
    from eagle3.config import load_config

    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "eagle3_path").write_text(str(Path(eagle3.__file__).parent))
    from eagle3.logs import setup_logging
    from eagle3.trainer import run

    setup_logging()
    cfg = load_config(config, overrides)
    # The cache and prepared data stay where the config says; only the training outputs go to scratch.
    cfg.extract.cache_dir = str(cfg.cache_dir)
    cfg.data.output_dir = str(cfg.prepared_dir)
    cfg.output_dir = out
    t = cfg.train
    t.max_steps, t.save_every, t.eval_every, t.resume, t.mixed_precision = steps, 10**9, 10**9, False, precision
    cfg.tracking.backend = "none"
    run(cfg)


def summarise(out: Path, warmup: int) -> dict[str, float]:
    rows = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    last = rows[-1]
    later = [r for r in rows if r["epoch"] > 0 and r["step"] > warmup]
    rows = [r for r in rows if r["step"] > warmup]

    def tok_s(rs: list[dict]) -> float | None:
        time_s = sum(r["step_s"] for r in rs)
        return sum(r["tokens_per_s"] * r["step_s"] for r in rs) / time_s if rs else None

    time_s = sum(r["step_s"] for r in rows)
    wait = sum(r["data_wait_share"] * r["step_s"] for r in rows)
    return {"steps": len(rows), "tokens_per_s": tok_s(rows), "tokens_per_s_after_epoch_0": tok_s(later),
            "steps_after_epoch_0": len(later), "data_wait_share": wait / time_s, "step_s": time_s / len(rows),
            "padding_share": last["padding_share"], "last_step": last["step"], "last_loss": last["loss"]}


def run_one(tree: Path, config: str, overrides: list[str], steps: int, precision: str, warmup: int) -> dict:
    """The trainer of `tree` (a checkout of this repository) in its own process: accelerate's state is per
    process, and the two trees' `eagle3` packages cannot share one."""
    with tempfile.TemporaryDirectory(prefix=f"bench-train-{precision}-") as tmp:
        cmd = [sys.executable, __file__, "--config", config, "--steps", str(steps), "--one", precision, "--out", tmp,
               *overrides]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
        subprocess.run(cmd, check=True, env=env)
        check_imported(tree, (Path(tmp) / "eagle3_path").read_text())
        return summarise(Path(tmp), warmup)


def compare(a: argparse.Namespace) -> dict:
    """Revision a.against vs this tree, alternating run by run, for each TTT depth and precision."""
    precisions, native = measurable(a.precision)
    results: dict = {"against": a.against, "cpu": cpu_model(), "native_bf16": native, "runs": {}}
    with checkout(a.against) as base:
        for ttt in a.ttt:
            for prec in precisions:
                over = [*a.overrides, f"train.ttt_steps={ttt}"]
                got: dict[str, list[dict]] = {"base": [], "new": []}
                for _ in range(a.rounds):
                    for side, tree in (("base", base), ("new", REPO)):
                        extra = a.against_overrides.split() if side == "base" else []
                        got[side].append(run_one(tree, a.config, [*over, *extra], a.steps, prec, a.warmup))
                row = {side: _mean(rs) for side, rs in got.items()}
                b, n = row["base"], row["new"]
                row["ratio"] = n["tokens_per_s"] / b["tokens_per_s"]
                if b["tokens_per_s_after_epoch_0"] and n["tokens_per_s_after_epoch_0"]:
                    row["ratio_after_epoch_0"] = n["tokens_per_s_after_epoch_0"] / b["tokens_per_s_after_epoch_0"]
                row["loss_rel_diff"] = abs(n["last_loss"] - b["last_loss"]) / abs(b["last_loss"])
                results["runs"][f"ttt{ttt}-{prec}"] = row
                print(f"TTT {ttt}, mixed_precision={prec}: {b['tokens_per_s']:.0f} -> {n['tokens_per_s']:.0f} "
                      f"tokens/s ({row['ratio']:.2f}x; after epoch 0: {row.get('ratio_after_epoch_0', float('nan')):.2f}x), "
                      f"loss at step {n['last_step']}: {b['last_loss']:.6f} vs {n['last_loss']:.6f} "
                      f"(rel diff {row['loss_rel_diff']:.1e})", flush=True)
    return results


def measurable(precisions: list[str]) -> tuple[list[str], bool]:
    """(`precisions` less the reduced ones this CPU only emulates, whether it has native bf16): without
    avx512_bf16/amx a bf16 run measures the emulation, not the trainer. Prints a note for what it drops; full
    precision is spelled `no` (train.mixed_precision) or `fp32`."""
    from eagle3.precision import cpu_native_bf16

    native, why = cpu_native_bf16()
    kept = [p for p in precisions if p in ("no", "fp32") or native]
    if kept != precisions:
        print(f"bench: {', '.join(p for p in precisions if p not in kept)} skipped ({why})", flush=True)
    return kept, native


def variants(a: argparse.Namespace) -> dict:
    """This tree's trainer on each `--variant NAME:OVERRIDES` (e.g. two caches of other storage), alternating run
    by run, on the same config, steps and precision: tokens/s of each and the ratio to the first."""
    named = [(v.split(":", 1)[0], v.split(":", 1)[1].split()) for v in a.variant]
    results: dict = {"cpu": cpu_model(), "runs": {}}
    for prec in a.precision:
        got: dict[str, list[dict]] = {name: [] for name, _ in named}
        for _ in range(a.rounds):
            for name, over in named:
                got[name].append(run_one(REPO, a.config, [*a.overrides, *over], a.steps, prec, a.warmup))
        rows = {name: _mean(rs) for name, rs in got.items()}
        first = rows[named[0][0]]
        for name, row in rows.items():
            row["ratio"] = row["tokens_per_s"] / first["tokens_per_s"]
            print(f"{name}, mixed_precision={prec}: {row['tokens_per_s']:.0f} tokens/s ({row['ratio']:.3f}x of "
                  f"{named[0][0]}), data wait {row['data_wait_share']:.1%}, loss at step {row['last_step']}: "
                  f"{row['last_loss']:.6f}", flush=True)
        results["runs"][prec] = rows
    return results


def _mean(rs: list[dict]) -> dict:
    out = dict(rs[-1])
    for k in ("tokens_per_s", "tokens_per_s_after_epoch_0", "step_s"):
        vals = [r[k] for r in rs if r[k] is not None]
        out[k] = sum(vals) / len(vals) if vals else None
    return out


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def unigram_baseline(config: str, overrides: list[str]) -> dict[str, float]:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from eagle3.cache import HiddenStateDataset
    from eagle3.config import load_config
    from eagle3.data.prepared import load_vocab
    from eagle3.loss import Teacher
    from eagle3.rows import valid_positions
    from eagle3.targets.weights import load_target_head

    cfg = load_config(config, overrides)
    d2t, t2d = load_vocab(cfg.prepared_dir / "vocab.safetensors")
    _, lm_head, _ = load_target_head(cfg.target.path)
    teacher = Teacher(lm_head, d2t, t2d)

    def targets(split: str) -> torch.Tensor:
        ds = HiddenStateDataset(cfg.cache_dir, split)
        out = []
        for i in range(len(ds)):
            it = ds[i]
            tgt = teacher.to_draft[it["target_argmax"][None]]
            valid = valid_positions(it["loss_mask"][None].long(), tgt, 0, cfg.train.mask_out_of_vocab)
            t = len(it["input_ids"])
            out.append(tgt[0, 1 : t - 1][valid[0, : t - 2]])  # step-0 label of position t is teacher[t+1]
        return torch.cat(out)

    train, evald = targets("train"), targets("eval")
    top = int(torch.bincount(train[train >= 0]).argmax())
    return {"most_frequent_draft_id": top, "train_share": float((train == top).float().mean()),
            "eval_share": float((evald == top).float().mean()), "eval_positions": int(evald.numel())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", nargs="+", default=["no", "bf16"], choices=["no", "bf16", "fp16"])
    p.add_argument("--baseline", action="store_true", help="print the unigram acc_0 baseline and exit")
    p.add_argument("--against", metavar="REV", help="compare with the trainer of this git revision")
    p.add_argument("--ttt", type=int, nargs="+", default=[3], help="TTT depths to compare (with --against)")
    p.add_argument("--against-overrides", default="", metavar="OVERRIDES",
                   help="overrides for REV's trainer only, e.g. its own extract.cache_dir when the cache format "
                   "changed between the two (with --against)")
    p.add_argument("--rounds", type=int, default=1, help="alternating runs of each side (with --against)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDES",
                   help="compare this tree on several override sets (repeat; with --rounds)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one precision in this process
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    if a.baseline:
        print(json.dumps(unigram_baseline(a.config, a.overrides), indent=2))
        return 0
    if a.one:
        one(a.config, a.overrides, a.out, a.steps, a.one)
        return 0
    if a.variant:
        print(json.dumps(variants(a), indent=2))
        return 0
    if a.against:
        print(json.dumps(compare(a), indent=2))
        return 0
    results = {}
    for prec in a.precision:
        results[prec] = r = run_one(REPO, a.config, a.overrides, a.steps, prec, a.warmup)
        print(f"mixed_precision={prec}: {r['tokens_per_s']:.0f} tokens/s, {r['step_s']:.2f} s/step, data wait "
              f"{100 * r['data_wait_share']:.2f}% of step time, padding {100 * r['padding_share']:.1f}% "
              f"({r['steps']} steps after {a.warmup} warm-up)", flush=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
