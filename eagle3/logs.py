"""Logging and progress that stay readable when redirected to a file.

Python block-buffers stdout into files, and an empty log hides a running job for hours. Every entry point calls
`setup_logging()`, which makes stdout/stderr line-buffered. `Progress` is tqdm on a terminal and, when output goes
to a file, plain log lines with rate and ETA every few seconds instead of carriage returns.

`setup_logging()` also installs an exception hook for the process's *uncaught* exceptions: an error phrased for
the user (a `UserError`, a ValueError/FileNotFoundError/FileExistsError raised by eagle3's own code, a full
disk anywhere) is printed as `error: ...` lines without a traceback, and the process exits with status 1. A
traceback from deep inside a library tells a user nothing they can act on; set EAGLE3_TRACEBACK=1 to see it.
Ctrl-C prints one line too (Python then exits by SIGINT, status 130 in a shell). Anything else (a real bug)
keeps its full traceback.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import time

from tqdm import tqdm

log = logging.getLogger("eagle3")


class UserError(Exception):
    """An error already phrased for the user (what is wrong, where, what to do): no traceback needed."""


_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_OWN_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)
_PKG = os.path.dirname(os.path.abspath(__file__))


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def disk_full_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc` when the disk (or a file-size limit or quota) is full, else None.

    Libraries wrap it differently: pyarrow and Python raise OSError(ENOSPC); torch.save raises a RuntimeError
    ("file write failed") whose context may hold the OSError; some only keep the text."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return e
        text = str(e)
        if "No space left on device" in text or "File too large" in text or "Disk quota exceeded" in text:
            return OSError(errno.ENOSPC, text)
    return None


def _raised_by_eagle3(exc: BaseException) -> bool:
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(_PKG)


def user_message(exc: BaseException) -> str | None:
    """The one-paragraph message for an error phrased for the user, or None when it needs its traceback."""
    full = disk_full_error(exc)
    if full is not None and not isinstance(exc, UserError):
        where = full.filename or next((getattr(e, "filename", None) for e in _chain(exc)
                                       if getattr(e, "filename", None)), None)
        free = ""
        if where:
            try:
                free = f" ({shutil.disk_usage(os.path.dirname(os.path.abspath(where))).free / 1e6:.1f} MB free there)"
            except OSError:
                pass
        return (f"disk full while writing {where or 'a file'}{free}: {full.strerror or full}. What was completed "
                "before is intact; free space (or point the output at a bigger disk) and re-run the same command "
                "to resume.")
    if isinstance(exc, UserError) or (isinstance(exc, _OWN_ERRORS) and _raised_by_eagle3(exc)):
        return str(exc)
    return None


def _excepthook(kind: type[BaseException], exc: BaseException, tb: object) -> None:
    if issubclass(kind, KeyboardInterrupt) and not os.environ.get("EAGLE3_TRACEBACK"):
        sys.stderr.write("interrupted: what was completed before is kept; re-run the same command to resume\n")
        sys.stderr.flush()
        _leave_process_group()
        return
    msg = None if os.environ.get("EAGLE3_TRACEBACK") else user_message(exc)
    if msg is None:
        sys.__excepthook__(kind, exc, tb)  # type: ignore[arg-type]
        _leave_process_group()
        return
    text = "error: " + msg.replace("\n", "\n  ")
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    _tell_the_launcher(text)
    _leave_process_group()


def _tell_the_launcher(text: str) -> None:
    """Under torchrun / `accelerate launch` with several processes, the launcher ends with a summary of the failed
    ranks that reads each one's TORCHELASTIC_ERROR_FILE: the user's error goes there, so the summary's root cause
    is the one-line error, not a bare exit status under the launcher's own traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": text, "extraInfo": {"py_callstack": text,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


def _leave_process_group() -> None:
    """Tear the process group down before the interpreter does: its threads, still joinable at exit, otherwise
    abort the process (SIGABRT, "terminate called without an active exception") after the error was printed,
    and the launcher reports the abort instead of the exit status 1."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def setup_logging(level: int = logging.INFO) -> None:
    if sys.excepthook is sys.__excepthook__:  # never replace a hook someone else installed (pytest, IPython)
        sys.excepthook = _excepthook
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(level)
        log.propagate = False


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """A progress counter: tqdm on a TTY, periodic log lines (done/total, rate, ETA, extras) otherwise."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", interval_s: float = 10.0,
                 disable: bool = False, initial: int = 0):
        self.total, self.desc, self.unit, self.interval_s = total, desc, unit, interval_s
        self.n = initial
        self.disable = disable
        self.extras: dict[str, str] = {}
        self._t0 = time.monotonic()
        self._n0 = initial
        self._last = self._t0
        self._tty = sys.stderr.isatty()
        self._bar = tqdm(total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True) if (
            self._tty and not disable) else None

    def update(self, n: int = 1, **extras: object) -> None:
        self.n += n
        self.extras.update({k: str(v) for k, v in extras.items()})
        if self.disable:
            return
        if self._bar is not None:
            self._bar.update(n)
            if extras:
                self._bar.set_postfix(self.extras, refresh=False)
            return
        now = time.monotonic()
        if now - self._last >= self.interval_s or (self.total is not None and self.n >= self.total):
            self._last = now
            log.info(self.line())

    def rate(self) -> float:
        dt = time.monotonic() - self._t0
        return (self.n - self._n0) / dt if dt > 0 else 0.0

    def line(self) -> str:
        rate = self.rate()
        total = f"/{self.total}" if self.total is not None else ""
        eta = ""
        if self.total is not None and rate > 0:
            eta = f" eta {_fmt_eta((self.total - self.n) / rate)}"
        extra = "".join(f" {k}={v}" for k, v in self.extras.items())
        return f"{self.desc}: {self.n}{total} {self.unit} ({rate:.2f} {self.unit}/s{eta}){extra}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif not self.disable:
            log.info(self.line() + " done")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

