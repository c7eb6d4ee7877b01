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

@pytest.fixture(scope="module")
def engine():
    pytest.skip("no {marker}: its venv did not build")

@pytest.mark.{marker}
def test_against_the_engine(engine):
    pass

@pytest.mark.{marker}
def test_that_skips_itself():
    pytest.skip("the engine cannot load this head")

def test_unmarked_skip():
    pytest.skip("not an engine test")
'''


@pytest.mark.parametrize("marker", ["sglang", "vllm"])
@pytest.mark.parametrize("ci", ["true", ""])
def test_an_engine_suite_that_cannot_run_fails_in_ci(tmp_path: Path, ci: str, marker: str):
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_suite.py").write_text(_SUITE.format(marker=marker))
    env = {**os.environ, "CI": ci}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                        f"{marker} or not {marker}", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    if ci:
        assert r.returncode == 1, r.stdout[-2000:]
        assert f"CI=true: a {marker}-marked test may not skip (Skipped: no {marker}: its venv did not build" in r.stdout
        assert f"CI=true: a {marker}-marked test may not skip (Skipped: the engine cannot load this head" in r.stdout
        # a skip in the fixture is an error, one in the test a failure; the unmarked one still just skips
        assert "1 failed, 1 skipped" in r.stdout and "1 error" in r.stdout, r.stdout[-2000:]
    else:
        assert r.returncode == 0 and "3 skipped" in r.stdout, r.stdout[-2000:]
