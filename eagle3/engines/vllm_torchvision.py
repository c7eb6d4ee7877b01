"""Torchvision for every process vLLM starts, where vLLM's virtualenv has none of its own.

vLLM's Qwen2-VL module imports transformers' torchvision-only image processor (vllm's
model_executor/models/qwen2_vl.py), in the engine core and in each worker. EAGLE3_VLLM_TORCHVISION names a folder
holding a `torchvision` package (PyPI's CUDA wheel, scripts/setup_torchvision.sh's `.torchvision`); a
`sitecustomize` first on the child's PYTHONPATH (eagle3/engines/torchvision_site.py, copied) imports it beside the CPU
torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TORCHVISION_ENV = "EAGLE3_VLLM_TORCHVISION"
"""A folder holding a `torchvision` package for vLLM's processes (see the module docstring), or unset."""


def torchvision_env(env: dict[str, str], tmp: Path) -> None:
    """With $EAGLE3_VLLM_TORCHVISION set, a `sitecustomize` in `tmp` first on the child's PYTHONPATH: every process
    vLLM starts (engine core, workers) imports that torchvision before transformers looks for it."""
    if not env.get(TORCHVISION_ENV):
        return
    site = tmp / "site"
    site.mkdir()
    shutil.copyfile(Path(__file__).with_name("torchvision_site.py"), site / "sitecustomize.py")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
