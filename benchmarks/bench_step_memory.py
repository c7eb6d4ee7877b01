"""Peak memory of one Kimi-K2.5-sized training step on the CPU, synthetic weights: this tree vs git revisions.

    python benchmarks/bench_step_memory.py --against efee033 --against 858a390
    python benchmarks/bench_step_memory.py --tokens 512 --hidden 1024 --intermediate 2048 --vocab 32768 --draft-vocab 8192
    python benchmarks/bench_step_memory.py --arch mla --draft-vocab 163840     # the published Kimi MLA head's kind

The shape (defaults): the Kimi-K2.5 head (hidden 7168, 64 heads x 128, MLP 18432, target vocab 163840, draft
vocab 32000, TTT 3; `--arch mla`: Kimi-K2.5's own MLA dimensions, q_lora 1536, kv_lora 512, nope 128, rope 64,
v 128, YaRN factor 64), one 4096-token sample, 73% of it assistant tokens (ShareGPT's share at 512 tokens). The
head's weights, its frozen embeddings and the teacher's lm_head are bf16 (`--params fp32` for fp32 head
weights): the head's forward and backward on bf16 parameters is what an FSDP2 bf16 step runs, and fp32 head
weights with their gradients (~9.5 GB) plus the older trainer's activations do not fit this 24 GB machine.

Each tree (a checkout of this repository at REV, in a scratch `git worktree`; and this one) runs its own
trainer's loss of one micro-batch and the backward in its own process, after building everything: the figure is the
peak resident memory of that step above what was resident before it (Linux VmHWM, reset just before), so it
holds the activations, the loss's temporaries and the head's gradients (the same for every tree: 2 bytes per
parameter in bf16), not the weights. A tree whose trainer takes the cache's target_argmax gets it in the batch,
as a cache written by its extraction holds it.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trees import REPO, checkout, run_in_tree  # noqa: E402


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def one(a: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    import eagle3
    from eagle3 import trainer
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig

    Teacher = trainer.Teacher
    dtype = torch.bfloat16 if a.params == "bf16" else torch.float32
    torch.manual_seed(0)
    h, v, vd, n = a.hidden, a.vocab, a.draft_vocab, a.tokens
    embed = torch.empty(v, h, dtype=torch.bfloat16).normal_(0, 0.02)
    lm_head = torch.empty(v, h, dtype=torch.bfloat16).normal_(0, 0.02)
    mla = {} if a.arch == "llama" else {
        "arch": "mla", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "max_position_embeddings": 262144,
        "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
    c = Eagle3DraftConfig(hidden_size=h, num_attention_heads=a.heads, num_key_value_heads=a.heads, head_dim=128,
                          intermediate_size=a.intermediate, vocab_size=v, draft_vocab_size=vd, target_hidden_size=h,
                          **mla)
    model = Eagle3Draft(c, embed_weight=embed).to(dtype)
    ids = torch.arange(vd) * (v // vd)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    model.set_vocab(ids - torch.arange(vd), t2d)
    new = importlib.util.find_spec("eagle3.objective") is not None  # one Objective owns the step
    teacher = Teacher(lm_head, ids - torch.arange(vd), t2d) if new else Teacher(lm_head, ids - torch.arange(vd), t2d, 8192)
    prompt = int(n * (1 - a.assistant_share))
    mask = torch.zeros(1, n, dtype=torch.long)
    mask[0, prompt:] = 1
    batch = {"aux": torch.randn(1, n, 3 * h, dtype=torch.bfloat16), "final": torch.randn(1, n, h, dtype=torch.bfloat16),
             "input_ids": torch.randint(0, v, (1, n)), "loss_mask": mask, "lengths": torch.tensor([n])}
    cfg = SimpleNamespace(train=SimpleNamespace(ttt_steps=a.ttt, step_decay=0.8, mask_out_of_vocab=True,
                                                loss_chunk_rows=a.loss_chunk_rows, teacher_chunk=8192))
    device = torch.device("cpu")
    planned = new or "micro" in inspect.signature(trainer.forward_loss).parameters
    if planned:  # this trainer reads the target's argmax from the cache
        from eagle3.targets.argmax import lm_head_argmax

        batch["target_argmax"] = lm_head_argmax(lm_head, batch["final"][0], 8192).to(torch.int32)[None]
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter
    before = _status("VmRSS:")
    t0 = time.perf_counter()
    if new:
        from eagle3.objective import Objective

        objective = Objective(teacher, cfg.train)
        loss, _ = objective.loss(model, objective.plan(batch))
    elif planned:
        micro = trainer.plan_micro(teacher, batch, cfg, device)
        loss, _ = trainer.forward_loss(model, teacher, micro, cfg, device)
    else:
        loss, _ = trainer.forward_loss(model, teacher, batch, cfg)
    loss.backward()
    dt = time.perf_counter() - t0
    peak = _status("VmHWM:")
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return {"eagle3": str(Path(eagle3.__file__).parent), "peak_extra_gb": (peak - before) / 1e9,
            "peak_gb": peak / 1e9, "resident_before_gb": before / 1e9, "grads_gb": grads / 1e9,
            "head_params": n_params, "step_s": dt, "loss": float(loss.detach())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", action="append", default=[], metavar="REV", help="also measure this git revision")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=18432)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--ttt", type=int, default=3)
    p.add_argument("--arch", choices=["llama", "mla"], default="llama", help="the draft layer (this tree only)")
    p.add_argument("--assistant-share", type=float, default=0.73)
    p.add_argument("--params", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--loss-chunk-rows", type=int, default=4096, help="train.loss_chunk_rows (the fused loss)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        Path(a.out).write_text(json.dumps(one(a)))
        return
    argv = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
            ("tokens", "hidden", "heads", "intermediate", "vocab", "draft_vocab", "ttt", "assistant_share", "params",
             "loss_chunk_rows")]
    argv.append("--one")
    if a.arch != "llama":
        if a.against:
            raise SystemExit("--arch mla measures this tree only (earlier trees have no MLA layer)")
        argv.append(f"--arch={a.arch}")
    rows = []
    for rev in a.against:
        with checkout(rev) as tree:
            rows.append((rev, run_in_tree(__file__, tree, argv)))
        print(rev, json.dumps(rows[-1][1]), flush=True)
    rows.append(("this tree", run_in_tree(__file__, REPO, argv)))
    print("this tree", json.dumps(rows[-1][1]), flush=True)
    print(f"\nshape: {a.arch} layer, {a.tokens} tokens, hidden {a.hidden}, vocab {a.vocab}, draft vocab {a.draft_vocab}, TTT {a.ttt}, "
          f"head weights {a.params}, {rows[-1][1]['head_params'] / 1e9:.2f} B head parameters")
    print("| trainer | peak memory of the step above the weights | of which the head's gradients | step time |")
    print("|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['peak_extra_gb']:.2f} GB | {r['grads_gb']:.2f} GB | {r['step_s']:.0f} s |")


if __name__ == "__main__":
    main()
