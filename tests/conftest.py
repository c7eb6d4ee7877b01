"""Shared fixtures: tiny random targets built from configs (Llama and DeepseekV3), saved as real folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread: tiny models gain nothing from two, and a busy second core makes two threads ~20x slower.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
