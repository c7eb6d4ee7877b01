"""scripts/gpu_check.sh on the CPU at tiny sizes: the one-call GPU check keeps working between GPU sessions.

    pytest -q tests/test_gpu_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    summary = (tmp_path / "summary.txt").read_text()
    assert "tests: 3 run, 0 failed" in summary and "train step" in summary and "SmolLM2 head step" in summary and summary == r.stdout[-len(summary):]
