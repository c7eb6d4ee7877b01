"""CI runs the engine suites for real: with CI=true an sglang- or vllm-marked test that skips is a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_SUITE = '''
import pytest

@pytest.fixture(scope="module", autouse=True)
def engine():
    pytest.skip("no SGLang: run `bash scripts/setup_sglang_cpu.sh`")

@pytest.mark.sglang
def test_against_the_engine():
    pass

def test_unmarked_skip():
    pytest.skip("not an engine test")
'''


@pytest.mark.parametrize("ci", ["true", ""])
def test_an_engine_suite_that_cannot_run_fails_in_ci(tmp_path: Path, ci: str):
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_suite.py").write_text(_SUITE)
    env = {**os.environ, "CI": ci}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "sglang or not sglang",
                        str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    if ci:
        assert r.returncode == 1, r.stdout[-2000:]
        assert "CI=true: a sglang-marked test may not skip (Skipped: no SGLang" in r.stdout
        assert "1 skipped" in r.stdout  # the unmarked one still just skips
    else:
        assert r.returncode == 0 and "2 skipped" in r.stdout, r.stdout[-2000:]
