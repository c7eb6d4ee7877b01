"""A real Mooncake master for the tests, started as a user starts it: `eagle3 mooncake master --config ...`, on
127.0.0.1 ports drawn below the ephemeral range (eagle3.targets.sglang_server.free_port)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3.config import Config, MooncakeSettings
from eagle3.targets.sglang_server import free_port

REPO = Path(__file__).resolve().parent.parent


class Master:
    def __init__(self, proc: subprocess.Popen, settings: MooncakeSettings, log: Path):
        self.proc, self.settings, self.log = proc, settings, log

    def kill(self) -> None:
        """The master gone at once (SIGKILL of its process: `eagle3 mooncake master` and the binary it runs)."""
        for pid in _children(self.proc.pid) + [self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@contextmanager
def running_master(folder: Path, timeout_s: float = 120) -> Iterator[Master]:
    """A master serving until the block ends; `.settings` is what `target.sglang.mooncake` takes."""
    folder.mkdir(parents=True, exist_ok=True)
    rpc, http = free_port(), free_port()
    settings = MooncakeSettings(master=f"127.0.0.1:{rpc}", metadata_server=f"http://127.0.0.1:{http}/metadata")
    cfg = Config()
    cfg.target.sglang.mooncake = settings
    cfg_file = folder / "master.yaml"
    cfg_file.write_text(cfg.to_yaml())
    log = folder / "master.log"
    out = open(folder / "master.out", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "eagle3.cli", "mooncake", "master", "--config", str(cfg_file),
                             "--log", str(log)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.monotonic()
        while "Mooncake master ready" not in (folder / "master.out").read_text():
            assert proc.poll() is None, (folder / "master.out").read_text()
            assert time.monotonic() - t0 < timeout_s, "the master did not get ready"
            time.sleep(0.2)
        yield Master(proc, settings, log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        out.close()
