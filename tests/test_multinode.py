"""Two "machines" on localhost: `accelerate launch --num_machines 2 --machine_rank {0,1}`, one CPU process each
(gloo), exactly the per-node command of recipes/accelerate/ddp-2x8gpu.yaml with its sizes scaled down.

    pytest -q -m slow tests/test_multinode.py

- the two machines train what one process accumulating their two micro-batches trains (the DDP test's rule);
- one machine's process killed after a checkpoint, then the same two commands again: the run resumes and ends on
  the same bytes as an uninterrupted one;
- a checkpoint resumed by another world size is refused, saying what to do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from models import checkpoint_differences, kill_after_checkpoint
from test_ddp import PORT_TAKEN, free_port
from test_trainer import make_cfg, read_log, tiny_cache  # noqa: F401  (the shared module fixture)

REPO = Path(__file__).resolve().parent.parent
TWO_NODES = REPO / "recipes" / "accelerate" / "ddp-2x8gpu.yaml"
pytestmark = pytest.mark.slow


def _launcher(tmp_path: Path) -> Path:
    """The 2-node recipe with one process per machine (8 GPUs each there), the rest as written."""
    settings = yaml.safe_load(TWO_NODES.read_text())
    assert settings["num_machines"] == 2 and settings["num_processes"] == 16
    settings.update(num_processes=2, mixed_precision="no")
    settings.pop("gpu_ids", None)
    path = tmp_path / "two-machines.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def _machines(tmp_path: Path, config: Path, log: Path, machine1: dict[str, str] | None = None,
              both: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Both machines' processes, each the recipe's per-node command with its own --machine_rank (`machine1`:
    extra environment of machine 1's; `both`: of both, before machine 1's)."""
    launcher, port = _launcher(tmp_path), str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
               "PYTHONPATH": str(REPO), **(both or {}), **((machine1 or {}) if rank == 1 else {})}
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launcher),
               "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
               str(REPO / "train.py"), "--config", str(config)]
        out = open(log.with_suffix(f".machine{rank}.log"), "w")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def _run(tmp_path: Path, config: Path, log: Path, machine1: dict[str, str] | None = None,
         timeout: float = 600, both: dict[str, str] | None = None) -> list[int]:
    """Both machines to their end: their exit codes. Again on a fresh port when another process bound the probed
    one before the launcher did (test_ddp.run_launcher: a port cannot be held across accelerate's own bind; a
    launch that failed so has not trained a step)."""
    for _ in range(3):
        codes = [p.wait(timeout) for p in _machines(tmp_path, config, log, machine1, both)]
        logs = [log.with_suffix(f".machine{r}.log").read_text() for r in (0, 1)]
        if not any(codes) or not any(m in text for m in PORT_TAKEN for text in logs):
            break
    if any(codes):
        print("\n".join(text[-3000:] for text in logs))
    return codes


def _eval(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [r["eval"] for r in rows if "eval" in r][-1]


def test_two_machines_train_like_one_process_and_resume_after_one_dies(tiny_cache, tmp_path):  # noqa: F811
    kw = dict(max_steps=6, save_every=2, eval_every=100)
    two = make_cfg(tiny_cache, tmp_path / "two", **kw)
    two.cpu_threads = 1  # "auto" follows the machine's load; exact comparisons need one summation order
    config = tmp_path / "two.yaml"
    config.write_text(two.to_yaml())
    assert _run(tmp_path, config, tmp_path / "two") == [0, 0]
    log = read_log(tmp_path / "two")
    assert sorted(log) == list(range(1, 7))
    assert "2 process(es)" in (tmp_path / "two.machine0.log").read_text()

    from eagle3 import trainer

    one = make_cfg(tiny_cache, tmp_path / "one", **kw, grad_accum=2)
    trainer.run(one)
    single = read_log(tmp_path / "one")
    for step in range(1, 7):
        assert log[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5), step
    # The eval split (one batch here) evaluated whole on two machines: it used to drop the batch that did not
    # divide among the ranks, and this run's eval said acceptance 1.0 where one process says 1.49.
    evals = [_eval(tmp_path / name) for name in ("two", "one")]
    assert evals[0]["acc_0"] > 0 and evals[0]["sim_accept_len"] == pytest.approx(evals[1]["sim_accept_len"], rel=1e-5)

    # Machine 1's trainer SIGKILLed right after step 4's checkpoint; machine 0 loses its peer and stops too.
    crashed = make_cfg(tiny_cache, tmp_path / "crashed", **kw)
    crashed.cpu_threads = 1
    config_c = tmp_path / "crashed.yaml"
    config_c.write_text(crashed.to_yaml())
    codes = _run(tmp_path, config_c, tmp_path / "crashed", machine1=kill_after_checkpoint(4))
    assert codes[0] != 0 and codes[1] != 0, codes
    assert "Signal 9" in (tmp_path / "crashed.machine1.log").read_text() or codes[1] < 0
    assert sorted(read_log(tmp_path / "crashed"))[-1] == 4, "the run went past the kill"
    assert _run(tmp_path, config_c, tmp_path / "crashed") == [0, 0]
    resumed = read_log(tmp_path / "crashed")
    for step in range(1, 7):
        assert resumed[step]["loss"] == log[step]["loss"], step
    assert checkpoint_differences(two.checkpoint_dir / "step_6", crashed.checkpoint_dir / "step_6") == []

    # The two machines' checkpoint resumed by one process: refused, not silently re-planned.
    crashed.train.max_steps = 8
    with pytest.raises(Exception, match=r"written by 2 processes.*this run has 1.*draft.init_from"):
        trainer.run(crashed)
    state = json.loads((crashed.checkpoint_dir / "step_6" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
