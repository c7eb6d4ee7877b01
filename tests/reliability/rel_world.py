"""Shared builders for the reliability suite: one tiny world (target + tokenizer + conversations) and helpers
to run the real entry points as subprocesses, kill them at chosen points, and compare what they leave on disk.

    from rel_world import build_world, write_cfg, start, kill_when, run_cmd, tree_bytes

Every builder is deterministic (fixed seeds), so two worlds give the same bytes. Subprocesses run with one
thread (OMP_NUM_THREADS=1): the machine has 2 cores shared with other jobs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
if str(TESTS) not in sys.path:  # models.py / tokenizer_builders.py live one level up
    sys.path.insert(0, str(TESTS))

PY = sys.executable
CLI = [PY, "-m", "eagle3.cli"]
TRAIN = [PY, str(REPO / "train.py")]
EXTRACT = [PY, str(REPO / "extract.py")]


def env(**extra: Any) -> dict[str, str]:
    """The environment for a child: one thread, offline hub/wandb, the repo importable."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
         "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    e.update({k: str(v) for k, v in extra.items()})
    return e


def conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """ShareGPT records with varied lengths and some multi-turn ones (deterministic)."""
    import random

    rnd = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    out = []
    for i in range(n):
        q = " ".join(rnd.choice(words) for _ in range(rnd.randint(2, 10)))
        a = " ".join(rnd.choice(words) for _ in range(rnd.randint(3, 25)))
        turns = [{"from": "human", "value": f"q{i}: {q}?"}, {"from": "gpt", "value": f"{a}."}]
        if i % 4 == 0:
            turns += [{"from": "human", "value": "and then?"}, {"from": "gpt", "value": f"then {a[:20]}."}]
        out.append({"id": f"c{i:04d}", "conversations": turns})
    return out


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build_world(root: Path, n_conv: int = 60) -> dict[str, Path]:
    """A tiny random Llama (vocab 320, hidden 64, 8 layers) with a ChatML byte-level tokenizer in the same
    folder (so prepare, regenerate, extract and train all use it), and a ShareGPT JSONL of n_conv records."""
    from models import tiny_llama
    from tokenizer_builders import llama_test_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    target = tiny_llama(root / "target", vocab=320, hidden=64, layers=8)
    llama_test_tokenizer(target, vocab_size=320)
    data = write_jsonl(root / "data.jsonl", conversations(n_conv))
    return {"root": root, "target": target, "data": data}


def base_config(world: dict[str, Path], out: Path) -> dict[str, Any]:
    """The whole pipeline's config for the tiny world (float32 on CPU, small shards, short training)."""
    return {
        "output_dir": str(out),
        "target": {"path": str(world["target"]), "dtype": "float32"},
        "data": {"sources": [{"path": str(world["data"])}], "max_length": 96, "eval_size": 0.1},
        "draft": {"vocab_size": 320},  # = the target vocab: the full vocab (stated repair), every argmax counts
        "extract": {"shard_samples": 5, "batch_tokens": 256, "max_batch_size": 4},
        "train": {"batch_tokens": 256, "ttt_steps": 2, "max_steps": 8, "save_every": 2, "eval_every": 4,
                  "log_every": 1, "lr": 3e-3, "warmup_ratio": 0.2, "keep_checkpoints": 2},
        "regenerate": {"backend": "hf", "max_tokens": 8, "batch_size": 2},
    }


def extracted_world(root: Path, run: str, shared_cache: bool = True,
                    edit: Callable[[dict[str, Any]], None] | None = None) -> tuple[dict[str, Path], dict[str, Any]]:
    """The tiny world prepared and extracted once, in process: (world, config dict). The prepared folder (and the
    cache, with shared_cache) sit at `root` so every run a test starts from the config dict reuses them; `edit`
    changes the config dict before it is written and used."""
    from eagle3.config import load_config
    from eagle3.extract import run as extract
    from eagle3.prepare import run as prepare

    w = build_world(root)
    cfgd = base_config(w, root / run)
    cfgd["data"]["output_dir"] = str(root / "prepared")
    if shared_cache:
        cfgd["extract"]["cache_dir"] = str(root / "cache")
    if edit is not None:
        edit(cfgd)
    cfg = load_config(write_cfg(root / f"{run}.yaml", cfgd))
    prepare(cfg)
    extract(cfg)
    return w, cfgd


def shared_world(root: Path) -> dict[str, Any]:
    """extracted_world for a module's tests to share: the world, its config dict ("cfgd") and the prepared
    folder and cache it made (torch on one thread: the tests run subprocesses beside it)."""
    import torch

    torch.set_num_threads(1)
    w, cfgd = extracted_world(root, "run")
    return {**w, "cfgd": cfgd, "prepared": root / "prepared", "cache": root / "cache"}


def write_cfg(path: Path, cfg: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_cmd(cmd: list[str], timeout: float = 300, **extra_env: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env(**extra_env), capture_output=True, text=True, timeout=timeout)


def kill_when(cmd: list[str], log_path: Path, ready: Callable[[], bool], timeout: float = 300,
              **extra_env: Any) -> tuple[int, str]:
    """Start `cmd` (output to log_path), poll `ready()` every 10 ms and SIGKILL the process as soon as it holds.

    Returns (returncode, output). returncode is -9 when the kill landed, else the process's own exit status
    (it finished before the condition held)."""
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(**extra_env), stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if ready():
                    proc.send_signal(signal.SIGKILL)
                    break
                if time.monotonic() > deadline:
                    proc.send_signal(signal.SIGKILL)
                    raise TimeoutError(f"{cmd} did not reach the kill point in {timeout}s")
                time.sleep(0.01)
        finally:
            proc.wait(30)
    return proc.returncode, log_path.read_text()


def after_delay(seconds: float) -> Callable[[], bool]:
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0 >= seconds


def lines_in(path: Path, n: int) -> Callable[[], bool]:
    """True once `path` holds at least n complete lines."""
    def ready() -> bool:
        try:
            return path.read_bytes().count(b"\n") >= n
        except FileNotFoundError:
            return False
    return ready


def tree_bytes(d: Path, skip: Callable[[Path], bool] = lambda p: False) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and not skip(p)}


def temp_leftovers(d: Path) -> list[str]:
    """Anything that looks like an unfinished write: *.tmp files, .tmp-* / .old-* folders."""
    bad = []
    for p in d.rglob("*"):
        n = p.name
        if n.endswith(".tmp") or ".tmp-" in n or n.startswith(".tmp") or ".old-" in n or n.startswith(".old"):
            bad.append(str(p.relative_to(d)))
    return sorted(bad)


def no_traceback(stderr: str) -> bool:
    return "Traceback (most recent call last)" not in stderr


def error_block(stderr: str) -> str:
    """The `error:` line and its indented continuation lines; asserts there is exactly one such block."""
    lines = stderr.splitlines()
    starts = [i for i, x in enumerate(lines) if x.startswith("error:")]
    assert len(starts) == 1, stderr[-3000:]
    block = [lines[starts[0]]]
    block += [x for x in lines[starts[0] + 1:] if x.startswith("  ")]
    return "\n".join(block)
