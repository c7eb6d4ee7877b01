"""Held-out simulated acceptance of several trained heads on the same eval split, side by side.

    python benchmarks/bench_heldout.py --config configs/smollm2-135m.yaml \
        --heads runs/smollm2-135m/checkpoints/best runs/smollm2-135m-fp8/checkpoints/best -- output_dir=runs/smollm2-135m

The trainer's own eval (eagle3.trainer.evaluate: greedy-chain `sim_accept_len`, acc_j) over the whole eval split
of the config's cache (during training it reads only `train.eval_max_samples` of it), for each head in turn, so
heads trained from caches of other storage (extract.storage) are scored on the same exact states. Prints one line
per head and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--heads", nargs="+", required=True, help="draft folders or checkpoints (their draft/)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from eagle3.cache import HiddenStateDataset
    from eagle3.checkpoints import resolve_draft_folder
    from eagle3.config import load_config
    from eagle3.data.prepared import load_vocab
    from eagle3.formats import load_draft
    from eagle3.logs import setup_logging
    from eagle3.loss import Teacher
    from eagle3.objective import Objective
    from eagle3.precision import DTYPES
    from eagle3.targets.weights import load_target_head
    from eagle3.trainer import evaluate, make_accelerator

    setup_logging()
    cfg = load_config(a.config, a.overrides)
    cfg.train.eval_max_samples = None
    accelerator = make_accelerator(cfg.train, cfg.tracking, cfg.paths)
    d2t, t2d = load_vocab(cfg.prepared_dir / "vocab.safetensors")
    embed, lm_head, _ = load_target_head(cfg.target.path)
    teacher = Teacher(lm_head.to(DTYPES[cfg.target.dtype]), d2t, t2d).to(accelerator.device)
    objective = Objective(teacher, cfg.train)
    data = HiddenStateDataset(cfg.cache_dir, "eval")
    out = {"cache": str(cfg.cache_dir), "eval_samples": len(data), "heads": {}}
    for head in a.heads:
        draft = load_draft(resolve_draft_folder(head), embed_weight=embed)
        ev = evaluate(accelerator, accelerator.prepare(draft), objective, data, cfg)
        out["heads"][head] = ev
        print(f"{head}: sim_accept_len {ev['sim_accept_len']:.4f} (teacher-forced {ev['sim_accept_len_tf']:.4f}), "
              + " ".join(f"acc_{j}={ev[f'acc_{j}']:.4f}" for j in range(cfg.train.ttt_steps)), flush=True)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
