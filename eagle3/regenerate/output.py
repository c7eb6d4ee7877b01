"""The output JSONL, written so that a killed run (even SIGKILL) resumes without redoing or duplicating work.

One line per finished conversation, written in one `write` and flushed at once (so it survives the process
being killed), fsync'd every few seconds (so it survives the machine). On start the file is read back: a torn
last line (no newline, or not valid JSON) is cut off, and every id already there is skipped. Failures go to a
sidecar `<output>.failed.jsonl` (id + error); it describes the latest run only, because failed conversations are
not in the output and are therefore retried by the next run anyway.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("eagle3")


def failed_path(output: Path) -> Path:
    return output.with_name(output.name + ".failed.jsonl")


def recover(output: Path) -> set[str]:
    """Ids already in `output`; cuts a torn last line off the file first. Raises on damage elsewhere."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    lines = data.split(b"\n")
    # The last element is what follows the final newline: empty for an intact file, a torn line otherwise.
    keep = len(data) - len(lines[-1])
    complete = lines[:-1]
    if complete and not _parses(complete[-1]):
        keep -= len(complete[-1]) + 1
        complete = complete[:-1]
    if keep < len(data):
        log.warning("%s: cutting off a torn last line (%d bytes) left by an interrupted run", output, len(data) - keep)
        with open(output, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    done: set[str] = set()
    for n, raw in enumerate(complete, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            done.add(str(rec["id"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{output}, line {n}: not a regenerated record ({e}); fix or remove the file") from None
    return done


def _parses(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


class JsonlAppender:
    """Appends one JSON object per line; each line is flushed at once, fsync'd every `fsync_every_s`."""

    def __init__(self, path: Path, mode: str = "a", fsync_every_s: float = 5.0):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, mode, encoding="utf-8")
        self._fsync_every_s = fsync_every_s
        self._last_sync = time.monotonic()
        self.lines = 0

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        self.lines += 1
        if time.monotonic() - self._last_sync >= self._fsync_every_s:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._f.fileno())
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            self.sync()
            self._f.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
