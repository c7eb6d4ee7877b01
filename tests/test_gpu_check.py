"""scripts/gpu_check.sh on the CPU at tiny sizes: the one-call GPU check keeps working between GPU sessions.

    pytest -q tests/test_gpu_check.py
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_every_part_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    # A budget no part reaches on a busy 2-core machine: every row must be measured here.
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--tiny", "--reps", "1", "--budget-s", "1500",
                        "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    tests = res["tests"]
    assert (tests["tests"], tests["failures"], tests["errors"], tests["skipped"]) == (3, 0, 0, 0), tests
    assert res["matmul"]["bf16_tflops"] > 0
    # the recipe's FSDP2 launcher settings in 2 processes (gloo here, NCCL on GPUs), bf16, the MLA head
    n = res["nccl"]
    assert "error" not in n, n
    assert [(x["rank"], x["backend"], x["sharded"], x["mixed_precision"]) for x in n["ranks"]] == [
        (0, "gloo", True, "bf16"), (1, "gloo", True, "bf16")], n["ranks"]
    assert len(n["losses"]) == 4 and all(math.isfinite(v) for v in n["losses"]), n["losses"]
    steps = res["train_step"]
    assert len(steps) == 2 + 2 * 2 * 2 * 2 * 2  # the recipe's step twice, then layers x vocabs x tokens x TTT x loss
    # the recipe's step first (MLA, the shipped draft vocab, its micro-batch, TTT 4), without and with checkpointing
    assert [(s["arch"], s["draft_vocab"], s["tokens"], s["ttt"], s["checkpointing"]) for s in steps[:2]] == [
        ("mla", 128, 512, 4, False), ("mla", 128, 512, 4, True)]
    # then MLA and Llama at the shipped draft vocab, then both at the full vocab
    assert [(s["arch"], s["draft_vocab"]) for s in steps[2::8]] == [("mla", 128), ("llama", 128), ("mla", 512),
                                                                   ("llama", 512)]
    assert not [s for s in steps if "error" in s or "skipped" in s or not s["fits"]], steps
    for s in steps:
        assert s["tokens_per_s"] > 0 and s["step_tflop"] > 0, s
    assert res["profiled_step"]["tokens_per_s"] > 0 and res["profiled_step"]["ttt"] == 4, res["profiled_step"]
    x = res["extraction"]
    assert x["argmax_us_per_token"] > 0 and x["fp8_quantize_us_per_token"] > 0
    # the capture plugin's hand-over: the dump file, and the Mooncake Store (installed here) exact and fp8
    assert [(c["transport"], c["storage"]) for c in x["capture"]] == [("shm", "exact"), ("mooncake", "exact"),
                                                                      ("mooncake", "fp8")], x["capture"]
    assert all(c["tokens_per_s"] > 0 for c in x["capture"])
    summary = (tmp_path / "summary.txt").read_text()
    assert summary == r.stdout[-len(summary):]
    for line in ("tests: 3 run, 0 failed", "NCCL part: 2 ranks, FSDP2 sharded over gloo, mixed precision bf16",
                 "the recipe's step (MLA, draft vocab 128, 512 tokens, TTT 4", "train step", "SmolLM2 head step",
                 "capture hand-over mooncake fp8"):
        assert line in summary, line
    assert summary.splitlines()[-1] == res["verdict"]
    assert res["verdict"].startswith("VERDICT: PASS: every part ran on the CPU; the recipe's 512-token step fits "
                                     "without checkpointing"), res["verdict"]


def _load_gpu_check(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)
    spec.loader.exec_module(gpu_check)
    return gpu_check


OOM = "CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 3.1 GiB is free."


def test_out_of_memory_rows_are_measurements_and_only_surprises_fail(monkeypatch):
    """An out-of-memory row is what the GPU holds (its `does not fit` line, no error), a row past the time is not
    measured, and the verdict passes and tells what the recipe's step needs on this GPU; an unexpected exception in
    a row fails it, with that row as the first reason."""
    import torch

    gpu_check = _load_gpu_check(monkeypatch)
    import gpu_check_train

    def fake_step(model, teacher, lm_head, tokens, ttt, fused, device, reps, rows=1, checkpointing=False):
        if tokens == gpu_check_train.TINY.recipe_tokens and not checkpointing or tokens == 256 and not fused:
            raise torch.OutOfMemoryError(OOM)
        return {"tokens_per_s": 1.0, "step_s": 1.0, "achieved_tflops": 1.0, "peak_gb": 40.0}

    monkeypatch.setattr(gpu_check_train, "train_step", fake_step)
    monkeypatch.setattr(gpu_check_train, "_memory", lambda device: (60e9, 70e9, 80e9))  # 70 GB held at the failure
    cpu = torch.device("cpu")
    rows = gpu_check_train.run_steps(gpu_check_train.TINY, cpu, 1, deadline=float("inf"))
    assert rows[0]["fits"] is False and "error" not in rows[0] and rows[1]["fits"] is True
    assert gpu_check_train.fit_text(rows[0]) == "does not fit: > 83 GB needed, 80 GB available"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    nccl = gpu_check_train.nccl_part(torch.device("cuda"), Path("."), 60)
    assert nccl == {"skipped": "needs 2 GPUs, 1 visible"}
    results = {"environment": {"gpu": "NVIDIA H100 80GB HBM3", "gpus": 1},
               "tests": {"tests": 3, "failures": 0, "errors": 0, "skipped": 0}, "matmul": {"bf16_tflops": 700.0},
               "nccl": nccl, "train_step": rows, "profiled_step": {"tokens_per_s": 1.0, "step_s": 1.0},
               "extraction": {"argmax_us_per_token": 3.0, "fp8_quantize_us_per_token": 0.05, "capture": []}}
    ok, line = gpu_check.verdict(results)
    assert ok, line
    assert line == ("VERDICT: PASS: every part ran on NVIDIA H100 80GB HBM3; the recipe's 512-token step needs "
                    "train.activation_checkpointing: true on this GPU (does not fit: > 83 GB needed, 80 GB available; "
                    "with it 40 GB peak); 9 step rows do not fit (measured); NCCL part: needs 2 GPUs, 1 visible, "
                    "skipped"), line
    text = gpu_check.summary(results)
    assert "  false: does not fit: > 83 GB needed, 80 GB available" in text and text.endswith(line + "\n"), text

    late = gpu_check_train.run_steps(gpu_check_train.TINY, cpu, 1, deadline=0.0)
    assert all(r["skipped"] for r in late)
    assert "34 step rows not measured (time)" in gpu_check.verdict({**results, "train_step": late})[1]

    def broken_step(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_check_train, "train_step", broken_step)
    rows = gpu_check_train.run_steps(gpu_check_train.TINY, cpu, 1, deadline=float("inf"))
    ok, line = gpu_check.verdict({**results, "train_step": rows})
    assert not ok and line.startswith("VERDICT: FAIL: train step mla 128 512 ttt4 fused: RuntimeError: CUDA error: "
                                      "an illegal memory access"), line


_FAKE = '''
import pytest

pytestmark = pytest.mark.gpu

def test_runs():
    pass
'''
_SKIPS = '''
def test_finds_no_device_{n}():
    pytest.skip("torch sees no CUDA device")
'''


@pytest.mark.parametrize("skips,code,verdict", [
    (0, 0, "tests: 1 run, 0 failed, 0 errors, 0 skipped: passed"),
    (1, 1, "tests: 2 run, 0 failed, 0 errors, 1 skipped: FAILED (1 of 2 skipped on a device that is present)"),
])
def test_a_skipped_device_test_fails_the_check(tmp_path, monkeypatch, capsys, skips, code, verdict):
    """The check runs its tests only where the device is (else it stops before them), so a test that skips there,
    a device path nobody checked, fails it as a failing test does; green means every test ran."""
    gpu_check = _load_gpu_check(monkeypatch)
    fake = tmp_path / "test_fake_gpu.py"
    fake.write_text(_FAKE + "".join(_SKIPS.format(n=n) for n in range(skips)))
    monkeypatch.setattr(gpu_check, "TESTS", str(fake))
    others = [a for part in ("matmul", "nccl", "train_step", "profiled_step", "extraction") for a in ("--skip", part)]
    assert gpu_check.main(["--cpu", "--tiny", "--out", str(tmp_path / "out"), *others]) == code
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert verdict in summary, summary
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["tests"]
    assert (res["tests"], res["skipped"]) == (1 + skips, skips)
