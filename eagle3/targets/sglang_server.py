"""An SGLang server process that eagle3 starts, waits for and stops: the capture server of extraction and the
EAGLE-3 server of `eagle3 eval --engine sglang` are both one of these.

    with SGLangServer(["--model-path", m, "--tp-size", "8"], env, log_file, timeout_s=3600) as server:
        http_json("POST", f"{server.url}/generate", body)

- The command is `<python> -m sglang.launch_server <flags>` where <python> is `$EAGLE3_SGLANG_PYTHON` when set
  (SGLang in its own virtualenv, as in the CPU tests), else this interpreter.
- The server runs in its own session, so stopping it reaches SGLang's scheduler and TP worker processes too:
  SIGTERM to the whole group, SIGKILL after a grace period.
- Its output goes to a log file; when it dies before `/health` answers, the error quotes the log's tail.
- Its port is drawn below the kernel's ephemeral range (see `free_port`); a launch that loses it all the same
  (uvicorn's "address already in use" once the weights are loaded) is started again on another.
- It is stopped on `close()`, on exit (atexit) and on SIGTERM (turned into a normal exit). A SIGKILL of eagle3
  cannot be caught, so on Linux the server also gets SIGTERM from the kernel when its parent dies
  (PR_SET_PDEATHSIG), and SGLang's own children follow their parent: a killed extraction never leaves an 8-GPU
  server holding the memory its re-run needs.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from eagle3.logs import UserError

log = logging.getLogger("eagle3")

ENV_PYTHON = "EAGLE3_SGLANG_PYTHON"
"""The Python that runs SGLang (default: this one)."""


def sglang_python() -> str:
    return os.environ.get(ENV_PYTHON) or sys.executable


# Where eagle3 draws a launched server's port: below the kernel's ephemeral range, where no bind(0) or outgoing
# connection is ever handed a port, and below SGLang's own band for its NCCL port (22000-29999).
PORT_BAND = (12000, 21999)
PORT_TAKEN = "address already in use"  # uvicorn's bind error, after which SGLang exits with code 3
LAUNCHES = 3


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now that no other process is likely to take before the server binds it. SGLang binds its
    HTTP port only once its weights are loaded (seconds on CPU, minutes for Kimi), and in between every bind(0)
    on the machine (gloo's listeners, SGLang's own scheduler among them) draws from the ephemeral range: a port
    probed there was taken in CI, and the server died after loading with uvicorn's "address already in use"."""
    low, high = PORT_BAND[0], min(PORT_BAND[1], _ephemeral_low() - 1)
    for port in random.sample(range(low, high + 1), min(64, max(0, high - low + 1))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # a machine whose ephemeral range covers the band
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_taken(log_file: Path, start: int) -> bool:
    """Whether the launch that logged from byte `start` on lost its port to another process."""
    with open(log_file, "rb") as f:
        f.seek(start)
        return PORT_TAKEN in f.read().decode(errors="replace").lower()


def http_json(method: str, url: str, body: Any = None, timeout: float = 10.0) -> Any:
    """One JSON request; an HTTP error status raises RuntimeError with the server's own message."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - URL from the user's config
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"{method} {url}: HTTP {e.code}: {detail}") from None
    return json.loads(raw) if raw.strip() else None


def server_info(url: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """The server's resolved arguments (`device`, `disable_radix_cache`, ...) from /server_info, or from
    /get_server_info (its name before SGLang 0.5.23); None where it answers neither."""
    for route in ("/server_info", "/get_server_info"):
        try:
            info = http_json("GET", url.rstrip("/") + route, timeout=timeout)
        except (RuntimeError, OSError):
            continue
        if isinstance(info, dict):
            return info
    return None


# A log line that names a failure: uvicorn's "ERROR:" lines, an OS error logged as such ("[Errno 98] error while
# attempting to bind ..."), the last line of a Python traceback.
ERROR_LINE = re.compile(r"^ERROR:|\[Errno \d+\]|\b\w*(Error|Exception): ")


def log_tail(log_file: Path | None, lines: int = 40, errors: int = 5) -> str:
    """The log's last `lines`, after its first `errors` error lines above them: a dying server's tail can be all
    cleanup (SGLang's warning tracebacks at shutdown) with the cause just above it."""
    if log_file is None or not log_file.is_file():
        return ""
    text = log_file.read_text(errors="replace").splitlines()
    tail = text[-lines:]
    above = [line for line in text[:-lines] if ERROR_LINE.search(line)][:errors]
    first = "\n--- its first error lines ---\n" + "\n".join(above) if above else ""
    return f"{first}\n--- last {len(tail)} lines of {log_file} ---\n" + "\n".join(tail)


class ServerError(UserError, RuntimeError):
    """An SGLang server that cannot be used (not there, died, never healthy), phrased for the user."""


def _refused(e: BaseException) -> bool:
    """Nothing listens there (or the host name does not resolve): not a server that is still loading."""
    reason = getattr(e, "reason", e)
    return isinstance(reason, (ConnectionRefusedError, socket.gaierror))


def listener_sessions(port: int) -> set[int] | None:
    """The session ids of the processes listening on TCP `port` (Linux /proc), or None where that cannot be read."""
    inodes: set[str] = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                    inodes.add(f[9])
    except (OSError, ValueError, IndexError):
        return None
    sessions: set[int] = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd).removeprefix("socket:[").rstrip("]") in inodes for fd in fd_dir.iterdir()):
                sessions.add(os.getsid(int(fd_dir.parent.name)))
        except (OSError, ValueError):
            continue
    return sessions if inodes else set()


def _answered_by(proc: subprocess.Popen, port: int) -> bool:
    """Whether what answers on `port` belongs to the launched server (its own session: start_new_session), not a
    process that held the port for a moment while the server loaded (seen in CI: /health answered 200 half a
    minute before SGLang's uvicorn started, and the next stage found nothing there). Unknown counts as ours."""
    sessions = listener_sessions(port)
    return sessions is None or not sessions or proc.pid in sessions


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 log_file: Path | None = None, refused_grace_s: float | None = None) -> None:
    """Poll `/health` until it answers 200; fail early when the launched process dies (with its log tail), and,
    with `refused_grace_s`, when nothing has listened at `url` for that long (a server loading its weights
    already listens, or is not yet started by a launcher; a refused connection past the grace is a wrong URL).
    For a launched server (`proc`) the answer must come from its own processes."""
    t0 = time.monotonic()
    last_note = t0
    refused_since: float | None = None
    port = urllib.parse.urlsplit(url).port
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"the SGLang server exited with code {proc.returncode} before it was healthy"
                              f"{log_tail(log_file)}")
        try:
            http_json("GET", f"{url}/health", timeout=5.0)
            if proc is None or port is None or _answered_by(proc, port):
                log.info("SGLang server at %s is healthy (%.0f s)", url, time.monotonic() - t0)
                return
            refused_since = None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, RuntimeError) as e:
            refused_since = (refused_since or time.monotonic()) if _refused(e) else None
        now = time.monotonic()
        if refused_grace_s is not None and refused_since is not None and now - refused_since >= refused_grace_s:
            raise ServerError(f"nothing answers at target.sglang.url={url} (connection refused for "
                              f"{refused_grace_s:.0f} s): start the server first (`eagle3 sglang serve --config "
                              "...`), fix the URL, or leave target.sglang.url empty to let eagle3 launch one")
        if now - t0 > timeout_s:
            raise ServerError(f"the SGLang server at {url} was not healthy after {timeout_s:.0f} s "
                              f"(target.sglang.startup_timeout_s){log_tail(log_file)}")
        if now - last_note >= 30:
            last_note = now
            log.info("waiting for the SGLang server at %s (%.0f s so far%s)", url, now - t0,
                     f", log: {log_file}" if log_file else "")
        time.sleep(1.0)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group (SGLang's scheduler and TP worker processes included), SIGKILL what is
    left after `grace_s`, and return only once no process of the group is left: the launcher exits first, and a TP
    worker still tearing down holds its GPU's memory, which the next stage's server needs."""
    pgid = proc.pid  # the server runs in its own session: its group id is its pid
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            _reap(proc)
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the launcher, or it stays in the group as a zombie
            if not _group_alive(pgid):
                _reap(proc)  # it may have exited between the poll and the look at the group
                return
            time.sleep(0.1)
    log.warning("processes of the SGLang server's group %d outlived SIGKILL by 10 s", pgid)


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs: read from /proc where there is one (a zombie whose parent does
    not reap it, as a container's PID 1 may not, holds nothing but answers signal 0), else signal 0."""
    proc_fs = Path("/proc")
    if proc_fs.is_dir():
        for entry in proc_fs.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state ppid pgrp ...
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so atexit handlers (server stop, dump cleanup) run; keep others' handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when the parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def check_plugin(python: str, mooncake: bool = False) -> None:
    """Refuse to start a capture server whose Python cannot see eagle3's SGLang plugin (it would dump nothing), or,
    for the `mooncake` transport, cannot load Mooncake (it would hand nothing over)."""
    from eagle3.targets.mooncake import INSTALL_HINT
    from eagle3.targets.sglang_capture import ENTRY_POINT

    code = ("from importlib.metadata import entry_points; import sys; "
            f"sys.exit(0 if any(e.name == {ENTRY_POINT!r} for e in entry_points(group='sglang.srt.plugins')) else 3)")
    # cwd "/": from a checkout, `-c` would find the checkout's own eagle3.egg-info and pass without an install
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    if r.returncode != 0:
        raise ServerError(
            f"{python} (the Python that runs SGLang) does not have eagle3's capture plugin ({ENTRY_POINT} in the "
            f"sglang.srt.plugins entry points), so the server would write no hidden states: install eagle3 there "
            f"(`{python} -m pip install --no-deps -e <eagle3 checkout>`){(': ' + r.stderr.strip()) if r.stderr else ''}"
        )
    if mooncake:
        r = subprocess.run([python, "-c", "from eagle3.targets.mooncake import store_module; store_module()"],
                           capture_output=True, text=True, timeout=120, cwd="/")
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            raise ServerError(f"{python} (the Python that runs SGLang) cannot load Mooncake, so the server would hand "
                              f"no states over ({last}): in that Python, {INSTALL_HINT}")


class SGLangServer:
    """One `sglang.launch_server` process on a free loopback port (see the module docstring)."""

    def __init__(self, flags: list[str], env: dict[str, str], log_file: Path, timeout_s: float,
                 host: str = "127.0.0.1", what: str = "SGLang"):
        self.log_file = log_file
        self._closed = False
        log_file.parent.mkdir(parents=True, exist_ok=True)
        atexit.register(self.close)
        exit_on_sigterm()
        for launch in range(1, LAUNCHES + 1):
            start = self._launch(flags, env, host, what)
            try:
                wait_healthy(self.url, timeout_s, self.proc, log_file)
                return
            except BaseException as e:
                if not (isinstance(e, ServerError) and launch < LAUNCHES and _port_taken(log_file, start)):
                    self.close()
                    raise
                stop_process_group(self.proc)
                log.warning("another process took port %d while the server loaded: launching it again on another "
                            "port (%d of %d)", self.port, launch + 1, LAUNCHES)

    def _launch(self, flags: list[str], env: dict[str, str], host: str, what: str) -> int:
        """Start the server on a fresh port; returns where its output starts in the (appended) log."""
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.cmd = [sglang_python(), "-m", "sglang.launch_server", *flags, "--host", host, "--port", str(self.port)]
        log.info("launching %s, log %s:\n  %s", what, self.log_file, shlex.join(self.cmd))
        with open(self.log_file, "ab") as out:
            start = out.tell()
            self.proc = subprocess.Popen(self.cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        return start

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        log.info("stopping the SGLang server (pid %d)", self.proc.pid)
        stop_process_group(self.proc)

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
