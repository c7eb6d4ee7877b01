"""One writer per folder: a second run that would write a folder another run is writing is refused at once.

Two runs on one folder overwrite each other: a second `eagle3 train` (another terminal, a Slurm requeue whose
first copy still runs) resumed from the first's half-written checkpoint and rotated checkpoints under it; a second
`eagle3 extract` deleted the first's live `.tmp` shard as a leftover. Every stage that writes a folder (prepare,
regenerate, extract, train, export, cache convert/upgrade) holds its lock while it writes:

    @writes(lambda cfg, **_: cfg.prepared_dir, "prepare")       # the whole folder
    @writes(lambda cfg, **_: cfg.cache_dir, "extract", per_rank=True)
    with writing(cfg.checkpoint_dir, "train", per_rank=True): ...   # `eagle3 train`, before its imports

Readers (eval, cache info, verify-extraction, the trainer reading a cache) never take one and never wait.

Ranks: each process of a launch locks its own part of the folder (`per_rank`: the rank eagle3.process reports), so
the ranks of one run (accelerate, multi-node, extraction ranks started one by one) never refuse each other, and
each rank of a second run meets the same rank of the first.

The lock is a file beside the folder, `<parent>/.<name>.lock` (a rank's part: `.<name>.rank-00003.lock`),
`flock`ed for as long as the stage writes, holding a record of its writer (host, pid, command, since); its mtime is
the writer's heartbeat, touched every HEARTBEAT_S. It is deleted when the writer is done. A second writer decides:
- the flock is held: refused. The kernel (or the NFS lock manager) releases a flock when its process ends, however
  it ends (SIGKILL, OOM), so a held flock is a live writer and a crashed one never blocks the next run.
- the flock is granted and a record is left in the file: a writer that ended without cleaning up. From this host it
  is gone (its flock would be held otherwise); from another host it is gone once its heartbeat is older than
  STALE_S: a filesystem that grants flocks per host only (NFS `nolock`/`local_lock`, BeeGFS's default) cannot
  show another host's writer to flock, its heartbeat can.
- the filesystem refuses flock (ENOLCK, ENOSYS, EOPNOTSUPP: Lustre without `-o flock`, some FUSE mounts): the
  record alone, created with O_EXCL. This host's writer is gone when its pid is (or is another process: start time,
  boot id); another host's when its heartbeat is old. Two runs starting within the same half second could both
  pass; each reads the record back after a moment and the one overwritten is refused.
The refusal says which of these it saw, and so does the log line of a run that takes a stale lock over.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import inspect
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from eagle3.logs import UserError

log = logging.getLogger("eagle3")
F = TypeVar("F", bound=Callable[..., Any])

HEARTBEAT_S = 5.0
"""How often a writer touches its lock file's mtime."""
STALE_S = 60.0
"""A record from another host whose heartbeat is older than this is a writer that is gone (node lost, killed)."""
SETTLE_S = 0.5
"""Without flock: how long after writing its record a writer reads it back to see whether another run overwrote it."""

_BUSY = {errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES}
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


class FolderBusy(UserError):
    """Another run is writing the folder this one would write."""


# ------------------------------------------------------------------------------------------------ the record
def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _boot_id() -> str | None:
    return _read_text("/proc/sys/kernel/random/boot_id")


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time since boot) of a process from /proc, None where there is none (not Linux, gone)."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)": the name may hold spaces and parentheses
    return fields[0], fields[19]


def _command() -> str:
    argv = [os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
    text = shlex.join(argv).replace("\n", " ")  # the refusal is one line
    return text if len(text) <= 300 else text[:297] + "..."


@dataclass(frozen=True)
class Writer:
    """Who holds a lock: written into the lock file, named in the refusal."""

    stage: str
    pid: int
    host: str
    command: str
    since: float
    boot_id: str | None = None
    pid_start: str | None = None

    @classmethod
    def me(cls, stage: str) -> Writer:
        stat = _proc_stat(os.getpid())
        return cls(stage, os.getpid(), socket.gethostname(), _command(), time.time(), _boot_id(),
                   stat[1] if stat else None)

    @classmethod
    def parse(cls, text: str) -> Writer | None:
        try:
            d = json.loads(text)
            return cls(str(d["stage"]), int(d["pid"]), str(d["host"]), str(d["command"]), float(d["since"]),
                       d.get("boot_id"), d.get("pid_start"))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return (f"eagle3 {self.stage}, pid {self.pid} on host {self.host}, command `{self.command}`, since {when} "
                f"({_ago(time.time() - self.since)})")

    def process_alive(self) -> bool:
        """Whether this writer's process still runs: only answerable on its own host."""
        if self.boot_id and self.boot_id != _boot_id():
            return False  # the host restarted since: the pid names another process, if any
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        stat = _proc_stat(self.pid)
        if stat is None:
            return True
        state, start = stat
        return state not in ("Z", "X") and (self.pid_start is None or start == self.pid_start)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def _read_record(fd: int, tries: int = 10) -> Writer | None:
    """The writer recorded in an open lock file; a writer that has just taken the lock may not have written it yet,
    so an empty or torn record is read again for a moment."""
    for i in range(tries):
        writer = Writer.parse(os.pread(fd, 1 << 16, 0).decode("utf-8", "replace"))
        if writer is not None or i == tries - 1:
            return writer
        time.sleep(0.02)
    return None


def _write_record(fd: int, writer: Writer) -> None:
    data = (json.dumps(asdict(writer)) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (a releasing writer deletes it; a takeover replaces it)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# ------------------------------------------------------------------------------------------------- deciding
def _left_behind(old: Writer | None, mtime: float, flock_granted: bool) -> tuple[bool, str]:
    """(alive, why) for the record found in a lock file: whether its writer may still be writing, and how that
    was decided (said in the refusal, or in the log when the lock is taken over)."""
    age = time.time() - mtime
    if old is None:  # never written (its creator was killed at once), torn, or being written right now
        if flock_granted or age > 10:
            return False, "its record is unreadable (the run that made it ended while writing it)"
        return True, f"its record is being written right now (the file is {age:.1f} s old)"
    if old.host == socket.gethostname():
        if flock_granted:
            return False, (f"its process {old.pid} ended: this host's kernel released its file lock")
        if old.process_alive():
            return True, (f"its process {old.pid} is alive on this host (this filesystem refuses file locks, so "
                          "the lock is the record in the file)")
        return False, f"its process {old.pid} is gone from this host"
    fresh = age <= STALE_S
    how = (f"its heartbeat (the lock file's time) is {age:.0f} s old; a writer on another host is taken for gone "
           f"after {STALE_S:.0f} s without one")
    if fresh:
        reach = ("this host was granted the file lock, but file locks may not reach across hosts on this filesystem"
                 if flock_granted else "this filesystem refuses file locks")
        return True, (f"{how} ({reach}); if that run is gone, re-run this command in {STALE_S - age + 1:.0f} s, "
                      f"or delete the lock file")
    return False, how


def _busy(what: str, path: Path, holder: Writer | None, how: str) -> FolderBusy:
    who = holder.describe() if holder is not None else "a run whose record cannot be read"
    stop = (f"stop it (kill {holder.pid}" + ("" if holder.host == socket.gethostname() else f" on {holder.host}")
            + ")") if holder is not None else "stop it"
    return FolderBusy(f"{what} is being written by another run: {who}. Known because {how}. Wait for that run to "
                      f"finish, or {stop}, then re-run this command (two writers of one folder overwrite each "
                      f"other's files). Lock file: {path}")


# ---------------------------------------------------------------------------------------------- holding one
@dataclass
class _Held:
    path: Path
    fd: int
    refs: int = 1
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


def _open_lock_file(path: Path) -> tuple[int, bool] | None:
    """(fd, created by this call) of the lock file; None when it vanished between the two opens (released)."""
    try:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), True
        except FileExistsError:
            pass
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC), False
        except FileNotFoundError:
            return None
    except OSError as e:
        raise UserError(f"cannot open the lock file {path} ({e.strerror}): a run that writes beside it must create "
                        "and write it; check the folder's permissions and free space (a lock file another user's "
                        "run left behind may be deleted when no run is writing there)") from e


def _acquire(path: Path, what: str, stage: str) -> _Held:
    path.parent.mkdir(parents=True, exist_ok=True)
    me = Writer.me(stage)
    for _ in range(10):
        opened = _open_lock_file(path)
        if opened is None:
            continue
        fd, created = opened
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flock = True
        except OSError as e:
            if e.errno in _BUSY:
                holder = _read_record(fd)
                os.close(fd)
                how = "it holds the file lock, which the kernel releases when that process ends"
                if holder is not None and holder.host == socket.gethostname() and not holder.process_alive():
                    how = (f"its recorded process {holder.pid} is gone, but a process it started holds the file "
                           f"lock (find it with `fuser {path}`)")
                raise _busy(what, path, holder, how) from None
            if e.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            flock = False  # the record alone is the lock: created exclusively, read back after a moment
        if not _same_file(fd, path):  # deleted by a writer releasing it (or taking it over) since our open
            os.close(fd)
            continue
        if not created:
            old = _read_record(fd, tries=1 if flock else 10)
            stat = os.fstat(fd)
            alive, how = _left_behind(old, stat.st_mtime, flock)
            if alive:
                os.close(fd)
                raise _busy(what, path, old, how)
            if old is not None or stat.st_size:
                log.info("%s: taking over the lock %s left by %s: %s", what, path,
                         old.describe() if old else "an unknown run", how)
            if not flock:  # replace the stale record by a file of our own, created exclusively
                path.unlink(missing_ok=True)
                os.close(fd)
                continue
        _write_record(fd, me)
        if not flock:
            time.sleep(SETTLE_S)
            back = Writer.parse(_read_text(str(path)) or "")
            if not _same_file(fd, path) or back != me:
                os.close(fd)
                raise _busy(what, path, back, "it took the lock at the same moment as this run (this filesystem "
                                              "refuses file locks, so the lock is the record in the file)")
        return _Held(path, fd)
    raise UserError(f"could not take the lock {path}: other runs kept taking and releasing it; re-run this command")


def _heartbeat(h: _Held, what: str) -> None:
    lost = False
    while not h.stop.wait(HEARTBEAT_S):
        try:
            os.utime(h.fd)
        except OSError:
            pass
        if not lost and not _same_file(h.fd, h.path):
            lost = True
            log.error("%s: the lock %s was deleted or taken over by another run while this one writes: two runs "
                      "may now write it at once; stop one of them", what, h.path)


def _release(h: _Held) -> None:
    h.stop.set()
    if h.thread is not None:
        h.thread.join()
    if _same_file(h.fd, h.path):
        h.path.unlink(missing_ok=True)  # deleted while still locked: a run that opened it meanwhile retries
    os.close(h.fd)


_held: dict[Path, _Held] = {}
_registry = threading.Lock()


def _forget_in_child() -> None:
    """A forked child (a multiprocessing worker) shares the parent's flocks; closing its copies keeps a child that
    outlives a killed parent from holding the parent's lock."""
    global _registry
    _registry = threading.Lock()
    for h in _held.values():
        try:
            os.close(h.fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@contextmanager
def _holding(path: Path, what: str, stage: str) -> Iterator[None]:
    """The lock at `path` for the block; nested holds in one process share it (the CLI takes the trainer's lock
    before its imports, the trainer again for library callers)."""
    with _registry:
        h = _held.get(path)
        if h is not None:
            h.refs += 1
        else:
            h = _held[path] = _acquire(path, what, stage)
            h.thread = threading.Thread(target=_heartbeat, args=(h, what), name=f"eagle3-lock:{path.name}",
                                        daemon=True)
            h.thread.start()
    try:
        yield
    finally:
        with _registry:
            mine = _held.get(path) is h  # after a fork the child forgot it: never release the parent's lock
            if mine:
                h.refs -= 1
                if h.refs == 0:
                    del _held[path]
                    _release(h)


# ------------------------------------------------------------------------------------------------ the API
def lock_path(folder: str | Path, rank: int | None = None) -> Path:
    """The lock file of `folder` (of rank `rank`'s part of it): beside it, so a folder replaced by a rename (a
    prepared folder, an export) keeps its lock, and nothing is added inside a folder readers compare."""
    folder = Path(folder).resolve()
    part = "" if rank is None else f".rank-{rank:05d}"
    return folder.parent / f".{folder.name}{part}.lock"


@contextmanager
def writing(folder: str | Path, stage: str, per_rank: bool = False) -> Iterator[None]:
    """Hold the write lock of `folder` (with `per_rank`, of this process's rank's part of it) for the block, or
    raise FolderBusy naming the run that holds it."""
    rank = None
    if per_rank:
        from eagle3.process import this_process

        rank = this_process().rank
    path = lock_path(folder, rank)
    what = f"{Path(folder)}" if rank is None else f"rank {rank}'s part of {Path(folder)}"
    with _holding(path, what, stage):
        yield


def writes(folder_of: Callable[..., str | Path], stage: str, per_rank: bool = False) -> Callable[[F], F]:
    """Decorate a stage's entry: `folder_of` gets the call's arguments by name and returns the folder it writes;
    the call runs under `writing(folder, stage, per_rank)`."""

    def decorate(fn: F) -> F:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            with writing(folder_of(**bound.arguments), stage, per_rank):
                return fn(*args, **kwargs)

        return locked  # type: ignore[return-value]

    return decorate

