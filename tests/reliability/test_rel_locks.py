"""Two runs, one folder: the real entry points started against a run that is writing the same folder.

    pytest -q -m slow tests/reliability/test_rel_locks.py      # ~2 minutes on 2 CPU cores

The first run is held still at its most exposed moment (right after a checkpoint, with a shard half-written in its
`.tmp`) by a start-up hook, so the second always meets it mid-write; then it goes on. The second must be refused
at once with one line naming the first, and the first must end exactly as it would have alone. A writer killed
mid-write must leave nothing that stops the next run, with file locks and (NO_FLOCK: a filesystem that refuses
them, as Lustre without `-o flock` does) without. The ranks of one run, an extraction's or an `accelerate launch`
training's, are one writer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from models import checkpoint_differences
from rel_world import (
    CLI,
    EXTRACT,
    REPO,
    TRAIN,
    env,
    error_block,
    no_traceback,
    run_cmd,
    shared_world,
    temp_leftovers,
    tree_bytes,
    write_cfg,
)
from test_ddp import PORT_TAKEN, free_port

from eagle3.config import load_config
from eagle3.locks import Writer, lock_path

pytestmark = pytest.mark.slow
REFUSED_WITHIN_S = 5.0

# Start-up hook of the first run: holds it still at a chosen point until the test creates `<pause dir>/go`.
HOOK = '''
import os, time
_DIR = os.environ.get("EAGLE3_TEST_PAUSE_DIR")
if os.environ.get("EAGLE3_TEST_NO_FLOCK"):  # a filesystem that refuses file locks
    import errno, fcntl
    def _refuse(*a, **k):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = _refuse

def _pause():
    open(os.path.join(_DIR, f"paused-{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(_DIR, "go")):
        time.sleep(0.05)

if _DIR and os.environ.get("EAGLE3_TEST_PAUSE_AFTER_CHECKPOINT"):
    try:
        from eagle3 import trainer
    except ImportError:  # a process without eagle3 on its path
        trainer = None
    if trainer is not None:
        _save, _step = trainer.save_checkpoint, int(os.environ["EAGLE3_TEST_PAUSE_AFTER_CHECKPOINT"])
        def _save_then_pause(accelerator, model, state, *a):
            path = _save(accelerator, model, state, *a)
            if state.step == _step:
                _pause()
            return path
        trainer.save_checkpoint = _save_then_pause

if _DIR and os.environ.get("EAGLE3_TEST_PAUSE_AFTER_BATCHES"):
    try:
        from eagle3 import cache
    except ImportError:
        cache = None
    if cache is not None:
        _write, _n, _done = cache.ShardWriter.write, int(os.environ["EAGLE3_TEST_PAUSE_AFTER_BATCHES"]), [0]
        def _write_then_pause(self, rows):
            _write(self, rows)
            _done[0] += 1
            if _done[0] == _n:
                _pause()
        cache.ShardWriter.write = _write_then_pause
'''


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("locks")
    w = shared_world(root)
    hook = root / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    w["cfgd"]["cpu_threads"] = 1  # "auto" follows the load; two runs side by side must sum in one order
    return {**w, "pythonpath": f"{hook}:{REPO}"}


@pytest.fixture(scope="module")
def ref_cache(world, tmp_path_factory):
    """The cache one uninterrupted extraction writes, alone."""
    from eagle3.extract import run as extract

    root = tmp_path_factory.mktemp("ref-cache")
    extract(load_config(write_cfg(root / "ref.yaml", _cfgd(world, cache_dir=root / "cache"))))
    return tree_bytes(root / "cache")


def _cfgd(world, **top) -> dict:
    cfgd = json.loads(json.dumps(world["cfgd"]))
    if "cache_dir" in top:
        cfgd["extract"]["cache_dir"] = str(top.pop("cache_dir"))
    cfgd.update({k: str(v) for k, v in top.items()})
    return cfgd


class First:
    """The first run, started with the pause hook; its process group is killed if a test leaves it running."""

    def __init__(self, world, tmp_path: Path, cmd: list[str], name: str, **extra_env):
        self.pause = tmp_path / f"pause-{name}"
        self.pause.mkdir()
        self.log = tmp_path / f"{name}.log"
        self.cmd, self.world = cmd, world
        self.env = env(PYTHONPATH=world["pythonpath"], EAGLE3_TEST_PAUSE_DIR=self.pause, **extra_env)
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        with open(self.log, "w") as f:
            return subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def paused(self, n: int = 1, timeout: float = 300) -> list[int]:
        """Wait until `n` of its processes hold still; their pids."""
        deadline = time.monotonic() + timeout
        while len(found := sorted(self.pause.glob("paused-*"))) < n:
            assert self.proc.poll() is None, f"the first run ended ({self.proc.returncode}):\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.05)
        return [int(p.name.split("-")[1]) for p in found]

    def go(self, timeout: float = 300) -> int:
        (self.pause / "go").touch()
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def text(self) -> str:
        return self.log.read_text()


@pytest.fixture
def first(world, tmp_path):
    started: list[First] = []

    def start(cmd: list[str], name: str = "first", **extra_env) -> First:
        started.append(First(world, tmp_path, cmd, name, **extra_env))
        return started[-1]

    yield start
    for f in started:
        f.kill()


def _refused(cmd: list[str], **extra_env) -> tuple[str, float]:
    """Run the second writer to its end: it must exit 1 within REFUSED_WITHIN_S with one line and no traceback;
    that line and the seconds it took."""
    t0 = time.monotonic()
    r = run_cmd(cmd, timeout=120, **extra_env)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr[-3000:]
    assert no_traceback(r.stderr), r.stderr[-3000:]
    line = error_block(r.stderr)
    assert "\n" not in line, line
    assert took < REFUSED_WITHIN_S, f"refused after {took:.1f} s"
    return line, took


def _names_the_holder(line: str, what: str, pid: int, command: str) -> None:
    for part in (f"error: {what} is being written by another run", f"pid {pid} on host {socket.gethostname()}",
                 f"command `{command}", "since 20", f"kill {pid})", "then re-run this command"):
        assert part in line, (part, line)


def _no_locks_left(folder: Path) -> None:
    assert sorted(folder.parent.glob(f".{folder.name}*.lock")) == [], "a finished writer left its lock file"


# ---------------------------------------------------------------------------------------------------- train
def test_a_second_train_is_refused_and_the_first_ends_as_if_alone(world, tmp_path, first):
    solo = write_cfg(tmp_path / "solo.yaml", _cfgd(world, output_dir=tmp_path / "solo"))
    r = run_cmd([*CLI, "train", "--config", str(solo)])
    assert r.returncode == 0, r.stderr[-3000:]

    config = write_cfg(tmp_path / "run.yaml", _cfgd(world, output_dir=tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints"
    a = first([*CLI, "train", "--config", str(config)], EAGLE3_TEST_PAUSE_AFTER_CHECKPOINT=2)
    a.paused()  # step_2 written, the run still going: where the second run used to resume from under it
    line, took = _refused([*CLI, "train", "--config", str(config)])
    _names_the_holder(line, f"rank 0's part of {ckpt}", a.proc.pid, "cli.py train --config")
    assert "it holds the file lock" in line
    assert a.go() == 0, a.text()[-3000:]

    # The first run's checkpoints, best head, export and log are a solo run's, byte for byte.
    want = tmp_path / "solo"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(p.name for p in (want / "checkpoints").iterdir())
    for step in sorted(p.name for p in ckpt.glob("step_*")):
        assert checkpoint_differences(want / "checkpoints" / step, ckpt / step) == [], step
    for folder in ("checkpoints/best", "export/sglang"):
        card = lambda p: p.name == "README.md"  # noqa: E731  (the model card names its run's folder)
        assert tree_bytes(tmp_path / "run" / folder, card) == tree_bytes(want / folder, card), folder
    cards = [(d / "export/sglang/README.md").read_text().replace(str(d), "<run>") for d in (tmp_path / "run", want)]
    assert cards[0] == cards[1]
    losses = [[(r["step"], r["loss"]) for r in map(json.loads, (d / "train_log.jsonl").read_text().splitlines())
               if "loss" in r] for d in (tmp_path / "run", want)]
    assert losses[0] == losses[1]
    assert temp_leftovers(tmp_path / "run") == []
    _no_locks_left(ckpt)
    print(f"second train refused in {took:.1f} s")


# -------------------------------------------------------------------------------------------------- extract
def test_a_second_extract_is_refused_and_the_first_cache_is_byte_identical(world, ref_cache, tmp_path, first):
    cache = tmp_path / "cache"
    config = write_cfg(tmp_path / "run.yaml", _cfgd(world, output_dir=tmp_path / "run", cache_dir=cache))
    a = first([*EXTRACT, "--config", str(config)], EAGLE3_TEST_PAUSE_AFTER_BATCHES=2)
    a.paused()
    live = sorted((cache / "train").glob("*.tmp"))
    assert live, "the first run should be paused inside a shard"
    line, took = _refused([*CLI, "extract", "--config", str(config)])
    _names_the_holder(line, f"rank 0's part of {cache}", a.proc.pid, "extract.py --config")
    assert all(p.is_file() for p in live), "the second run deleted the first one's live shard"
    # A reader never blocks: `cache info` on the folder being written reports it as it is, at once.
    t0 = time.monotonic()
    info = run_cmd([*CLI, "cache", "info", str(cache)], timeout=120)
    assert info.returncode == 0 and "INCOMPLETE" in info.stdout, info.stdout + info.stderr[-3000:]
    assert "being written" not in info.stdout + info.stderr
    assert time.monotonic() - t0 < REFUSED_WITHIN_S
    assert a.go() == 0, a.text()[-3000:]
    assert tree_bytes(cache) == ref_cache
    _no_locks_left(cache)
    print(f"second extract refused in {took:.1f} s")


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no-flock"])
def test_a_killed_writer_leaves_no_lock_that_stops_the_next_run(world, ref_cache, tmp_path, first, flock):
    """SIGKILL mid-shard (an OOM kill, a lost node): the next run starts without help. Without file locks the
    record decides: refused while the killed run's process lives, taken over once it is gone."""
    no_flock = {} if flock else {"EAGLE3_TEST_NO_FLOCK": "1"}
    cache = tmp_path / "cache"
    config = write_cfg(tmp_path / "run.yaml", _cfgd(world, output_dir=tmp_path / "run", cache_dir=cache))
    a = first([*EXTRACT, "--config", str(config)], EAGLE3_TEST_PAUSE_AFTER_BATCHES=2, **no_flock)
    a.paused()
    second = {"PYTHONPATH": world["pythonpath"], **no_flock}
    line, _ = _refused([*CLI, "extract", "--config", str(config)], **second)
    why = "it holds the file lock" if flock else f"its process {a.proc.pid} is alive on this host"
    assert why in line, line
    a.kill()
    assert Writer.parse(lock_path(cache, 0).read_text()).pid == a.proc.pid  # its lock file is still there
    r = run_cmd([*CLI, "extract", "--config", str(config)], **second)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"taking over the lock {lock_path(cache, 0)} left by eagle3 extract, pid {a.proc.pid}" in r.stderr
    how = "this host's kernel released its file lock" if flock else f"its process {a.proc.pid} is gone from this host"
    assert how in r.stderr, r.stderr[-3000:]
    assert tree_bytes(cache) == ref_cache
    _no_locks_left(cache)


def test_two_extraction_ranks_are_one_writer(world, tmp_path, first):
    cache = tmp_path / "cache"
    config = write_cfg(tmp_path / "run.yaml", _cfgd(world, output_dir=tmp_path / "run", cache_dir=cache))
    cmd = [*EXTRACT, "--config", str(config)]
    ranks = [first(cmd, f"rank{r}", RANK=r, WORLD_SIZE=2, EAGLE3_TEST_PAUSE_AFTER_BATCHES=1) for r in (0, 1)]
    for r in ranks:
        r.paused()  # both ranks mid-shard in one cache at once: neither refused the other
    for r, rank in enumerate(ranks):  # a second run's ranks meet the first's, each its own
        line, _ = _refused([*CLI, "extract", "--config", str(config)], RANK=r, WORLD_SIZE=2)
        _names_the_holder(line, f"rank {r}'s part of {cache}", rank.proc.pid, "extract.py --config")
    for rank in ranks:
        assert rank.go() == 0, rank.text()[-3000:]
    r = run_cmd([*CLI, "cache", "info", str(cache), "--verify"])
    assert r.returncode == 0 and "INCOMPLETE" not in r.stdout, r.stdout + r.stderr[-2000:]
    _no_locks_left(cache)


def test_a_two_process_accelerate_train_is_one_writer(world, tmp_path, first):
    config = write_cfg(tmp_path / "run.yaml", _cfgd(world, output_dir=tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints"
    for attempt in range(3):  # again on a fresh port when another process took the probed one (test_ddp)
        launch = [CLI[0], "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--main_process_port", str(free_port()), TRAIN[1], "--config", str(config)]
        a = first(launch, f"launch{attempt}", ACCELERATE_USE_CPU="true", EAGLE3_TEST_PAUSE_AFTER_CHECKPOINT=2)
        try:
            pids = a.paused(2)
            break
        except AssertionError:
            if not any(m in a.text() for m in PORT_TAKEN):
                raise
    holder = Writer.parse(lock_path(ckpt, 0).read_text())
    assert holder.pid in pids and Writer.parse(lock_path(ckpt, 1).read_text()).pid in pids
    line, _ = _refused([*CLI, "train", "--config", str(config)])
    _names_the_holder(line, f"rank 0's part of {ckpt}", holder.pid, "train.py --config")
    assert a.go() == 0, a.text()[-3000:]
    assert "2 process(es)" in a.text()
    assert (ckpt / "step_8" / "trainer_state.json").is_file()
    _no_locks_left(ckpt)
