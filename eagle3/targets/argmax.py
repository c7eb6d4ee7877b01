"""The target's full-vocab argmax of each captured token, computed where its states are captured (extraction, online
capture, `eagle3 cache upgrade`) without a [tokens, vocab] logits tensor; the trainer masks out-of-vocab
positions with it. `row_max` is also the teacher's (eagle3.loss)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from eagle3.precision import DTYPES
from eagle3.targets.weights import load_lm_head

if TYPE_CHECKING:
    from eagle3.config import TargetConfig


def lm_head_argmax(weight: Tensor, final: Tensor, chunk: int) -> Tensor:
    """[...] int64 target ids: the argmax of final @ weight.T over the full vocab, in vocab chunks of `chunk`
    rows, so a [N, V] logits tensor is never built (2.7 GB fp32 for 4096 tokens of Kimi's 163840 vocab)."""
    return lm_head_max(weight, final, chunk)[1]


def row_max(z: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """([n] max, [n] int64 index of its first occurrence) of each row of z [n, V], as z.max(-1) gives.

    On the CPU an argmax over the last dim is a scalar loop, several times slower than the vectorised amax
    (BENCHMARKS.md "Training speed", passes over the logits); here amax finds each block of `block` columns'
    maximum, and the argmax runs only on those block maxima and then within the one block per row that holds the
    first maximum.
    """
    n, v = z.shape
    nb = v // block
    if nb < 2:
        return z.max(-1)
    bmax = z[:, : nb * block].unflatten(1, (nb, block)).amax(-1)
    if nb * block < v:
        bmax = torch.cat([bmax, z[:, nb * block :].amax(-1, keepdim=True)], 1)
    best = bmax.argmax(-1)
    start = best * block
    # A short tail block repeats its last column after it, where a first-occurrence argmax never lands.
    cols = (start[:, None] + torch.arange(block, device=z.device)).clamp_(max=v - 1)
    return bmax.gather(1, best[:, None]).squeeze(1), start + z.gather(1, cols).argmax(-1)


LOGITS_PER_BLOCK = 1 << 25
"""Float32 logits one block of lm_head_max holds (128 MB): a long sample is taken in row blocks too, never as one
[T, chunk] product (1 GB for a 32K-token sample at chunk 8192)."""


@torch.no_grad()
def lm_head_max(weight: Tensor, final: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """([...] float32 max logit, [...] int64 its target id) of final @ weight.T, chunked (see lm_head_argmax) over
    the vocab and over rows (LOGITS_PER_BLOCK); every row's result is the same whatever the blocks."""
    lead = final.shape[:-1]
    flat = final.reshape(-1, final.shape[-1])
    n = flat.shape[0]
    best = torch.full((n,), float("-inf"), dtype=torch.float32, device=flat.device)
    best_id = torch.zeros(n, dtype=torch.int64, device=flat.device)
    rows = max(1, LOGITS_PER_BLOCK // min(chunk, weight.shape[0]))
    for r0 in range(0, n, rows):
        x = flat[r0 : r0 + rows].to(weight.dtype)
        top, top_id = best[r0 : r0 + rows], best_id[r0 : r0 + rows]
        for c0 in range(0, weight.shape[0], chunk):
            m, i = row_max((x @ weight[c0 : c0 + chunk].T).float())
            better = m > top
            top.copy_(torch.where(better, m, top))
            top_id.copy_(torch.where(better, i + c0, top_id))
    return best.view(lead), best_id.view(lead)


class ArgmaxHead:
    """The target's lm_head, to compute the full-vocab argmax of each token once, where its states are captured.

    The trainer needs that argmax (as a draft id, or -1) to mask out-of-vocab positions, and getting it reads
    every row of the lm_head: 6x the rows of the loss's draft vocab for SmolLM2, 5x for Kimi-K2.5. Extraction
    stores it in the cache (as target ids: the cache does not depend on the draft vocab), online capture hands
    it over with the states, and `eagle3 cache upgrade` adds it to caches written before it was stored. The
    weights are in the target's dtype; the backend's own lm_head is used where it has one in memory.
    """

    def __init__(self, weight: Tensor, chunk: int):
        self.weight, self.chunk = weight.detach(), chunk

    @classmethod
    def for_backend(cls, backend: Any, target: TargetConfig, chunk: int) -> ArgmaxHead:
        weight = getattr(backend, "lm_head_weight", None)
        if weight is None:  # e.g. SGLang: the weights live in the server
            device = target.device
            if device == "auto" or (device.startswith("cuda") and not torch.cuda.is_available()):
                device = "cuda" if torch.cuda.is_available() else "cpu"
            weight = load_lm_head(target.path).to(device, DTYPES[target.dtype])
            if weight.device.type == "cuda":
                tokens = int(getattr(backend, "request_tokens", 0) or 0)
                free, _ = torch.cuda.mem_get_info(weight.device)
                problem = room_problem(free, working_bytes(tokens, weight.shape[1], weight.element_size()),
                                       weight.device, weight.numel() * weight.element_size())
                if problem:
                    from eagle3.logs import UserError

                    raise UserError(problem)
        return cls(weight, chunk)

    def __call__(self, final: Tensor) -> Tensor:
        """[T] int32 target ids (on the CPU) of final [T, H]."""
        return lm_head_argmax(self.weight, final.to(self.weight.device), self.chunk).to("cpu", torch.int32)


def working_bytes(tokens: int, hidden: int, item_size: int) -> int:
    """What `lm_head_argmax` holds on the device beside the weight for a request of `tokens` tokens: the final
    states moved there, one block of float32 logits and its top-2 temporaries, and the per-row results."""
    return tokens * hidden * item_size + 2 * LOGITS_PER_BLOCK * 4 + tokens * 16


def room_problem(free: int, need: int, device: Any, weight_bytes: int) -> str | None:
    """Why the full-vocab argmax cannot run on `device` (with `free` bytes left once its lm_head is there), or None.
    Beside an SGLang server on the same node that GPU is also one of the server's: its rank's static share, and the
    activations of the largest prefill the preflight just ran, are already taken."""
    if free >= need + (256 << 20):
        return None
    return (f"the target's full-vocab argmax needs {need / 1e9:.2f} GB on {device} beside its lm_head "
            f"({weight_bytes / 1e9:.2f} GB, loaded), {free / 1e9:.2f} GB is free there (an SGLang server on this node "
            "holds its share of that GPU): lower the server's --mem-fraction-static in target.sglang.launch_args "
            "(docs/kimi-k2.5.md 'Memory while extracting'), or give this process another GPU "
            "(target.device=cuda:N)")
