"""Shared fixtures: tiny random targets built from configs (Llama and DeepseekV3), saved as real folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)

REPO = Path(__file__).resolve().parent.parent
