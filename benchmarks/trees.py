"""Side-by-side benchmarks of two trees: a git revision checked out beside this one, and a script run per tree.

Each tree runs in its own process with its own `eagle3` on PYTHONPATH (two trees' packages cannot share one
process, nor can accelerate's per-process state); the run reports which `eagle3` it imported, so a run that
silently measured the wrong tree is an error rather than a figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """This repository at git revision `rev`, in a scratch `git worktree` removed afterwards."""
    tree = Path(tempfile.mkdtemp(prefix="bench-tree-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], check=True,
                   capture_output=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


def check_imported(tree: Path, where: str | Path) -> None:
    if Path(where) != tree / "eagle3":
        raise RuntimeError(f"the run meant for {tree} imported the eagle3 of {where}")


def run_in_tree(script: str, tree: Path, argv: list[str]) -> dict:
    """`python script *argv --out FILE` with `tree` on PYTHONPATH: the JSON it writes to FILE, whose "eagle3" key
    (the imported package's folder) must be `tree`'s."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, script, *argv, "--out", out.name], check=True, env=env)
        res = json.loads(Path(out.name).read_text())
    check_imported(tree, res["eagle3"])
    return res
