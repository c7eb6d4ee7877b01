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
