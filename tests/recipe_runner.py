"""Running the bundled recipe's scripts from tests, as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "smollm2-135m"


def run_recipe(script: str, overrides: list[str], cwd: Path, timeout: float = 600,
               **env: str) -> subprocess.CompletedProcess[str]:
    """`bash recipes/smollm2-135m/<script> <overrides>` with this interpreter's bin first on PATH (the scripts call
    `eagle3`, `accelerate` and `python`), extra environment variables from `env`; fails with the script's output."""
    full_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                **env}
    proc = subprocess.run(["bash", str(RECIPE / script), *overrides], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc
