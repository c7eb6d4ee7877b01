"""PyPI's torchvision beside a CPU torch, for the tests of vision-language targets (scripts/setup_torchvision.sh).

The wheel's native library links CUDA torch and fails to load; torchvision then registers fake kernels for its
`nms` / `qnms` operators, which were never declared, and `import torchvision` raises. Declaring the two schemas first
lets it import; what transformers' image and video processors use (transforms.v2 on tensors) is pure torch and runs.
The operators themselves stay unavailable (no test calls them)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".torchvision"
_LIB = None


def load(path: str | Path = DEFAULT_DIR) -> ModuleType | None:
    """torchvision from `path` (or the venv's own, when it imports), or None when neither is there. Must run before
    transformers is imported: transformers decides once whether torchvision is available."""
    global _LIB
    try:
        import torchvision

        return torchvision
    except (ImportError, RuntimeError):
        sys.modules.pop("torchvision", None)
    path = Path(path)
    if not (path / "torchvision").is_dir():
        return None
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    import torch

    if _LIB is None:
        _LIB = torch.library.Library("torchvision", "DEF")
        _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    return torchvision
