"""The fused lm_head + soft cross-entropy (eagle3.loss.linear_soft_ce) of this tree against a git revision's, and
row_max against torch.max over the last dim.

    python benchmarks/bench_soft_ce.py --against f726daf

Shapes: one micro-batch of the SmolLM2 recipe (3 TTT steps x 800 scored rows, hidden 576, draft vocab 8192; the
default) or any --rows/--hidden/--vocab. Each tree runs in its own process, alternating --rounds times; the
figure is the median of --reps forward + backward calls after two warm-up calls. float32, --threads torch threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trees import REPO, checkout, run_in_tree  # noqa: E402


def _median_ms(f, reps: int) -> float:
    for _ in range(2):
        f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def one(a: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    import eagle3
    from eagle3.loss import linear_soft_ce

    torch.manual_seed(0)
    w = (torch.randn(a.vocab, a.hidden) * 0.05).requires_grad_()
    probs = torch.softmax(torch.randn(a.rows + 200, a.vocab) * 3, -1)
    xs = [torch.randn(a.rows, a.hidden, requires_grad=True) for _ in range(a.steps)]
    index = [torch.randperm(a.rows + 200)[: a.rows].sort().values for _ in range(a.steps)]
    scales = torch.tensor([0.8**j / a.rows for j in range(a.steps)])

    def step() -> None:
        linear_soft_ce(xs, w, probs, index, scales, 4096).loss.backward()

    return {"eagle3": str(Path(eagle3.__file__).parent), "soft_ce_ms": _median_ms(step, a.reps)}


def row_max_vs_max(a: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    from eagle3.targets.argmax import row_max

    z = torch.randn(a.rows, a.vocab)
    ref, got = z.max(-1), row_max(z)
    assert torch.equal(ref[1], got[1]) and torch.equal(ref[0], got[0])
    return {"torch_max_ms": _median_ms(lambda: z.max(-1), a.reps), "row_max_ms": _median_ms(lambda: row_max(z), a.reps)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", metavar="REV", help="also time the fused loss of this git revision")
    p.add_argument("--rows", type=int, default=800)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        Path(a.out).write_text(json.dumps(one(a)))
        return 0
    argv = [f"--{k}={getattr(a, k)}" for k in ("rows", "hidden", "vocab", "steps", "reps", "threads")] + ["--one"]
    res: dict = {"shape": {k: getattr(a, k) for k in ("rows", "hidden", "vocab", "steps")},
                 "row_max": row_max_vs_max(a)}
    r = res["row_max"]
    print(f"[{a.rows}, {a.vocab}] float32: torch.max(-1) {r['torch_max_ms']:.2f} ms, row_max {r['row_max_ms']:.2f} ms "
          f"({r['torch_max_ms'] / r['row_max_ms']:.1f}x)", flush=True)
    if a.against:
        got: dict[str, list[float]] = {"base": [], "new": []}
        with checkout(a.against) as base:
            for _ in range(a.rounds):
                for name, tree in (("base", base), ("new", REPO)):
                    got[name].append(run_in_tree(__file__, tree, argv)["soft_ce_ms"])
        b, n = statistics.median(got["base"]), statistics.median(got["new"])
        res["soft_ce_ms"] = {"against": a.against, **got, "ratio": b / n}
        print(f"linear_soft_ce forward + backward, {a.steps} steps x {a.rows} rows: {a.against} {b:.1f} ms -> "
              f"this tree {n:.1f} ms ({b / n:.3f}x)", flush=True)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
