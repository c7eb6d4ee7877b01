"""How many torch (OpenMP) threads a CPU stage runs: every core that other processes leave idle, re-checked.

On an idle machine every core helps; with a core taken by another CPU-bound process, using it too is SLOWER than
leaving it (the evaluator's small forwards far worse than extraction): an OpenMP barrier waits for the thread the
kernel has descheduled (figures: BENCHMARKS.md "Threads"). A passive
wait policy removes the collapse but costs idle speed. So `cpu_threads: auto` (the default) counts the cores
the rest of the machine kept busy since the last check (/proc/stat minus this process's own CPU time) and runs
on the others, at most every core, at least one; it looks again at most every CHECK_EVERY_S seconds, at the
boundaries of the stages' work units (a training step, an extraction batch, a decoded turn), so a job that
starts or ends beside a long run is followed. Processes of one multi-process launch share the cores
(LOCAL_WORLD_SIZE), and each sees the others' use as load.

An int fixes the count, and so does EAGLE3_CPU_THREADS in the environment (the test suite sets 1). OMP_NUM_THREADS
is not read: `accelerate launch` sets it to 1 for every single-process run that does not ask for threads, which
left the recipe's training on one thread of two. Library use that never calls `configure` (the CLI does, for
every stage) keeps torch's own setting.

torch.set_num_threads holds for the calling thread's OpenMP team, so each thread that runs torch work calls
`adjust()` itself (the online-capture thread, the main loop).
"""

from __future__ import annotations

import logging
import os
import threading
from time import monotonic, sleep  # module names, so a test fakes this module's clock alone

import torch

from eagle3.process import local_world

log = logging.getLogger("eagle3")

CHECK_EVERY_S = 5.0
FIRST_SAMPLE_S = 0.25
"""The first decision, before this process has done any work, samples the machine for this long."""


def _machine_busy_s() -> float:
    """CPU-seconds all processes have spent (user, nice, system, irq, softirq; not idle, iowait or steal)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    t = os.times()
    return t.user + t.system


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Auto:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sample: tuple[float, float, float] | None = None  # (monotonic, machine busy, own)
        self.threads = 0
        self.said = -1
        self.blind = False
        self.local = threading.local()

    def decide(self) -> int:
        with self.lock:
            if self.blind:
                return self.threads
            try:
                return self._decide()
            except OSError:  # no /proc/stat (not Linux): every core, as torch would, and never look again
                self.blind, self.threads = True, self.threads or cores()
                return self.threads

    def _decide(self) -> int:
        now = monotonic()
        if self.sample is None:
            self.sample = (now, _machine_busy_s(), _own_s())
            sleep(FIRST_SAMPLE_S)
            now = monotonic()
        elif now - self.sample[0] < CHECK_EVERY_S:
            return self.threads
        t0, busy0, own0 = self.sample
        busy, own = _machine_busy_s(), _own_s()
        self.sample = (now, busy, own)
        others = max(0.0, (busy - busy0) - (own - own0)) / max(now - t0, 1e-3)  # cores, on average
        n = max(1, cores() // local_world())
        self.threads = max(1, min(n, cores() - int(others + 0.5)))
        if self.threads != self.said:
            log.info("cpu_threads=auto: %d torch thread(s) (%d cores, other processes kept %.1f busy)",
                     self.threads, n, others)
            self.said = self.threads
        return self.threads


_auto = _Auto()
_mode: int | str | None = None  # None: not configured (adjust does nothing); "auto"; or a fixed count


def configure(setting: int | str) -> None:
    """Apply the config's `cpu_threads` (an int, or `auto`) to this process, and to this thread now."""
    global _mode
    why = "cpu_threads"
    env = os.environ.get("EAGLE3_CPU_THREADS", "")
    if setting == "auto" and env.isdigit() and int(env) > 0:
        setting, why = int(env), "EAGLE3_CPU_THREADS"
    _mode = setting
    _auto.local.applied = None
    if setting != "auto":
        log.info("%s=%d: %d torch thread(s)", why, setting, setting)
        adjust()
    # auto decides at the first work unit's adjust(): a command that runs no torch work (config show) never waits
    # for the first sample of the machine.


def adjust() -> None:
    """Set this thread's torch threads to the current decision (cheap between checks)."""
    if _mode is None:
        return
    want = _mode if isinstance(_mode, int) else _auto.decide()
    if getattr(_auto.local, "applied", None) != want:
        torch.set_num_threads(want)
        _auto.local.applied = want
