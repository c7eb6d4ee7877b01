"""PyPI's torchvision beside a CPU torch: the one place that knows how (tests/vision_cpu and vLLM's processes).

The wheel's native library links CUDA torch and fails to load; torchvision then registers fake kernels for its
`nms` / `qnms` operators, which were never declared, and `import torchvision` raises. Declaring the two schemas first
lets it import; what transformers' image and video processors use (transforms.v2 on tensors) is pure torch and runs.
The operators themselves stay unavailable.

This file imports nothing from eagle3: eagle3.engines.vllm_torchvision copies it, as `sitecustomize.py`, first on
the PYTHONPATH of vLLM's child (a virtualenv without eagle3), where it loads the folder $EAGLE3_VLLM_TORCHVISION
names in every process vLLM starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_LIB: Any = None


def load(path: str | Path) -> ModuleType | None:
    """torchvision from `path` (or the interpreter's own, when it imports), or None when neither is there. Must run
    before transformers is imported: transformers decides once whether torchvision is available."""
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


if __name__ == "sitecustomize" and os.environ.get("EAGLE3_VLLM_TORCHVISION"):
    load(os.environ["EAGLE3_VLLM_TORCHVISION"])
