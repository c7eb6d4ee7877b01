"""Logging and progress that stay readable when redirected to a file.

Python block-buffers stdout into files: the seed pipeline lost an hour staring at an empty log. Every entry
point calls `setup_logging()`, which makes stdout/stderr line-buffered. `progress()` is tqdm on a terminal and,
when output goes to a file, plain log lines with rate and ETA every few seconds instead of carriage returns.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
log = logging.getLogger("eagle3")


def setup_logging(level: int = logging.INFO) -> None:
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


def progress(it: Iterable[T], total: int | None, desc: str, unit: str = "it") -> Iterator[T]:
    with Progress(total, desc, unit) as p:
        for x in it:
            yield x
            p.update(1)
