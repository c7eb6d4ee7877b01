"""Every entry point ends cleanly: exit 0 after its work, no abort at interpreter shutdown, no thread left running.

    pytest -q -m slow tests/reliability/test_rel_exit.py

A background thread still inside a torch op when Python shuts down is stopped in the middle of C++ code and the
process aborts after its work is done: "terminate called without an active exception", SIGABRT, exit 134. A
recipe under `set -e` then stops before its next stage, and a scheduler retries a finished job. The abort is a
race (one finished training in five, on a busy 2-core machine), so these tests run the real entry points many
times, and check the cause itself on every run: a hook that runs after every other exit handler (it is
registered first, at start-up, through `sitecustomize`) lists the threads still alive, and there must be none.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from rel_world import CLI, EXTRACT, REPO, TRAIN, env, extracted_world, write_cfg

pytestmark = pytest.mark.slow

RUNS = 15
EXIT_CHECK = '''
import atexit, sys, threading
def _eagle3_exit_check():
    for t in threading.enumerate():
        # tqdm's own exit handler has already told its monitor to stop, without joining it; it waits in pure
        # Python (an Event), so it is never cut off inside C++. Give it the moment it needs to return.
        if t.name == "tqdm_monitor":
            t.join(timeout=5)
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    print(f"exit-check: threads alive at exit: {alive}", file=sys.stderr, flush=True)
atexit.register(_eagle3_exit_check)  # registered first, so it runs last: after eagle3's own exit handlers
'''


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("exit")
    check = root / "exit_check"
    check.mkdir()
    (check / "sitecustomize.py").write_text(EXIT_CHECK)

    def edit(c):
        # 40 steps stop mid-epoch (the prefetcher still has batches to give), with an eval and a checkpoint last.
        c["train"].update(max_steps=40, eval_every=20, save_every=20, batch_tokens=96)
        c["eval"] = {"prompt_sets": ["eval-split"], "max_prompts": 2, "max_new_tokens": 8}

    w, cfgd = extracted_world(root, "base", edit=edit)
    return {"root": root, "cfgd": cfgd, "pythonpath": f"{check}:{REPO}"}


def _run(world, cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env(PYTHONPATH=world["pythonpath"]), capture_output=True, text=True,
                          timeout=timeout)


def _assert_clean(r: subprocess.CompletedProcess, what: str, code: int = 0) -> None:
    assert "terminate called" not in r.stderr, f"{what}: aborted at exit (rc {r.returncode})\n{r.stderr[-3000:]}"
    assert r.returncode == code, f"{what}: exit {r.returncode}\n{r.stderr[-3000:]}"
    assert "exit-check: threads alive at exit: []" in r.stderr, f"{what}: {r.stderr[-1500:]}"


def _cfg(world, name: str, **train) -> Path:
    import copy

    c = copy.deepcopy(world["cfgd"])
    c["output_dir"] = str(world["root"] / name)
    c["train"].update(train)
    return write_cfg(world["root"] / f"{name}.yaml", c)


def test_a_finished_training_exits_cleanly_every_time(world):
    for i in range(RUNS):
        r = _run(world, [*TRAIN, "--config", str(_cfg(world, f"train{i}"))])
        _assert_clean(r, f"train.py run {i + 1} of {RUNS}")
        assert "exported the best draft for SGLang" in r.stderr


def test_extraction_and_evaluation_exit_cleanly(world):
    for i in range(3):
        cfg = _cfg(world, f"extract{i}")
        r = _run(world, [*EXTRACT, "--config", str(cfg), f"extract.cache_dir={world['root'] / f'cache{i}'}"])
        _assert_clean(r, f"extract.py run {i + 1}")
    trained = _cfg(world, "train0")  # trained by the test above (or now)
    if not (world["root"] / "train0" / "checkpoints" / "best").is_dir():
        _assert_clean(_run(world, [*TRAIN, "--config", str(trained)]), "train.py")
    for i in range(3):
        r = _run(world, [*CLI, "eval", "--config", str(trained)])
        _assert_clean(r, f"eagle3 eval run {i + 1}")
        assert "τ=" in r.stdout


def test_online_training_exits_cleanly_and_an_interrupted_one_in_one_line(world):
    """Online mode computes the target's states in the prefetch thread: the longest torch work off the main
    thread. A finished run and a Ctrl-C'd one both leave no thread behind; the interrupted one says so in one
    line and keeps what it completed."""
    for i in range(3):
        r = _run(world, [*TRAIN, "--config", str(_cfg(world, f"online{i}", max_steps=12, eval_every=12,
                                                      save_every=12)), "extract.mode=online"])
        _assert_clean(r, f"online train.py run {i + 1}")
    log = world["root"] / "interrupted.log"
    cmd = [*TRAIN, "--config", str(_cfg(world, "interrupted", max_steps=100000)), "extract.mode=online"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(PYTHONPATH=world["pythonpath"]), stdout=f,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "step 3/" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    out = log.read_text()
    assert "terminate called" not in out, out[-3000:]
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, out[-3000:])  # exit by SIGINT
    assert "Traceback" not in out and "interrupted" in out, out[-3000:]
    assert "exit-check: threads alive at exit: []" in out, out[-1500:]
