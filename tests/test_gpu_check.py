"""scripts/gpu_check.sh on the CPU at tiny sizes: the one-call GPU check keeps working between GPU sessions.

    pytest -q tests/test_gpu_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_every_part_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--tiny", "--reps", "1", "--out", str(tmp_path)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    tests = res["tests"]
    assert (tests["tests"], tests["failures"], tests["errors"], tests["skipped"]) == (3, 0, 0, 0), tests
    assert res["matmul"]["bf16_tflops"] > 0
    steps = res["train_step"]
    assert len(steps) == 2 * 2 * 2 * 2 * 2  # layers x draft vocabs x token counts x TTT x fused/plain
    assert not [s for s in steps if "error" in s], [s for s in steps if "error" in s]
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
    assert "tests: 3 run, 0 failed" in summary and "train step" in summary and "SmolLM2 head step" in summary and summary == r.stdout[-len(summary):]
    assert "capture hand-over mooncake fp8" in summary


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
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up there
    spec.loader.exec_module(gpu_check)
    fake = tmp_path / "test_fake_gpu.py"
    fake.write_text(_FAKE + "".join(_SKIPS.format(n=n) for n in range(skips)))
    monkeypatch.setattr(gpu_check, "TESTS", str(fake))
    others = [a for part in ("matmul", "train_step", "profiled_step", "extraction") for a in ("--skip", part)]
    assert gpu_check.main(["--cpu", "--tiny", "--out", str(tmp_path / "out"), *others]) == code
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert verdict in summary, summary
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["tests"]
    assert (res["tests"], res["skipped"]) == (1 + skips, skips)
