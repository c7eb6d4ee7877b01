"""cpu_threads: auto runs on the cores other processes leave idle and follows changes; an int or the
environment fixes the count; each thread that runs torch work gets the decision."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from eagle3 import threads
from eagle3.config import Config


class FakeMachine:
    """/proc/stat and os.times as the policy reads them: `others` cores busy outside this process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cores: int):
        self.now, self.busy, self.own, self.others = 100.0, 0.0, 0.0, 0.0
        monkeypatch.setattr(threads, "cores", lambda: cores)
        monkeypatch.setattr(threads, "_machine_busy_s", lambda: self.busy)
        monkeypatch.setattr(threads, "_own_s", lambda: self.own)
        monkeypatch.setattr(threads, "monotonic", lambda: self.now)  # this module's clock, not the time module's
        monkeypatch.setattr(threads, "sleep", self.advance)
        monkeypatch.setattr(threads, "_auto", threads._Auto())

    def advance(self, seconds: float, own_cores: float = 0.0) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + self.others) * seconds


def test_auto_takes_the_idle_cores_and_follows_the_load(monkeypatch):
    monkeypatch.delenv("EAGLE3_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    m = FakeMachine(monkeypatch, cores=4)
    m.others = 1.0  # one busy process beside us from the start
    threads.configure("auto")
    threads.adjust()
    assert torch.get_num_threads() == 3
    m.advance(1.0, own_cores=3)
    threads.adjust()  # within CHECK_EVERY_S: no new decision
    assert torch.get_num_threads() == 3
    m.others = 0.2  # the other job ended (some background noise is left)
    m.advance(threads.CHECK_EVERY_S, own_cores=3)
    threads.adjust()
    assert torch.get_num_threads() == 4
    m.others = 3.7  # everything else busy: still one thread of our own
    m.advance(threads.CHECK_EVERY_S, own_cores=1)
    threads.adjust()
    assert torch.get_num_threads() == 1


def test_each_torch_thread_gets_the_decision(monkeypatch):
    """torch.set_num_threads holds per OpenMP thread: the online-capture thread adjusts its own."""
    monkeypatch.delenv("EAGLE3_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    FakeMachine(monkeypatch, cores=2)
    threads.configure("auto")
    seen = []

    def work():
        threads.adjust()
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    threads.adjust()
    assert seen == [2] and torch.get_num_threads() == 2


def test_an_int_or_the_environment_fixes_the_count(monkeypatch):
    monkeypatch.delenv("EAGLE3_CPU_THREADS", raising=False)
    FakeMachine(monkeypatch, cores=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what `accelerate launch` sets for a single process: not read
    threads.configure("auto")
    threads.adjust()
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("EAGLE3_CPU_THREADS", "1")
    threads.configure("auto")
    assert torch.get_num_threads() == 1
    threads.configure(3)  # the config's own int wins over the environment
    assert torch.get_num_threads() == 3
    assert Config.model_validate({"cpu_threads": "2"}).cpu_threads == 2
    with pytest.raises(ValueError, match="cpu_threads"):
        Config.model_validate({"cpu_threads": 0})


def test_ranks_of_one_launch_share_the_cores(monkeypatch):
    monkeypatch.delenv("EAGLE3_CPU_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    FakeMachine(monkeypatch, cores=8)
    threads.configure("auto")
    threads.adjust()
    assert torch.get_num_threads() == 4


def test_without_proc_stat_every_core(monkeypatch):
    monkeypatch.delenv("EAGLE3_CPU_THREADS", raising=False)
    FakeMachine(monkeypatch, cores=2)

    def missing() -> float:
        raise FileNotFoundError("/proc/stat")

    monkeypatch.setattr(threads, "_machine_busy_s", missing)
    threads.configure("auto")
    threads.adjust()
    assert torch.get_num_threads() == 2


def test_not_configured_leaves_torch_alone():
    torch.set_num_threads(1)
    threads.adjust()
    assert torch.get_num_threads() == 1


@pytest.mark.skipif(threads.cores() < 2, reason="needs 2 cores")
def test_auto_leaves_the_core_of_a_real_busy_process(monkeypatch):
    """Read from the real /proc/stat: a busy-loop process beside us takes a core off the count."""
    monkeypatch.delenv("EAGLE3_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_auto", threads._Auto())
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        threads.configure("auto")
        threads.adjust()
        assert torch.get_num_threads() <= threads.cores() - 1
    finally:
        busy.kill()
        busy.wait()
