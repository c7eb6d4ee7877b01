"""Held-out simulated acceptance of several trained heads on the same eval split, side by side.

    python benchmarks/bench_heldout.py --config configs/smollm2-135m.yaml \
        --heads runs/smollm2-135m/checkpoints/best runs/smollm2-135m-fp8/checkpoints/best -- output_dir=runs/smollm2-135m

The trainer's own eval (eagle3.trainer.evaluate: greedy-chain `sim_accept_len`, acc_j) over the whole eval split
of the config's cache (during training it reads only `train.eval_max_samples` of it), for each head in turn, so
heads trained from caches of other storage (extract.storage) or on other data are scored on the same exact states
(each in its own draft vocabulary, over the positions whose target token it holds: the trainer's
`train.mask_out_of_vocab`, so position counts differ a little between vocabularies). Prints one line
per head and a JSON summary, and a warning for a head whose run trained on samples of this split (a config with
other sources or seed draws another split: eagle3.data.prepared.samples_seen_in). `--copy` adds each TTT step's
teacher-forced accuracy at the copy positions (where vLLM's prompt lookup proposes the target's next token:
eagle3.objective.copy_positions) and at the others:

    python benchmarks/bench_heldout.py --config configs/smollm2-135m.yaml --copy \
        --heads runs/smollm2-135m/checkpoints/best runs/smollm2-135m-copy3/checkpoints/best
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--heads", nargs="+", required=True, help="draft folders or checkpoints (their draft/)")
    p.add_argument("--copy", action="store_true", help="accuracy at copy positions and elsewhere, per TTT step")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from eagle3.cache import HiddenStateDataset
    from eagle3.checkpoints import resolve_draft_folder
    from eagle3.config import load_config
    from eagle3.data.prepared import load_prepared
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
    embed, lm_head, _ = load_target_head(cfg.target.path)
    data = HiddenStateDataset(cfg.cache_dir, "eval")
    out = {"cache": str(cfg.cache_dir), "eval_samples": len(data), "heads": {}}
    eval_samples = load_prepared(cfg.prepared_dir).eval
    for head in a.heads:
        folder = resolve_draft_folder(head)
        seen = seen_in_training(folder, eval_samples)
        if seen:
            print(f"{head}: WARNING its run trained on {seen} of the {len(eval_samples)} held-out samples scored here "
                  "(a config with other sources or seed draws another split): its figures flatter it", flush=True)
        draft = load_draft(folder, embed_weight=embed)
        # each head in its own draft vocabulary (a head trained on other data has another one)
        teacher = Teacher(lm_head.to(DTYPES[cfg.target.dtype]), draft.d2t, draft.t2d).to(accelerator.device)
        objective = Objective(teacher, cfg.train.model_copy(update={"copy_weight": 1.0}),  # every position weighs 1
                              image_inputs=cfg.draft.image_inputs)
        model = accelerator.prepare(draft)
        ev = evaluate(accelerator, model, objective, data, cfg.train)
        if a.copy:
            ev["copy"] = copy_accuracy(model, objective, data)
            parts = [f"{k} acc_j " + " ".join(f"{x:.4f}" for x in v["acc"]) + f" over {v['positions']}"
                     for k, v in ev["copy"].items()]
            print(f"{head}: " + "; ".join(parts), flush=True)
        out["heads"][head] = ev | {"trained_on_eval_samples": seen}
        print(f"{head}: sim_accept_len {ev['sim_accept_len']:.4f} (teacher-forced {ev['sim_accept_len_tf']:.4f}), "
              + " ".join(f"acc_{j}={ev[f'acc_{j}']:.4f}" for j in range(cfg.train.ttt_steps)), flush=True)
    print(json.dumps(out, indent=2))
    return 0


def seen_in_training(draft_folder: Path, samples) -> int | None:
    """How many of `samples` the head's own run trained on (its prepared/ beside checkpoints/), None where the head
    is not under a run folder of the default layout (data.output_dir moved it, or a bare draft folder)."""
    from eagle3.data.prepared import is_prepared, load_prepared, samples_seen_in
    from eagle3.model_card import run_folder
    from eagle3.paths import RunPaths

    run = run_folder(draft_folder.resolve())
    if run is None or not is_prepared(prepared := RunPaths.under(run).prepared_dir):
        return None
    return samples_seen_in(samples, load_prepared(prepared).train)


@torch.no_grad()
def copy_accuracy(model, objective, data) -> dict[str, dict]:
    """Each TTT step's teacher-forced accuracy (draft argmax == the target's) over the eval split's scored positions,
    split by whether the teacher's position is a copy position."""
    from eagle3.batching import collate
    from eagle3.loss import SoftCE
    from eagle3.objective import copy_positions

    steps = objective.train.ttt_steps
    hits = {k: torch.zeros(steps) for k in ("copy", "other")}
    seen = {k: torch.zeros(steps) for k in ("copy", "other")}
    model.eval()
    for i in range(len(data)):
        batch = collate([data[i]])
        planned = objective.plan(batch)
        b, rows = objective.to_device(planned.batch), planned.rows.to(objective.device)
        copy = copy_positions(batch["input_ids"], batch["target_argmax"]).flatten()[rows.teacher_pos.cpu()]
        probs = objective.teacher.probs(b["final"].flatten(0, 1)[rows.teacher_pos])
        out = model(b["aux"], b["input_ids"], rows, head=SoftCE(probs, rows, 1.0))
        target = objective.teacher.to_draft[b["target_argmax"]].flatten()[rows.teacher_pos]
        for j, am in enumerate(out.argmax):
            tr = rows.teacher_row[j]
            hit, c = (am == target[tr]).cpu(), copy[tr.cpu()]
            hits["copy"][j] += hit[c].sum()
            seen["copy"][j] += c.sum()
            hits["other"][j] += hit[~c].sum()
            seen["other"][j] += (~c).sum()
    return {k: {"acc": (hits[k] / seen[k].clamp(min=1)).tolist(), "positions": int(seen[k][0])} for k in hits}


if __name__ == "__main__":
    raise SystemExit(main())
