"""Folder publishing (eagle3.fsutil): every state a reader can see is a complete old folder, no folder, or a complete
new one; errors and kills leave nothing half-written that looks complete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3 import fsutil
from eagle3.fsutil import atomic_dir, remove_stale, stale_siblings


def _write(folder: Path, text: str) -> None:
    (folder / "a.txt").write_text(text)
    (folder / "sub").mkdir()
    (folder / "sub" / "b.txt").write_text(text)


def _content(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*.txt"))}


def test_publish_then_replace_leaves_only_the_new_folder(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    with atomic_dir(dest) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-") and not dest.exists()
        _write(tmp, "old")
    with atomic_dir(dest) as tmp:
        _write(tmp, "new")
        assert _content(dest) == {"a.txt": "old", "sub/b.txt": "old"}  # readers see the old one until the end
    assert _content(dest) == {"a.txt": "new", "sub/b.txt": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert oct(dest.stat().st_mode & 0o777) == oct(0o777 & ~fsutil.current_umask())


def test_error_in_the_block_keeps_the_old_folder(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    with atomic_dir(dest) as tmp:
        _write(tmp, "old")
    with pytest.raises(OSError, match="disk full"), atomic_dir(dest) as tmp:
        _write(tmp, "half")
        raise OSError(28, "disk full")
    assert _content(dest) == {"a.txt": "old", "sub/b.txt": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_final_rename_puts_the_old_folder_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "out"
    with atomic_dir(dest) as tmp:
        _write(tmp, "old")
    real = os.replace

    def replace(src: Path, dst: Path) -> None:
        if Path(src).name.startswith(".out.tmp-"):
            raise OSError(5, "I/O error")
        real(src, dst)

    monkeypatch.setattr(fsutil.os, "replace", replace)
    with pytest.raises(OSError, match="I/O error"), atomic_dir(dest) as tmp:
        _write(tmp, "new")
    assert _content(dest) == {"a.txt": "old", "sub/b.txt": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_kill_between_the_renames_leaves_no_partial_folder_and_the_next_run_cleans_up(tmp_path: Path) -> None:
    """SIGKILL right after the old folder was renamed aside: `out` is absent (never partial), the old copy waits in a
    hidden sibling, and the next publish with clear_stale removes it."""
    dest = tmp_path / "out"
    with atomic_dir(dest) as tmp:
        _write(tmp, "old")
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from eagle3 import fsutil
        real = os.replace
        def replace(src, dst):
            real(src, dst)
            if ".out.old-" in str(dst):
                os.kill(os.getpid(), signal.SIGKILL)
        fsutil.os.replace = replace
        with fsutil.atomic_dir(Path({str(dest)!r})) as tmp:
            (tmp / "a.txt").write_text("new")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not dest.exists()
    stale = stale_siblings(dest)
    assert {p.name.split("-")[0] for p in stale} == {".out.tmp", ".out.old"}
    assert _content(next(p for p in stale if ".old-" in p.name) / "out") == {"a.txt": "old", "sub/b.txt": "old"}

    (tmp_path / "other").mkdir()  # not a leftover of `out`: kept
    with atomic_dir(dest, clear_stale=True) as tmp:
        _write(tmp, "new")
    assert _content(dest) == {"a.txt": "new", "sub/b.txt": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "out"]
    remove_stale(dest)  # nothing left to remove: a no-op


def test_a_delete_killed_half_way_leaves_no_partial_folder_under_its_name(tmp_path: Path) -> None:
    """SIGKILL in the middle of `remove_dir`'s delete (one file gone, the rest not): the folder's own name is already
    gone, the rest waits in a hidden leftover that `remove_stale` clears."""
    dest = tmp_path / "out"
    dest.mkdir()
    _write(dest, "old")
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from eagle3 import fsutil
        def rmtree(path, ignore_errors=False):
            next(Path(path).rglob("a.txt")).unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        fsutil.shutil.rmtree = rmtree
        fsutil.remove_dir(Path({str(dest)!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not dest.exists()
    assert [p.name.split("-")[0] for p in stale_siblings(dest)] == [".out.old"]
    remove_stale(dest)
    assert list(tmp_path.iterdir()) == []


def test_pruning_deletes_half_deleted_step_folders_too(tmp_path: Path) -> None:
    """A `step_N` without its trainer_state.json (half deleted by an older version killed mid-prune) is not a
    checkpoint, so pruning by the checkpoint list alone kept it forever; it goes once older than the kept ones."""
    from eagle3.checkpoints import STATE_FILE, _prune

    for n in (2, 4, 6, 8):
        (tmp_path / f"step_{n}").mkdir()
        if n != 4:
            (tmp_path / f"step_{n}" / STATE_FILE).write_text("{}")
    (tmp_path / "best").mkdir()
    (tmp_path / "step_10").mkdir()  # newer but incomplete (being written): never deleted, never counted as kept
    _prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step_10", "step_6", "step_8"]


def test_pruning_where_the_rename_fails_deletes_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk refuses the folder `remove_dir` renames into: the save that came before already succeeded, so
    pruning deletes in place rather than failing it."""
    from eagle3 import checkpoints
    from eagle3.checkpoints import STATE_FILE, _prune

    for n in (2, 4, 6):
        (tmp_path / f"step_{n}").mkdir()
        (tmp_path / f"step_{n}" / STATE_FILE).write_text("{}")

    def full(path: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints, "remove_dir", full)
    _prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_6"]
