"""The draft vocabulary: the most frequent target tokens among loss-masked positions of the TRAIN split.

    vocab = build_draft_vocab(train_ids, train_masks, target_vocab_size=49152, draft_vocab_size=8192)
    save_vocab(prepared_dir / "vocab.safetensors", vocab.d2t, vocab.t2d)

Selection: top `draft_vocab_size` by count, ties broken by the smaller id (deterministic; tokens never seen
fill the tail by id), then sorted by id. `d2t[i] = target_id - i` (int64; engines compute target = i + d2t[i]),
`t2d` is a bool mask over the target vocab. coverage = share of loss-masked tokens whose id is in the draft vocab.
Two options follow what the head is trained and asked to draft: `token_weights` counts each position that many
times (a weighted mixture's repeat factor of the sample's source: the vocab follows the epochs the head sees, and
coverage is measured over them), and `with_prompts` counts the prompt positions too (`draft.vocab_from:
answers+prompts`: what an answer copies comes from its context); coverage stays over the answers.
If draft_vocab_size >= target_vocab_size the draft vocab is the full target vocab (d2t all zeros, t2d all
True): a tiny target has nothing to prune, and this keeps tiny-model runs working with the default size.
Counting is one numpy bincount over the flattened arrays (no per-token Python loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class DraftVocab:
    d2t: torch.Tensor
    """int64 [draft_vocab]: target id = i + d2t[i]."""
    t2d: torch.Tensor
    """bool [target_vocab]: which target tokens the draft can emit."""
    counts: np.ndarray
    """[target_vocab]: the occurrences per target token the selection ranked (int64; float64 when weighted)."""
    coverage: float
    """Share of loss-masked train tokens inside the draft vocab (weighted like the counts)."""

    @property
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), dtype=torch.int64) + self.d2t

    def coverage_of(self, ids: np.ndarray, mask: np.ndarray) -> float:
        """Coverage on another split (e.g. eval): share of its loss-masked tokens inside the draft vocab."""
        sel = ids[mask.astype(bool)]
        return float(self.t2d.numpy()[sel].mean()) if sel.size else 0.0


def _flat(x: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    return np.concatenate(x) if isinstance(x, list | tuple) else np.asarray(x)


def masked_counts(ids: Sequence[np.ndarray] | np.ndarray, masks: Sequence[np.ndarray] | np.ndarray,
                  target_vocab_size: int, token_weights: np.ndarray | None = None) -> np.ndarray:
    """Token counts over positions where the mask is 1 (each counted `token_weights[pos]` times when given: float
    counts); arrays may be ragged lists or already flat."""
    flat_ids, flat_mask = _flat(ids), _flat(masks)
    if flat_ids.shape != flat_mask.shape:
        raise ValueError(f"input_ids ({flat_ids.shape}) and loss_mask ({flat_mask.shape}) differ in length")
    keep = flat_mask.astype(bool)
    sel = flat_ids[keep].astype(np.int64)
    if sel.size and (sel.min() < 0 or sel.max() >= target_vocab_size):
        raise ValueError(f"token id {int(sel.max())} outside the target vocab of {target_vocab_size}: the tokenizer "
                         f"and the target model disagree")
    if token_weights is None:
        return np.bincount(sel, minlength=target_vocab_size).astype(np.int64)
    w = np.asarray(token_weights, dtype=np.float64)
    if w.shape != flat_ids.shape:
        raise ValueError(f"token_weights ({w.shape}) and input_ids ({flat_ids.shape}) differ in length")
    return np.bincount(sel, weights=w[keep], minlength=target_vocab_size)


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int, answers: np.ndarray | None = None) -> DraftVocab:
    """The top `draft_vocab_size` tokens of `counts`; coverage over `answers` (the loss-masked counts, when the
    ranking counted more: the prompts too), else over `counts`."""
    target_vocab_size = len(counts)
    answers = counts if answers is None else answers
    total = float(answers.sum())
    if draft_vocab_size >= target_vocab_size:
        ids = np.arange(target_vocab_size, dtype=np.int64)
    else:
        # lexsort: last key is primary -> by count descending, then id ascending.
        order = np.lexsort((np.arange(target_vocab_size), -counts))
        ids = np.sort(order[:draft_vocab_size]).astype(np.int64)
    d2t = torch.from_numpy(ids - np.arange(len(ids), dtype=np.int64))
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(ids)] = True
    coverage = float(answers[ids].sum() / total) if total else 0.0
    return DraftVocab(d2t=d2t, t2d=t2d, counts=counts, coverage=coverage)


def build_draft_vocab(ids: Sequence[np.ndarray] | np.ndarray, masks: Sequence[np.ndarray] | np.ndarray,
                      target_vocab_size: int, draft_vocab_size: int, token_weights: np.ndarray | None = None,
                      with_prompts: bool = False) -> DraftVocab:
    """The draft vocab of the answers (loss-masked positions), or of every position with `with_prompts`; each
    position counted `token_weights[pos]` times when given (see the module docstring)."""
    answers = masked_counts(ids, masks, target_vocab_size, token_weights)
    if not with_prompts:
        return select_draft_vocab(answers, draft_vocab_size)
    everything = masked_counts(ids, np.ones_like(_flat(masks)), target_vocab_size, token_weights)
    return select_draft_vocab(everything, draft_vocab_size, answers)



@dataclass
class OutOfVocab:
    """Generated tokens a draft vocabulary cannot propose (`eagle3 vocab coverage`, the eval card): a head drafts only
    tokens of its vocab (t2d), so every such token is a rejection wherever the target emits it. `in_prompt` counts
    those that also occur in the turn's prompt: copyable, where prompt-lookup drafting could propose them."""

    generated: int = 0
    outside: int = 0
    in_prompt: int = 0

    def add(self, tokens: Sequence[int], prompt: Sequence[int], t2d: np.ndarray) -> None:
        """One turn: its generated `tokens` (every one, the end token included), its `prompt` ids, the vocab's t2d."""
        out = [t for t in tokens if not t2d[t]]
        seen = set(prompt)
        self.generated += len(tokens)
        self.outside += len(out)
        self.in_prompt += sum(t in seen for t in out)

    def to_json(self) -> dict[str, Any]:
        n = self.generated
        return {"generated_tokens": n, "out_of_vocab": self.outside / n if n else float("nan"),
                "out_of_vocab_in_prompt": self.in_prompt / n if n else float("nan")}