"""Shared fixtures: tiny random targets built from configs (Llama and DeepseekV3), saved as real folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `auto` precision follows the CPU (eagle3.precision): pin it, so every machine runs the same float32 tests.
os.environ.setdefault("EAGLE3_NATIVE_BF16", "0")
# `cpu_threads: auto` follows the machine's load (eagle3.threads): pin it to one thread, as below.
os.environ.setdefault("EAGLE3_CPU_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent

# Before any test imports transformers (which decides once whether torchvision is there): vision-language processors
# need it, and PyPI's wheel needs a stand-in beside the CPU torch (tests/vision_cpu).
try:
    from vision_cpu.torchvision_stand_in import load as _load_torchvision
except ImportError:  # this file copied alone (tests/test_ci_engines.py runs it in a folder of its own)
    TORCHVISION = None
else:
    TORCHVISION = _load_torchvision()


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP spin-waits make two threads
    ~20x slower than one. Reset before every test so no test inherits another's setting."""
    from eagle3 import threads

    threads._mode = None  # no test inherits another's `threads.configure`
    torch.set_num_threads(1)
    yield


def _pristine_eagle3_logger() -> None:
    import logging

    log = logging.getLogger("eagle3")
    for handler in list(log.handlers):
        log.removeHandler(handler)
    log.propagate, log.level = True, logging.NOTSET


@pytest.fixture(autouse=True)
def _fresh_logger():
    """setup_logging (every in-process cli.main) binds the eagle3 logger to that test's captured stderr with
    propagate=False: a later test's caplog would then see nothing, and an assertion that no warning was logged
    would pass whatever the code did."""
    _pristine_eagle3_logger()
    yield
    _pristine_eagle3_logger()


@pytest.fixture(autouse=True)
def _no_accelerate_state_left():
    """An in-process trainer leaves accelerate's process state behind, and eagle3.process believes it over the
    environment (as a real trainer process must): a later test that sets RANK/WORLD_SIZE would see rank 0 of 1."""
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


# ----------------------------------------------------------------------------------- CI: engines must run
ENGINE_MARKERS = ("sglang", "vllm", "vision")
"""Suites against a real engine: CI builds their venvs, so there a skip means the engine did not run at all."""


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With CI=true, an engine-marked test that skips is a failure: a suite whose venv failed to build, or whose
    module cannot import the engine, would otherwise leave `pytest -m sglang` green with nothing run."""
    outcome = yield
    report = outcome.get_result()
    marker = next((m for m in ENGINE_MARKERS if item.get_closest_marker(m)), None)
    if not (report.skipped and marker and _in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"CI=true: a {marker}-marked test may not skip ({reason})"
