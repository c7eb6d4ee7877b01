"""Online mode: hidden states computed by the target while the draft trains, no cache on disk.

For targets whose offline cache would not fit (Kimi-K2.5: docs/kimi-k2.5.md "Budget") the
trainer asks for the states of each batch as it goes. A background thread keeps `prefetch` batches ready, so the
target's forward of batch i+1 overlaps the draft's step on batch i (torch releases the GIL inside its kernels).

Items are the same dicts `HiddenStateDataset` yields, so the trainer cannot tell the two modes apart:
{"sample_id", "input_ids" int64 [T], "loss_mask" int8 [T], "aux" [T,3H], "final" [T,H], "target_argmax" [T]}
(the target's full-vocab argmax, computed by an eagle3.targets.argmax.ArgmaxHead as extraction does).

    batches = OnlineBatches(backend, prepared.train, index_batches, argmax, prefetch=cfg.extract.prefetch)
    for items in batches: ...      # one list of item dicts per index batch, in order
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from eagle3.batching import Prefetch, collate, pinned

log = logging.getLogger("eagle3")


def capture_items(backend: Any, dataset: Any, indices: list[int], argmax: Any) -> list[dict[str, Any]]:
    """The item dicts for `indices` of a prepared split, computed by `backend` now.

    A sample whose states are not all finite (NaN/inf from the target) must never be trained on, but dropping it
    would change the batch the trainer planned (and exact resume). It stays in place as a blank: zero states and
    an all-zero loss mask, so no position of it counts in the loss or the metrics; it is logged by id."""
    rows = dataset[list(indices)]
    caps = backend.capture(rows["input_ids"])
    items = []
    for sid, ids, mask, c in zip(rows["id"], rows["input_ids"], rows["loss_mask"], caps, strict=True):
        aux, final = c.aux, c.final
        loss_mask = torch.tensor(mask, dtype=torch.int8)
        if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
            log.warning("online: sample %r: the target returned NaN/inf hidden states; blanked (zero states, no "
                        "loss positions), never trained on", sid)
            aux, final, loss_mask = torch.zeros_like(aux), torch.zeros_like(final), torch.zeros_like(loss_mask)
        items.append({"sample_id": sid, "input_ids": torch.tensor(ids, dtype=torch.int64), "loss_mask": loss_mask,
                      "aux": aux, "final": final, "target_argmax": argmax(final).long()})
    return items


class OnlineBatches:
    """Iterate over `index_batches` (chosen by the trainer), yielding each batch's item dicts, `prefetch` batches
    ahead in a background thread (eagle3.batching.Prefetch: closed and joined when the iteration ends)."""

    def __init__(self, backend: Any, dataset: Any, index_batches: Iterable[list[int]], argmax: Any,
                 prefetch: int = 2):
        self.backend, self.dataset, self.argmax = backend, dataset, argmax
        self.index_batches = index_batches
        self.prefetch = prefetch

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        gen = (capture_items(self.backend, self.dataset, idx, self.argmax) for idx in self.index_batches)
        if self.prefetch <= 0:
            yield from gen
            return
        with Prefetch(gen, self.prefetch, name="eagle3-online-target") as pf:
            try:
                yield from pf
            except Exception as e:
                raise RuntimeError("the online target failed while computing hidden states") from e


class OnlineSource:
    """Online mode: a prepared split whose states the target computes batch by batch, with `lengths` for the
    batch planner; the trainer cannot tell it from a cache split."""

    def __init__(self, backend: Any, split: Any, prefetch: int, argmax: Any):
        self.backend, self.split, self.prefetch, self.argmax = backend, split, prefetch, argmax
        self.lengths = [len(x) for x in split["input_ids"]]

    def __len__(self) -> int:
        return len(self.lengths)

    def iter_collated(self, index_batches: list[list[int]], pin: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Collated batches of `index_batches`, computed by the target now (`pin`: pinned for a CUDA copy)."""
        for items in OnlineBatches(self.backend, self.split, index_batches, self.argmax, self.prefetch):
            yield pinned(collate(items)) if pin else collate(items)
