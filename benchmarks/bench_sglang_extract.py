"""Extraction throughput through SGLang vs the HF backend, on the same prepared samples (CPU: informational only).

    bash scripts/setup_sglang_cpu.sh
    eagle3 prepare --config configs/smollm2-135m-quickstart.yaml        # the quickstart's 120 conversations
    python benchmarks/bench_sglang_extract.py --config configs/smollm2-135m-quickstart.yaml --samples 64 --threads 2

Starts eagle3's capture server (the real SGLang in .venv-sglang, CPU stand-ins of tests/sglang_cpu, torch_native
attention) once, then runs the same length-sorted batches through `SGLangTarget.capture` and `HFTarget.capture`,
alternating batch by batch, so other load on the machine hits both alike. Prints tokens/s of each, the ratio, and
the largest per-layer difference between the two. SGLang's CPU path is not its production one (no AMX kernels,
pure-PyTorch stand-ins), so the ratio says nothing about GPUs; it bounds how long the CPU tests take.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from eagle3.batching import plan_batches
    from eagle3.config import load_config
    from eagle3.data.prepared import load_prepared
    from eagle3.targets.hf import HFTarget
    from eagle3.targets.sglang import SGLangTarget

    py = os.environ.get("EAGLE3_SGLANG_PYTHON") or str(REPO / ".venv-sglang" / "bin" / "python")
    os.environ.update({"EAGLE3_SGLANG_PYTHON": py, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1",
                       "SGLANG_CPU_OMP_THREADS_BIND": "0", "PYTHONPATH": str(REPO / "tests" / "sglang_cpu")})
    cfg = load_config(a.config, [f"target.dtype={a.dtype}", "target.backend=sglang", *a.overrides,
                                 'target.sglang.launch_args=["--device", "cpu", "--attention-backend", "torch_native",'
                                 ' "--max-total-tokens", "16384"]', "output_dir=/tmp/bench-sglang-extract"])
    rows = load_prepared(cfg.prepared_dir).train.select(range(a.samples))
    seqs = [list(map(int, x)) for x in rows["input_ids"]]
    batches = plan_batches([len(s) for s in seqs], cfg.extract.batch_tokens, cfg.extract.max_batch_size)
    hf_cfg = cfg.model_copy(deep=True)
    hf_cfg.target.backend = "hf"
    hf = HFTarget(hf_cfg.target, hf_cfg.extract)
    t0 = time.monotonic()
    sg = SGLangTarget(cfg.target, cfg.extract, cfg.data.max_length, cfg.paths.logs_dir)
    print(f"SGLang capture server up in {time.monotonic() - t0:.0f} s (preflight included)", flush=True)
    secs = {"sglang": 0.0, "hf": 0.0}
    tokens, worst = 0, 0.0
    try:
        for b in batches:
            batch = [seqs[i] for i in b]
            tokens += sum(map(len, batch))
            outs = {}
            for name, backend in (("sglang", sg), ("hf", hf)):
                t = time.perf_counter()
                outs[name] = backend.capture(batch)
                secs[name] += time.perf_counter() - t
            for x, y in zip(outs["sglang"], outs["hf"], strict=True):
                worst = max(worst, float((x.aux.float() - y.aux.float()).abs().max()),
                            float((x.final.float() - y.final.float()).abs().max()))
    finally:
        sg.close()
    rate = {k: tokens / v for k, v in secs.items()}
    print(f"{a.samples} samples, {tokens} tokens, {len(batches)} batches, {a.dtype}, {a.threads} threads")
    print(f"SGLang {rate['sglang']:.0f} tokens/s, HF {rate['hf']:.0f} tokens/s, SGLang/HF = "
          f"{rate['sglang'] / rate['hf']:.2f}; max |SGLang - HF| over all states {worst:.2e}")


if __name__ == "__main__":
    sys.exit(main())
