"""PyPI's torchvision beside a CPU torch, for the tests of vision-language targets (scripts/setup_torchvision.sh):
eagle3/engines/torchvision_site.py does it (declares the two operators its unloadable native library would)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from eagle3.engines.torchvision_site import load as _load

DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".torchvision"


def load(path: str | Path = DEFAULT_DIR) -> ModuleType | None:
    """torchvision from `path` (or the venv's own, when it imports), or None when neither is there. Must run before
    transformers is imported."""
    return _load(path)
