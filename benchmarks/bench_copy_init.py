"""Short runs of one head with and without the copy circuit at init (`draft.copy_init`), side by side on the config's
held-out split, at the copy positions and at the others, as initialised and after training.

    python benchmarks/bench_copy_init.py --config configs/smollm2-135m-edits.yaml --steps 400 \
        --arms 0 3 1 1:0.25:0.25 3:0.5:2.0:0 --out runs/bench-copy-init

An arm is GROUPS[:FEATURE_GAIN[:OUTPUT_GAIN[:PREV_WEIGHT]]]: `draft.copy_init=GROUPS` (0: the default init), the
circuit's readouts in fc and its output at those multiples of the default feature's scale, and the weight of the
previous token in its match (eagle3.induction.write_copy_circuit's `feature_gain`, `output_gain`, `prev_weight`;
0.5, 2.0 and 0.7 when left out; 0: a unigram match). Each arm trains `--steps` steps on the config's cache
(same data, seed and schedule, squeezed into the steps) in its own process, then `bench_heldout.py --copy` scores all
of them in one process on the whole held-out split: each TTT step's teacher-forced accuracy where prompt lookup
proposes the target's token (eagle3.objective.copy_positions) and elsewhere, and the greedy-chain sim_accept_len.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


GAINS = ("feature_gain", "output_gain", "prev_weight")
"""write_copy_circuit's arguments an arm may set, in the arm's order; left out, they keep its defaults."""


def parse_arm(arm: str) -> tuple[int, float, float, float]:
    from eagle3.induction import write_copy_circuit

    parts = arm.split(":")
    if not 1 <= len(parts) <= 4:
        raise SystemExit(f"arm {arm!r}: GROUPS[:FEATURE_GAIN[:OUTPUT_GAIN[:PREV_WEIGHT]]]")
    defaults = [inspect.signature(write_copy_circuit).parameters[name].default for name in GAINS]
    gains = [float(x) for x in parts[1:]] + defaults[len(parts) - 1:]
    return int(parts[0]), gains[0], gains[1], gains[2]


def train_arm(config: str, out: Path, arm: str, steps: int, overrides: list[str]) -> None:
    """In this process: one arm's head as initialised (saved to `out`/init), then its `eagle3 train`, with the
    circuit's gains set (eagle3.trainer.copy_init imports write_copy_circuit when it runs, so it calls the patched
    one)."""
    import eagle3.induction as induction
    from eagle3 import trainer
    from eagle3.cli import main
    from eagle3.config import load_config
    from eagle3.formats import save_draft

    groups, feature_gain, output_gain, prev_weight = parse_arm(arm)
    induction.write_copy_circuit = functools.partial(induction.write_copy_circuit, feature_gain=feature_gain,
                                                     output_gain=output_gain, prev_weight=prev_weight)
    args = [f"output_dir={out}", f"train.max_steps={steps}", "train.eval_every=100000", "train.save_every=100000",
            f"draft.copy_init={groups}", *overrides]
    session = trainer.set_up(load_config(config, args))
    save_draft(session.accelerator.unwrap_model(session.model), out / "init")
    raise SystemExit(main(["train", "--config", config, *args]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--arms", nargs="+", default=["0", "3"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train-arm", help=argparse.SUPPRESS)  # internal: train this arm here
    p.add_argument("overrides", nargs="*", help="config overrides for every arm (and the scoring)")
    a = p.parse_args()
    for arm in a.arms:
        parse_arm(arm)
    if a.train_arm:
        train_arm(a.config, a.out, a.train_arm, a.steps, a.overrides)
    from eagle3.config import load_config

    cfg = load_config(a.config, a.overrides)
    # every arm reads the config's own prepared data and cache, wherever its output goes
    shared = [f"data.output_dir={cfg.prepared_dir}", f"extract.cache_dir={cfg.cache_dir}", *a.overrides]
    heads = {}
    for arm in a.arms:
        run = a.out / f"arm-{arm.replace(':', '_')}"
        if not (run / "checkpoints" / "best").is_dir():
            subprocess.run([sys.executable, __file__, "--config", a.config, "--steps", str(a.steps), "--arms", arm,
                            "--out", str(run), "--train-arm", arm, *shared], check=True)
        heads[f"{arm} at init"] = run / "init"
        heads[arm] = run / "checkpoints" / "best"
    score = subprocess.run([sys.executable, str(HERE / "bench_heldout.py"), "--config", a.config, "--copy",
                            "--heads", *map(str, heads.values()), *a.overrides],
                           check=True, stdout=subprocess.PIPE, text=True).stdout
    scored = json.loads(score[score.index("\n{") + 1:])["heads"]
    print(f"\nat init and after {a.steps} steps, held-out split of {a.config} (teacher-forced acc_0 / acc_1 / acc_2, "
          "%)")
    print("| arm (groups:feature:output:prev) | at copy positions | at the others | sim_accept_len |")
    print("|---|---|---|---|")
    summary = {}
    for arm, head in heads.items():
        ev = scored[str(head)]
        copy, other = (" / ".join(f"{100 * x:.1f}" for x in ev["copy"][k]["acc"]) for k in ("copy", "other"))
        print(f"| {arm} | {copy} ({ev['copy']['copy']['positions']}) | {other} ({ev['copy']['other']['positions']}) "
              f"| {ev['sim_accept_len']:.3f} |")
        summary[arm] = ev
    (a.out / "summary.json").write_text(json.dumps({"config": a.config, "steps": a.steps, "arms": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
