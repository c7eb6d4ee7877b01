"""Online mode: hidden states computed by the target while the draft trains, no cache on disk.

For targets whose offline cache would not fit (Kimi-K2.5: docs/kimi-k2.5.md "Budget") the
trainer asks for the states of each batch as it goes. A background thread keeps `prefetch` batches ready, so the
target's forward of batch i+1 overlaps the draft's step on batch i (torch releases the GIL inside its kernels).

Items are the same dicts `HiddenStateDataset` yields, so the trainer cannot tell the two modes apart:
{"sample_id", "input_ids" int64 [T], "loss_mask" int8 [T], "aux" [T,3H], "final" [T,H], "target_argmax" [T]}
(the target's full-vocab argmax, computed by an eagle3.targets.argmax.ArgmaxHead as extraction does), with fp8
states and their scales as an `extract.storage` cache of fp8 holds them. Prepared data with images (an `images`
column) is captured with its pictures, and each item also holds `image_positions` [N] and `image_embeds` [N, H]
(and, for an image sample of an M-RoPE target, `positions` [T]), as a cache of image samples does.

    batches = OnlineBatches(backend, prepared.train, index_batches, argmax, prefetch=cfg.extract.prefetch)
    for items in batches: ...      # one list of item dicts per index batch, in order
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from eagle3.batching import Prefetch, collate, pinned
from eagle3.logs import UserError
from eagle3.precision import all_finite

log = logging.getLogger("eagle3")


def capture_items(backend: Any, dataset: Any, indices: list[int], argmax: Any, storage: str = "exact",
                  ) -> list[dict[str, Any]]:
    """The item dicts for `indices` of a prepared split, computed by `backend` now, their states as a cache of
    `storage` holds them (eagle3.cache.codec: fp8 states as float8 with `<state>_scale` beside them), so online
    training sees what offline training on that cache sees. States the backend already sends encoded (the
    `mooncake` transport) are kept as they come; the argmax is then taken on their dequantised final state.

    A sample whose states are not all finite (NaN/inf from the target) must never be trained on, but dropping it
    would change the batch the trainer planned (and exact resume). It stays in place as a blank: zero states and
    an all-zero loss mask, so no position of it counts in the loss or the metrics; it is logged by id.

    A split with images (an `images` column) is captured with them (the target's vision tower runs), and each item
    gets its image token positions and the target's merged input embeddings there (and an M-RoPE target's temporal
    positions), as extraction writes them."""
    from eagle3.cache.codec import STATES, codec_for, dequantize, quantize

    codec = codec_for(storage)
    rows = dataset[list(indices)]
    images = "images" in rows
    caps = backend.capture(rows["input_ids"], rows["images"]) if images else backend.capture(rows["input_ids"])
    items = []
    for sid, ids, mask, c in zip(rows["id"], rows["input_ids"], rows["loss_mask"], caps, strict=True):
        states = {"aux": c.aux, "final": c.final}
        sent = {k: v for k, v in (("aux_scale", c.aux_scale), ("final_scale", c.final_scale)) if v is not None}
        loss_mask = torch.tensor(mask, dtype=torch.int8)
        embeds = c.image_embeds
        if not sent and not all(all_finite(x) for x in states.values()):
            log.warning("online: sample %r: the target returned NaN/inf hidden states; blanked (zero states, no "
                        "loss positions), never trained on", sid)
            states = {k: torch.zeros_like(v) for k, v in states.items()}
            loss_mask = torch.zeros_like(loss_mask)
            embeds = None if embeds is None else torch.zeros_like(embeds)
        final = states["final"]
        if "final_scale" in sent:
            final = dequantize(final, sent["final_scale"], backend.dtype)
        item = {"sample_id": sid, "input_ids": torch.tensor(ids, dtype=torch.int64), "loss_mask": loss_mask,
                "target_argmax": argmax(final).long()}
        for name, x in states.items():
            if f"{name}_scale" in sent:
                item[name], item[f"{name}_scale"] = x, sent[f"{name}_scale"]
            elif name in codec.fp8:
                item[name], item[f"{name}_scale"] = quantize(x, STATES[name])
            else:
                item[name] = x
        if images:  # what the cache of an image sample holds: its image rows only
            pos = torch.nonzero(item["input_ids"] == backend.vision.image_token_id).flatten()
            item["image_positions"], item["image_embeds"] = pos, embeds.to(backend.dtype)
            if c.positions is not None:
                item["positions"] = c.positions.long()
        items.append(item)
    return items


class OnlineBatches:
    """Iterate over `index_batches` (chosen by the trainer), yielding each batch's item dicts, `prefetch` batches
    ahead in a background thread (eagle3.batching.Prefetch: closed and joined when the iteration ends)."""

    def __init__(self, backend: Any, dataset: Any, index_batches: Iterable[list[int]], argmax: Any,
                 prefetch: int = 2, storage: str = "exact"):
        self.backend, self.dataset, self.argmax = backend, dataset, argmax
        self.index_batches = index_batches
        self.prefetch, self.storage = prefetch, storage

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        gen = (capture_items(self.backend, self.dataset, idx, self.argmax, self.storage) for idx in self.index_batches)
        if self.prefetch <= 0:
            yield from gen
            return
        with Prefetch(gen, self.prefetch, name="eagle3-online-target") as pf:
            try:
                yield from pf
            except UserError:
                raise  # already says what is wrong and what to do (a store or server gone): one line, no traceback
            except Exception as e:
                raise RuntimeError("the online target failed while computing hidden states") from e


class OnlineSource:
    """Online mode: a prepared split whose states the target computes batch by batch, with `lengths` for the
    batch planner; the trainer cannot tell it from a cache split."""

    def __init__(self, backend: Any, split: Any, prefetch: int, argmax: Any, storage: str = "exact"):
        self.backend, self.split, self.prefetch, self.argmax = backend, split, prefetch, argmax
        self.storage = storage
        self.lengths = [len(x) for x in split["input_ids"]]

    def __len__(self) -> int:
        return len(self.lengths)

    def iter_collated(self, index_batches: list[list[int]], pin: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Collated batches of `index_batches`, computed by the target now (`pin`: pinned for a CUDA copy)."""
        for items in OnlineBatches(self.backend, self.split, index_batches, self.argmax, self.prefetch, self.storage):
            yield pinned(collate(items)) if pin else collate(items)
