"""Publishing a folder atomically: the one way eagle3 writes a folder that later stages trust.

A reader of `dest` sees either the old complete folder, no folder, or the new complete folder, never a half-written
or half-deleted one: the new folder is built in a hidden sibling, the old one is renamed aside (one rename; deleting
it in place could be killed half way and leave a partial folder that looks complete), the new one renamed in, and
only then is the old one deleted. A kill between the two renames leaves no `dest` and the old folder in a hidden
`.<name>.old-*` sibling; `remove_stale` clears such leftovers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def stale_siblings(dest: Path) -> list[Path]:
    """Hidden leftovers of killed publishes of `dest`: `.<name>.tmp-*` (unfinished) and `.<name>.old-*` (replaced)."""
    if not dest.parent.is_dir():
        return []
    return sorted([*dest.parent.glob(f".{dest.name}.tmp-*"), *dest.parent.glob(f".{dest.name}.old-*")])


def remove_stale(dest: Path) -> None:
    """Delete leftovers of killed publishes; only for writers that never run twice at once on the same `dest`."""
    for stale in stale_siblings(dest):
        shutil.rmtree(stale, ignore_errors=True)


def remove_stale_in(folder: Path) -> None:
    """`remove_stale` for every folder published inside `folder` (the trainer's checkpoints)."""
    for stale in [*folder.glob(".*.tmp-*"), *folder.glob(".*.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)


def remove_dir(path: Path) -> None:
    """Delete a published folder: renamed aside to a hidden `.<name>.old-*` sibling first (one rename), so a kill
    during the delete leaves a leftover `remove_stale` clears, never a half-deleted folder under its own name."""
    if not path.exists():
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    os.replace(path, aside / path.name)
    shutil.rmtree(aside, ignore_errors=True)


def tmp_sibling(dest: Path, tag: str) -> Path:
    """A fixed-name hidden sibling to build `dest` in, named as leftovers are recognised (`.<name>.tmp-<tag>`): for
    writers whose processes must all agree on the name (mkdtemp's random one would differ per process)."""
    return dest.with_name(f".{dest.name}.tmp-{tag}")


def replace_dir(tmp: Path, dest: Path) -> None:
    """Swap the finished folder `tmp` in as `dest`: old `dest` renamed aside, `tmp` renamed in, old deleted.

    If the second rename fails, the old folder is put back, so an error leaves `dest` as it was."""
    aside: Path | None = None
    if dest.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, aside / dest.name)
    try:
        os.replace(tmp, dest)
    except BaseException:
        if aside is not None:
            os.replace(aside / dest.name, dest)
            shutil.rmtree(aside, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def atomic_dir(dest: Path, *, clear_stale: bool = False) -> Iterator[Path]:
    """Yield an empty hidden sibling of `dest`; when the block ends without error it replaces `dest` (`replace_dir`),
    so a crash or a full disk never leaves a half-written folder that looks complete. `clear_stale=True` first
    deletes leftovers of killed runs: only for writers that are never run twice at once on the same `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if clear_stale:
        remove_stale(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700 folders; published ones get plain modes
        replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def current_umask() -> int:
    """The process umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json_atomic(path: Path, data: dict[str, Any], tmp_tag: str = "", default: Any = None) -> None:
    """Readers and a resumed run see either the old or the new file, never half of one. `tmp_tag` keeps the
    temporary names of concurrent writers (ranks writing the same meta.json) apart."""
    tmp = path.with_name(f"{path.name}{tmp_tag}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=default) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: keep the old file, leave no half-written .tmp
        raise


def sha256_file(path: Path, block: int = 1 << 24) -> str:
    """A file's SHA-256 (hex), read in blocks: the checksum every integrity record of eagle3 uses."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def file_records(root: Path, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """{relative path: {bytes, sha256}} of every file under `root` (but `skip`): a folder's integrity record."""
    return {str(f.relative_to(root)): {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
            for f in sorted(root.rglob("*")) if f.is_file() and str(f.relative_to(root)) not in skip}


def file_problem(path: Path, size: int, sha256: str | None, record: str = "the record") -> str | None:
    """What is wrong with one recorded file, or None: missing, another size than `record` says, or (a `sha256`
    given) another SHA-256: a copy cut short, or bytes damaged in place (the size alone misses that)."""
    if not path.is_file():
        return "missing"
    actual = path.stat().st_size
    if actual != size:
        return f"{actual} bytes where {record} records {size} (cut short or overwritten)"
    if sha256 is not None and sha256_file(path) != sha256:
        return f"its SHA-256 differs from {record}'s (damaged in place)"
    return None


def damaged_files(root: Path, records: dict[str, dict[str, Any]]) -> list[str]:
    """'<file>: <problem>' for every recorded file under `root` (file_problem)."""
    problems = ((name, file_problem(root / name, rec["bytes"], rec["sha256"], "the record written with it"))
                for name, rec in records.items())
    return [f"{name}: {problem}" for name, problem in problems if problem]
