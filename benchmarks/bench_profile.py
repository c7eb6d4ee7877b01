"""Where a training step's time goes: torch.profiler over optimizer steps of the real objective (eagle3.objective)
on synthetic features, by operator and by phase (each TTT step's forward, the loss, the backward, the optimizer).

    python benchmarks/bench_profile.py --precision bf16 --ttt 4 --threads 2          # SmolLM2-135M head shapes
    python benchmarks/bench_profile.py --precision fp32 --ttt 4 --threads 2

Shapes (defaults): the SmolLM2-135M head of configs/smollm2-135m.yaml (hidden 576, 9 heads x 64, 3 KV heads, MLP
1536, target vocab 49152, draft vocab 8192) on one micro-batch of `--tokens` (1024: two 512-token samples, 73% of
them assistant tokens, ShareGPT's share), the shape of BENCHMARKS.md "Training speed"'s side-by-side with
SpecForge. fp32 weights; `bf16` runs the step under CPU autocast as `train.mixed_precision: bf16` does. The
states are random: the time of a step does not depend on their values. Prints the top operators by self CPU time
and the phase table; one warm-up step is not profiled.

    python benchmarks/bench_profile.py --precision bf16 --ttt 4 --steps 8 --config configs/smollm2-135m.yaml \
        -- output_dir=runs/bench32 data.max_samples=320

profiles the real trainer instead (`eagle3.trainer.set_up` + `train_step`, what `eagle3 train` runs) on the
config's cached batches, preloaded so the data thread is out of the picture, with each part of the step named:
the fused lm_head + loss (`softce`), the teacher's distribution, the backward, grad clipping, the optimizer.
Needs the config's prepared data and cache (BENCHMARKS.md "Where a bf16 step's time goes").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from gpu_check_train import SMOLLM2, _head, synthetic_batch  # noqa: E402  (the synthetic head and teacher of the GPU check)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--ttt", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--config", help="profile the real trainer on this config's cache (with the overrides after --)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.config:
        return real_trainer(a)
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from eagle3.config import TrainConfig
    from eagle3.objective import Objective

    torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    model, teacher, _ = _head(SMOLLM2, "llama", SMOLLM2.draft_vocabs[0], device)
    batch = synthetic_batch(teacher, SMOLLM2.hidden, 2, a.tokens // 2)
    objective = Objective(teacher, TrainConfig(ttt_steps=a.ttt))
    planned = objective.plan(batch)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16")

    def step() -> None:
        with record_function("forward+loss"), autocast:
            loss, _ = objective.loss(model, planned)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
    seconds = (time.perf_counter() - t0) / a.steps
    print(f"{a.precision}, TTT {a.ttt}, {a.tokens} tokens, {a.threads} threads: {seconds * 1e3:.0f} ms/step "
          f"({a.tokens / seconds:.0f} tokens/s, profiled)")
    events = prof.key_averages()
    phases = [e for e in events if e.key in {"forward+loss", "backward", "optimizer"} or e.key.startswith("ttt_step_")]
    total = sum(e.cpu_time_total for e in phases if e.key in {"forward+loss", "backward", "optimizer"})
    print("\nphase                  ms/step   share")
    for e in sorted(phases, key=lambda e: e.key):
        print(f"{e.key:<20} {e.cpu_time_total / a.steps / 1e3:9.1f}  {e.cpu_time_total / total:6.1%}")
    print(f"\ntop {a.top} operators by self CPU time")
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=40))
    return 0


def real_trainer(a: argparse.Namespace) -> int:
    """The trainer's own step (eagle3.trainer.train_step) on preloaded cached batches, its parts named."""
    import functools
    import tempfile
    from contextlib import closing

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import eagle3.loss
    from eagle3 import trainer
    from eagle3.batching import plan_epoch
    from eagle3.config import load_config
    from eagle3.logs import setup_logging

    torch.set_num_threads(a.threads)
    setup_logging()
    cfg = load_config(a.config, [*a.overrides, f"train.ttt_steps={a.ttt}", f"cpu_threads={a.threads}"])
    cfg.extract.cache_dir, cfg.data.output_dir = str(cfg.cache_dir), str(cfg.prepared_dir)
    cfg.output_dir = tempfile.mkdtemp(prefix="bench-profile-")  # the cache stays; nothing is written next to it
    t = cfg.train
    t.mixed_precision = "no" if a.precision == "fp32" else "bf16"
    t.resume, t.max_steps, t.save_every, t.eval_every, cfg.tracking.backend = False, 10**6, 10**9, 10**9, "none"
    s = trainer.set_up(cfg)

    def named(obj: object, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)

        setattr(obj, attr, wrapper)

    for obj, attr, label in [(s.objective, "loss", "forward+loss"), (s.objective.teacher, "probs", "teacher"),
                             (s.accelerator, "backward", "backward"), (s.accelerator, "clip_grad_norm_", "clip"),
                             (s.optimizer, "step", "optimizer"), (eagle3.loss._LinearSoftCE, "apply", "softce")]:
        named(obj, attr, label)
    plan = plan_epoch(s.train_ds.lengths, t.batch_tokens, t.seed, 0, 0, 1)
    n = min(len(plan.batches), a.steps + 1)
    with closing(s.train_ds.iter_collated(plan.batches[:n], False)) as it:
        batches = iter(list(it))
    trainer.train_step(s, batches, plan)  # the warm-up step, not profiled
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n - 1):
            trainer.train_step(s, batches, plan)
    seconds = (time.perf_counter() - t0) / (n - 1)
    print(f"{a.precision}, TTT {a.ttt}, the trainer on {a.config}'s cache, {a.threads} threads: {seconds * 1e3:.0f} "
          f"ms/step over {n - 1} steps (profiled)")
    events = prof.key_averages()
    names = {"forward+loss", "softce", "teacher", "backward", "clip", "optimizer"}
    print("\nphase                  ms/step")
    for e in sorted((e for e in events if e.key in names or e.key.startswith("ttt_step_")), key=lambda e: e.key):
        print(f"{e.key:<20} {e.cpu_time_total / (n - 1) / 1e3:9.1f}")
    print(f"\ntop {a.top} operators by self CPU time")
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=40))
    return 0


if __name__ == "__main__":
    sys.exit(main())
