"""One writer per folder (eagle3.locks): a second writer is refused at once, naming the first; a writer that died
never blocks the next; ranks hold their own parts; without flock the record and its heartbeat decide.

    pytest -q tests/test_locks.py        # ~6 s: the other writers are real processes (tiny Python scripts)

The real stages run against each other in tests/reliability/test_rel_locks.py (slow).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from eagle3 import locks
from eagle3.config import Config
from eagle3.locks import FolderBusy, Writer, lock_path, writes, writing

REPO = Path(__file__).resolve().parent.parent

# Another writer: holds the locks of its arguments (`+folder`: its rank's part) until its stdin closes.
HOLDER = textwrap.dedent("""
    import os, sys, time
    from contextlib import ExitStack
    if os.environ.get("NO_FLOCK"):  # a filesystem that refuses file locks (Lustre without -o flock)
        import errno, fcntl
        def refuse(*a, **k):
            raise OSError(errno.ENOLCK, "No locks available")
        fcntl.flock = refuse
    from eagle3.locks import writing
    with ExitStack() as held:
        for arg in sys.argv[1:]:
            held.enter_context(writing(arg.lstrip("+"), "extract", per_rank=arg.startswith("+")))
        if os.environ.get("FORK"):  # a worker it forked (a multiprocessing pool) outliving it
            ready, say_ready = os.pipe()
            child = os.fork()
            if child == 0:  # os.fork returns here after the at-fork hooks ran: say so, then outlive the parent
                os.write(say_ready, b"x")
                time.sleep(60)
                os._exit(0)
            os.read(ready, 1)  # a parent killed before its child ran at all would test nothing
            print(child, flush=True)
        print("held", flush=True)
        sys.stdin.read()
""")


def _refuse_flock(*_a, **_k):
    raise OSError(errno.ENOLCK, "No locks available")


@pytest.fixture
def start(tmp_path):
    """start(*folders, **env) -> (process, lines it printed before "held"): another writer holding the folders."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    procs: list[subprocess.Popen] = []

    def run(*folders: str | Path, **env: str) -> tuple[subprocess.Popen, list[str]]:
        e = {**os.environ, "PYTHONPATH": str(REPO), **env}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            if key not in env:
                e.pop(key, None)
        p = subprocess.Popen([sys.executable, str(script), *map(str, folders)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=e)
        procs.append(p)
        lines = []
        while (line := p.stdout.readline().strip()) != "held":
            assert line or p.poll() is None, f"the holder exited with {p.returncode}"
            lines.append(line)
        return p, lines

    yield run
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _release(p: subprocess.Popen) -> None:
    p.stdin.close()
    assert p.wait(10) == 0


def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path, start):
    folder = tmp_path / "run" / "cache"
    p, _ = start(folder)
    t0 = time.monotonic()
    with pytest.raises(FolderBusy) as e, writing(folder, "extract"):
        pass
    assert time.monotonic() - t0 < 1
    msg = str(e.value)
    assert "\n" not in msg, msg  # one line
    for part in (f"{folder} is being written by another run", "eagle3 extract", f"pid {p.pid}",
                 f"host {socket.gethostname()}", "command `holder.py", "since 20", "it holds the file lock",
                 f"kill {p.pid})", "then re-run this command", f"Lock file: {lock_path(folder)}"):
        assert part in msg, (part, msg)

    ran = []

    @writes(lambda out, **_: out, "export")
    def export_like(src: str, out: Path, flag: bool = False) -> None:
        ran.append(src)

    for call in (lambda: export_like("a", folder), lambda: export_like("b", out=folder, flag=True)):
        with pytest.raises(FolderBusy):
            call()
    assert ran == []  # refused before the stage does anything

    _release(p)
    assert not lock_path(folder).exists()  # a writer that ends removes its lock file
    export_like("c", folder)
    assert ran == ["c"] and list((tmp_path / "run").iterdir()) == []  # nothing left beside it


def test_ranks_hold_their_own_parts_and_meet_the_same_rank_of_another_run(tmp_path, start, monkeypatch):
    folder = tmp_path / "cache"
    start(f"+{folder}", RANK="1", WORLD_SIZE="2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with writing(folder, "extract", per_rank=True):  # rank 0 of the same run, beside rank 1
        assert lock_path(folder, 0).is_file() and lock_path(folder, 1).is_file()
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(FolderBusy, match=f"rank 1's part of {folder} is being written"):
        with writing(folder, "extract", per_rank=True):
            pass


def test_nested_holds_in_one_process_share_the_lock(tmp_path):
    folder = tmp_path / "checkpoints"
    with writing(folder, "train"):
        with writing(folder, "train"):  # `eagle3 train` holds it before the trainer takes it again
            pass
        assert lock_path(folder).is_file()  # still held by the outer block
    assert not lock_path(folder).exists()


def test_a_killed_writer_never_blocks_the_next_run(tmp_path, start, caplog):
    folder = tmp_path / "cache"
    p, _ = start(folder)
    p.kill()
    p.wait()
    assert Writer.parse(lock_path(folder).read_text()).pid == p.pid  # the file stays, the flock went with it
    caplog.set_level(logging.INFO, logger="eagle3")
    with writing(folder, "extract"):
        assert Writer.parse(lock_path(folder).read_text()).pid == os.getpid()
    assert f"taking over the lock {lock_path(folder)} left by eagle3 extract, pid {p.pid}" in caplog.text
    assert "this host's kernel released its file lock" in caplog.text


def test_a_process_the_writer_forked_does_not_keep_its_lock(tmp_path, start):
    folder = tmp_path / "prepared"
    p, lines = start(folder, FORK="1")
    worker = int(lines[0])
    try:
        p.kill()
        p.wait()
        os.kill(worker, 0)  # the forked worker outlives its parent...
        with writing(folder, "prepare"):  # ...without the parent's lock
            pass
    finally:
        os.kill(worker, signal.SIGKILL)


def test_where_the_filesystem_refuses_file_locks_the_record_is_the_lock(tmp_path, start, monkeypatch, caplog):
    monkeypatch.setattr(fcntl, "flock", _refuse_flock)
    monkeypatch.setattr(locks, "SETTLE_S", 0.05)
    folder = tmp_path / "cache"
    p, _ = start(folder, NO_FLOCK="1")
    with pytest.raises(FolderBusy) as e, writing(folder, "extract"):
        pass
    assert f"its process {p.pid} is alive on this host (this filesystem refuses file locks" in str(e.value)
    p.kill()
    p.wait()
    caplog.set_level(logging.INFO, logger="eagle3")
    with writing(folder, "extract"):
        assert Writer.parse(lock_path(folder).read_text()).pid == os.getpid()
    assert f"its process {p.pid} is gone from this host" in caplog.text
    assert not lock_path(folder).exists()


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no-flock"])
def test_another_hosts_writer_is_judged_by_its_heartbeat(tmp_path, monkeypatch, caplog, flock):
    """A flock granted here says nothing of a writer on another host where locks are per host (NFS `nolock`):
    its heartbeat does."""
    if not flock:
        monkeypatch.setattr(fcntl, "flock", _refuse_flock)
        monkeypatch.setattr(locks, "SETTLE_S", 0.05)
    folder = tmp_path / "checkpoints"
    path = lock_path(folder)
    other = Writer("train", 4242, "node-b", "train.py --config k2.yaml", time.time() - 300)
    path.write_text(json.dumps(asdict(other)))
    with pytest.raises(FolderBusy) as e, writing(folder, "train"):
        pass
    msg = str(e.value)
    for part in ("eagle3 train, pid 4242 on host node-b", "(5 min ago)", "kill 4242 on node-b",
                 "its heartbeat (the lock file's time) is 0 s old", f"after {locks.STALE_S:.0f} s without one",
                 "re-run this command in"):
        assert part in msg, (part, msg)
    old = time.time() - locks.STALE_S - 30
    os.utime(path, (old, old))
    caplog.set_level(logging.INFO, logger="eagle3")
    with writing(folder, "train"):
        assert Writer.parse(path.read_text()).pid == os.getpid()
    assert f"heartbeat (the lock file's time) is {locks.STALE_S + 30:.0f} s old" in caplog.text


def test_the_heartbeat_keeps_the_lock_fresh_and_stops_with_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(locks, "HEARTBEAT_S", 0.02)
    folder = tmp_path / "cache"
    path = lock_path(folder)

    def beating() -> bool:
        return any(t.name.startswith("eagle3-lock:") for t in threading.enumerate())

    with writing(folder, "extract"):
        os.utime(path, (0, 0))
        deadline = time.monotonic() + 5
        while path.stat().st_mtime < time.time() - 60 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert path.stat().st_mtime > time.time() - 60 and beating()
        path.unlink()  # someone deleted it (or took it over) under a live writer: it says so
        while "was deleted or taken over" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "was deleted or taken over by another run while this one writes" in caplog.text
    assert not beating()  # joined when the lock is released: no thread outlives its stage


def test_every_writing_stage_takes_its_lock_first(tmp_path, start):
    """prepare, regenerate, extract, train (and `eagle3 train` before its imports), export, cache convert and
    cache upgrade are each refused while another run holds their folder, before they touch anything."""
    from eagle3 import cache, cli, export, extract, prepare, regenerate, trainer

    run = tmp_path / "run"
    cfg = Config.model_validate({"output_dir": str(run), "target": {"path": str(tmp_path / "no-target")}})
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    out, dst, old = tmp_path / "export", tmp_path / "cache-fp8", tmp_path / "cache-v1"
    start(cfg.prepared_dir, cfg.regenerated_path, f"+{cfg.cache_dir}", f"+{cfg.checkpoint_dir}", out, dst, old)
    stages = {
        cfg.prepared_dir: lambda: prepare.run(cfg),
        cfg.regenerated_path: lambda: regenerate.run(cfg),
        cfg.cache_dir: lambda: extract.run(cfg),
        cfg.checkpoint_dir: lambda: trainer.run(cfg),
        out: lambda: export.export(tmp_path / "no-checkpoint", out),
        dst: lambda: cache.convert(tmp_path / "no-cache", dst, "fp8"),
        old: lambda: cache.upgrade(old, None, {}),
    }
    for folder, stage in [*stages.items(), (cfg.checkpoint_dir, lambda: cli.main(["train", "--config", str(config)]))]:
        with pytest.raises(FolderBusy, match=f"{folder} is being written by another run"):
            stage()
    assert sorted(p.name for p in run.iterdir()) == [".cache.rank-00000.lock", ".checkpoints.rank-00000.lock",
                                                     ".prepared.lock", ".regenerated.jsonl.lock"]
    assert not out.exists() and not dst.exists() and not old.exists()
