"""The target backend interface: token sequences in, auxiliary and final hidden states out.

Extraction (offline cache or online training) talks to a target only through this, so the HF backend and the
SGLang backend are interchangeable and write the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Captured:
    """The states of one sequence, one row per token; padded positions never appear here."""

    aux: torch.Tensor
    """[T, 3H]: low/mid/high residual streams concatenated, in eagle3's layer-id convention (eagle3.layer_ids)."""
    final: torch.Tensor
    """[T, H]: the last layer's output *after* the final norm (what the target lm_head reads)."""
    aux_scale: torch.Tensor | None = None
    """[T, 3] float32 when `aux` comes fp8-encoded (eagle3.cache.codec: a server sending `extract.storage` fp8)."""
    final_scale: torch.Tensor | None = None
    """[T, 1] float32 when `final` comes fp8-encoded."""
    image_embeds: torch.Tensor | None = None
    """[n, H] for a sample with images: the target's input embeddings at its n image tokens, in order (the vision
    projector's outputs merged there), what SGLang feeds an EAGLE-3 draft at those positions; None without images."""
    positions: torch.Tensor | None = None
    """[T] for an image sample of an M-RoPE target (Qwen2.5-VL): the temporal row of its positions, which vLLM gives
    an EAGLE-3 draft (a picture moves them off the token index); None where the token index is the position."""


class TargetBackend(Protocol):
    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    layer_ids: list[int]
    dtype: torch.dtype

    def capture(self, sequences: list[list[int]]) -> list[Captured]:
        """States for every token of every sequence, in order; raises if a count comes back wrong."""
        ...

    def close(self) -> None: ...

