"""What bounds the trainer's speed-up: floating-point operations per token, and the time of the matmuls and attention.

    python benchmarks/bench_train_flops.py --config configs/smollm2-135m.yaml --against efee033 -- \
        output_dir=/tmp/bench16 data.max_samples=40 data.max_length=512 target.dtype=float32

For this tree and the trainer of git revision REV (checked out into a scratch worktree), each in its own process,
the real trainer runs --from and then --to optimizer steps under torch.profiler (shapes recorded); the difference
of the two runs is the work of steps from+1..to alone (start-up, the final eval and export cancel), on the same
batches for both trainers. From each matmul's and each attention call's shapes it counts the FLOPs per trained
token, and it times them. Prints per side: MFLOP/token by op, seconds in matmuls and in attention, step time; then
the FLOP ratio (the speed-up at equal efficiency) and the ceiling: REV's step time over this tree's matmul +
attention time, the speed-up if everything else in this tree's step cost nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import cpu_model, one  # noqa: E402
from trees import REPO, checkout, run_in_tree  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def flops(name: str, shapes: list) -> int:
    """FLOPs of one call from its input shapes (0 for ops not counted here)."""
    if name == "aten::mm":
        (m, k), (_, n) = shapes[0], shapes[1]
        return 2 * m * k * n
    if name in ("aten::addmm", "aten::addmm_"):
        (m, k), (_, n) = shapes[1], shapes[2]
        return 2 * m * k * n
    if name == "aten::bmm":
        (b, m, k), (_, _, n) = shapes[0], shapes[1]
        return 2 * b * m * k * n
    if name == ATTENTION[0]:  # q [B, H, M, D], k [B, H, N, D]: QK^T and PV
        b, h, m, d = shapes[0]
        return 4 * b * h * m * shapes[1][2] * d
    if name == ATTENTION[1]:  # grad_out, q, k, v: S recomputed, dV, dP, dQ, dK
        b, h, m, d = shapes[1]
        return 10 * b * h * m * shapes[2][2] * d
    return 0


def profiled(config: str, overrides: list[str], steps: int) -> dict:
    """One trainer run of `steps` steps under the profiler: FLOPs and self time per counted op, tokens, step time."""
    from torch.profiler import ProfilerActivity, profile

    import eagle3

    with tempfile.TemporaryDirectory(prefix="bench-flops-") as out:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            one(config, overrides, out, steps, "no")
        rows = [json.loads(x) for x in (Path(out) / "train_log.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    ops: dict[str, list[float]] = {}
    for e in prof.events():
        f = flops(e.name, e.input_shapes) if e.name in MATMULS + ATTENTION else 0
        if f:
            acc = ops.setdefault(e.name, [0.0, 0.0])
            acc[0] += f
            acc[1] += e.self_cpu_time_total / 1e6
    return {"ops": ops, "tokens": sum(r["tokens_per_s"] * r["step_s"] for r in rows),
            "step_s": sum(r["step_s"] for r in rows), "eagle3": str(Path(eagle3.__file__).parent)}


def side(tree: Path, a: argparse.Namespace) -> dict:
    """Steps from+1..to of `tree`'s trainer: the difference of two profiled runs, each in its own process."""
    lo, hi = (run_in_tree(__file__, tree, ["--config", a.config, "--one", str(steps), *a.overrides])
              for steps in (a.from_, a.to))
    tokens = hi["tokens"] - lo["tokens"]
    by_op = {k: [v[0] - lo["ops"].get(k, [0, 0])[0], v[1] - lo["ops"].get(k, [0, 0])[1]] for k, v in hi["ops"].items()}
    mm = [v for k, v in by_op.items() if k in MATMULS]
    at = [v for k, v in by_op.items() if k in ATTENTION]
    return {"tokens": tokens, "step_s": hi["step_s"] - lo["step_s"],
            "mflop_per_token": {k: v[0] / tokens / 1e6 for k, v in by_op.items()},
            "total_mflop_per_token": sum(v[0] for v in by_op.values()) / tokens / 1e6,
            "matmul_s": sum(v[1] for v in mm), "attention_s": sum(v[1] for v in at),
            "matmul_gflops": sum(v[0] for v in mm) / max(sum(v[1] for v in mm), 1e-9) / 1e9}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--against", metavar="REV", help="the trainer to compare with (required)")
    p.add_argument("--from", dest="from_", type=int, default=4, help="steps of the first run (not counted)")
    p.add_argument("--to", type=int, default=12, help="steps of the second run")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    if a.one is not None:
        Path(a.out).write_text(json.dumps(profiled(a.config, a.overrides, a.one)))
        return 0
    if not a.against:
        p.error("--against REV is required")
    with checkout(a.against) as base:
        res = {"against": a.against, "cpu": cpu_model(), "base": side(base, a), "new": side(REPO, a)}
    b, n = res["base"], res["new"]
    res["flop_ratio"] = b["total_mflop_per_token"] / n["total_mflop_per_token"]
    res["time_ratio"] = (b["step_s"] / b["tokens"]) / (n["step_s"] / n["tokens"])
    res["ceiling"] = (b["step_s"] / b["tokens"]) / ((n["matmul_s"] + n["attention_s"]) / n["tokens"])
    for name, s in (("base", b), ("new", n)):
        print(f"{name}: {s['total_mflop_per_token']:.1f} MFLOP/token, step {s['step_s']:.2f} s for {s['tokens']:.0f} "
              f"tokens: matmuls {s['matmul_s']:.2f} s ({s['matmul_gflops']:.0f} GFLOP/s), attention "
              f"{s['attention_s']:.2f} s, the rest {s['step_s'] - s['matmul_s'] - s['attention_s']:.2f} s", flush=True)
    print(f"FLOP ratio {res['flop_ratio']:.3f}x, time ratio (under the profiler) {res['time_ratio']:.3f}x, ceiling "
          f"(the new step's matmuls and attention only) {res['ceiling']:.3f}x", flush=True)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
