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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def one(config: str, overrides: list[str], out: str, steps: int, precision: str) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from eagle3.config import load_config
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
    rows = [r for r in rows if "loss" in r and r["step"] > warmup]
    time_s = sum(r["step_s"] for r in rows)
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in rows)
    wait = sum(r["data_wait_share"] * r["step_s"] for r in rows)
    return {"steps": len(rows), "tokens_per_s": tokens / time_s, "data_wait_share": wait / time_s,
            "step_s": time_s / len(rows), "padding_share": rows[-1]["padding_share"], "last_loss": rows[-1]["loss"]}


def unigram_baseline(config: str, overrides: list[str]) -> dict[str, float]:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from eagle3.cache import HiddenStateDataset
    from eagle3.config import load_config
    from eagle3.data.prepared import load_vocab
    from eagle3.loss import Teacher, valid_positions
    from eagle3.targets.weights import load_target_head

    cfg = load_config(config, overrides)
    d2t, t2d = load_vocab(cfg.prepared_dir / "vocab.safetensors")
    _, lm_head, _ = load_target_head(cfg)
    teacher = Teacher(lm_head, d2t, t2d, cfg.train.teacher_chunk)

    def targets(split: str) -> torch.Tensor:
        ds = HiddenStateDataset(cfg.cache_dir, split)
        out = []
        for i in range(len(ds)):
            it = ds[i]
            tgt = teacher(it["final"][None]).draft_target
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
    results = {}
    for prec in a.precision:
        with tempfile.TemporaryDirectory(prefix=f"bench-train-{prec}-") as tmp:
            cmd = [sys.executable, __file__, "--config", a.config, "--steps", str(a.steps), "--one", prec,
                   "--out", tmp, *a.overrides]
            subprocess.run(cmd, check=True)
            results[prec] = summarise(Path(tmp), a.warmup)
        r = results[prec]
        print(f"mixed_precision={prec}: {r['tokens_per_s']:.0f} tokens/s, {r['step_s']:.2f} s/step, data wait "
              f"{100 * r['data_wait_share']:.2f}% of step time, padding {100 * r['padding_share']:.1f}% "
              f"({r['steps']} steps after {a.warmup} warm-up)", flush=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
