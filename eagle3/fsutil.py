"""Publishing a folder atomically: the one way eagle3 writes a folder that later stages trust."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling of `dest`; when the block ends without error it replaces `dest` in one
    rename, so a crash or a full disk never leaves a half-written folder that looks complete."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700 folders; published ones get plain modes
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
