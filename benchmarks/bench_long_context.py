"""Long samples (issue 43): peak memory and tokens/s of one training step at 2K-32K tokens, with and without
`train.activation_checkpointing`.

    python benchmarks/bench_long_context.py                                      # SmolLM2-135M's head, this CPU
    python benchmarks/bench_long_context.py --lengths 2048 8192 --precision fp32
    python benchmarks/bench_long_context.py --head kimi --device cuda            # Kimi-K2.5's width, on a GPU
    python benchmarks/bench_long_context.py --head kimi --arch mla --device cuda

The heads are scripts/gpu_check_train.py's synthetic ones: `smollm2` (hidden 576, 9 heads / 3 KV heads of 64, MLP 1536,
draft vocab 8192) and `kimi` (hidden 7168, 64 heads of 128, MLP 18432, draft vocab 32000; `--arch mla`: Kimi-K2.5's
own MLA dimensions), TTT 3 (`--ttt`). One sample of each length, 73% of it assistant tokens (ShareGPT's share), the
target's argmax in the draft vocab at 97% of them (gpu_check_train.synthetic_batch), through the real objective
(eagle3.objective: the rows each step scores, the fused lm_head + soft-CE) and its backward; fp32 weights, bf16 under
autocast as `train.mixed_precision: bf16` runs it (`--precision`, default: bf16 where the device has it natively;
`--params bf16`: bf16 weights, as FSDP2's bf16 step computes on, for a Kimi-width head on a 24 GB CPU machine).

Each (length, checkpointing) runs in its own process: it builds the head, the teacher and the batch, runs one short
warm-up step, then the measured one. Peak memory is that step's high-water mark above what was resident (CPU:
Linux VmHWM, reset just before; CUDA: the allocator's peak above what was allocated): the activations and the
loss's temporaries, not the weights, their gradients (allocated by the warm-up) or the batch. The AdamW step is
left out: its state is per parameter, not per token. Per token, a flat column means memory linear in the length; the goal is 32K within
1.25x of 2K. Attention's compute grows with the length (each query reads every earlier key); the last column is
its share of the step's FLOPs, counted from the shapes (the causal half of QK^T and PV, forward and backward; the
rest: the matmuls of fc, the layer, the lm_head and the teacher on the rows they run on).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench_step_memory import _status  # noqa: E402  (a /proc/self/status field, in bytes)
from gpu_check_train import KIMI, SMOLLM2, _head, synthetic_batch  # noqa: E402

HEADS = {"smollm2": SMOLLM2, "kimi": KIMI}


def flops(sizes, arch: str, rows, steps: int, t: int) -> tuple[float, float]:
    """(attention, everything else) FLOPs of the step, forward + backward (3x the forward's matmuls)."""
    h, heads = sizes.hidden, sizes.heads
    d = sizes.head_dim if arch == "llama" else sizes.mla["qk_nope_head_dim"] + sizes.mla["qk_rope_head_dim"]
    kv = (sizes.kv_heads or heads) * d
    if arch == "llama":
        layer = 2 * h * (heads * d + 2 * kv) + heads * d * h
    else:
        m = sizes.mla
        layer = (2 * h * (m["q_lora_rank"] + m["kv_lora_rank"] + m["qk_rope_head_dim"])
                 + m["q_lora_rank"] * heads * d + m["kv_lora_rank"] * heads * (m["qk_nope_head_dim"] + m["v_head_dim"])
                 + heads * m["v_head_dim"] * h)
    layer += 3 * h * sizes.intermediate
    vocab = sizes.draft_vocabs[0]
    attn, rest = 0.0, 2.0 * 3 * h * h * t  # fc
    for j in range(steps):
        n = t if j == 0 else int(rows.keep[j].numel())
        dp = d if j == 0 else -(-(d + j) // 8) * 8
        attn += 3 * 2 * heads * dp * t * t  # QK^T and PV over the causal half, forward + backward
        rest += 3 * 2 * layer * n + 3 * 2 * h * vocab * int(rows.score[j].numel())
    rest += 2 * h * vocab * int(rows.teacher_pos.numel())  # the teacher's draft-vocab logits, forward only
    return attn, rest


def one(a: argparse.Namespace) -> dict:
    import torch

    import eagle3
    from eagle3.config import TrainConfig
    from eagle3.objective import Objective

    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    sizes = HEADS[a.head]
    model, teacher, lm_head = _head(sizes, a.arch, sizes.draft_vocabs[0], device)
    del lm_head  # the teacher keeps its draft-vocab rows
    if a.params == "bf16":
        model.to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    objective = Objective(teacher, TrainConfig(ttt_steps=a.ttt, activation_checkpointing=a.checkpointing))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")

    def step(planned) -> None:
        with autocast:
            loss, _ = objective.loss(model, planned)
        loss.backward()
        for p in params:  # kept allocated: the measured step's peak is its own, not the gradients'
            p.grad.zero_()

    step(objective.plan(synthetic_batch(teacher, sizes.hidden, 1, 256)))  # warm up kernels and the allocator
    planned = objective.plan(synthetic_batch(teacher, sizes.hidden, 1, a.length))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status("VmRSS:")
    t0 = time.perf_counter()
    step(planned)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _status("VmHWM:")) - base
    attn, rest = flops(sizes, a.arch, planned.rows, a.ttt, a.length)
    return {"eagle3": str(Path(eagle3.__file__).parent), "length": a.length, "checkpointing": a.checkpointing,
            "peak_bytes": peak, "step_s": dt, "tokens_per_s": a.length / dt, "attention_flop_share": attn / (attn + rest),
            "gflop_per_s": (attn + rest) / dt / 1e9}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "?").strip()
    family = fields.get("CPU family", "").strip()
    bf16 = "avx512_bf16" in fields.get("Flags", "") or "amx_bf16" in fields.get("Flags", "")
    return f"{name}{f' (family {family})' if family else ''}, native bf16 (avx512_bf16/amx): {'yes' if bf16 else 'no'}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", choices=sorted(HEADS), default="smollm2")
    p.add_argument("--arch", choices=["llama", "mla"], default="llama")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    p.add_argument("--ttt", type=int, default=3)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1)))
    p.add_argument("--checkpointing", choices=["both", "on", "off"], default="both")
    p.add_argument("--params", choices=["fp32", "bf16"], default="fp32",
                   help="the head's weights (bf16: what an FSDP2 bf16 step computes on; fits a Kimi-width head's "
                        "weights and gradients in a 24 GB CPU machine)")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one length in this process
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.precision == "auto":
        from eagle3.precision import resolve_mixed_precision

        a.precision = "bf16" if resolve_mixed_precision("auto", a.device.split(":")[0]) == "bf16" else "fp32"
    if a.one is not None:
        a.length, a.checkpointing = a.one, a.checkpointing == "on"
        Path(a.out).write_text(json.dumps(one(a)))
        return 0
    import torch

    where = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else cpu_name()
    print(f"{a.head} head ({a.arch}), TTT {a.ttt}, {a.precision}, {a.params} weights, {where}, torch {torch.__version__}, "
          f"{a.threads} thread(s)", flush=True)
    modes = {"both": ["off", "on"], "on": ["on"], "off": ["off"]}[a.checkpointing]
    results = []
    for mode in modes:
        for length in a.lengths:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                argv = [sys.executable, __file__, "--one", str(length), "--checkpointing", mode, "--out", out.name,
                        "--head", a.head, "--arch", a.arch, "--ttt", str(a.ttt), "--precision", a.precision,
                        "--device", a.device, "--threads", str(a.threads), "--params", a.params]
                subprocess.run(argv, check=True)
                results.append(json.loads(Path(out.name).read_text()))
            r = results[-1]
            print(f"  {length:>6} tokens, checkpointing {mode:>3}: peak {r['peak_bytes'] / 2**20:8.0f} MB, "
                  f"{r['step_s']:7.1f} s, {r['tokens_per_s']:7.0f} tokens/s", flush=True)
    print("\n| tokens | checkpointing | peak MB | KB/token | per token vs the shortest | KB per added token "
          "| step s | tokens/s | attention's share of the FLOPs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        first = next(x for x in results if x["checkpointing"] == r["checkpointing"])
        per, per0 = r["peak_bytes"] / r["length"], first["peak_bytes"] / first["length"]
        added = ((r["peak_bytes"] - first["peak_bytes"]) / (r["length"] - first["length"]) / 1024
                 if r is not first else float("nan"))
        print(f"| {r['length']} | {'on' if r['checkpointing'] else 'off'} | {r['peak_bytes'] / 2**20:.0f} | "
              f"{per / 1024:.1f} | {per / per0:.2f}x | {'' if r is first else f'{added:.1f}'} | {r['step_s']:.1f} | "
              f"{r['tokens_per_s']:.0f} | {100 * r['attention_flop_share']:.0f}% |")
    print(json.dumps({"head": a.head, "arch": a.arch, "precision": a.precision, "params": a.params, "where": where,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
