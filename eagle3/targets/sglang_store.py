"""The client half of the `mooncake` transport: a process's requests name where their states go (the rid of each
prompt, `eagle3.targets.sglang_dump.store_key`), and their states come back from the Mooncake Store.

Nothing half-read is ever returned: each object is checked as a dump file is (format, layer ids, token ids,
shapes, finite values: `check_states`), copied out of the receive buffer, and removed. An object that is not there
after the server answered was lost (its server died before the read, or was restarted): the request is made again
(`LostStates`), never trained without it. An object the server could not put left `<rid>#error` with why (a full
segment, above all), which is raised as it is.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3.precision import DTYPES
from eagle3.targets.base import Captured
from eagle3.targets.mooncake import ENV_HOSTNAME, StateStore, StoreAddress, StoreError, segment_bytes
from eagle3.targets.sglang_dump import check_states, store_key, store_key_prefix, unpack

if TYPE_CHECKING:
    from eagle3.config import ExtractConfig, SGLangSettings, TrainConfig

log = logging.getLogger("eagle3")


def request_shape(extract: ExtractConfig, train: TrainConfig) -> tuple[int, str]:
    """(tokens of the largest request a client sends, the storage its states travel in): online training asks for
    one micro-batch at a time, in `extract.storage` (what a cache of it would hold: fp8 halves the bytes); offline
    extraction asks for `extract.batch_tokens`, exact (the cache writer encodes, from the exact final state)."""
    if extract.mode == "online":
        return train.batch_tokens * train.sequence_parallel, extract.storage
    return extract.batch_tokens, "exact"


def wire_bytes_per_token(hidden_size: int, dtype: str, storage: str, images: bool = False) -> int:
    """Bytes one token's states take in the store: the codec's states and scales, and its int64 id; with `images`,
    the most an image token adds (its merged input embedding, exact, and its row index)."""
    from eagle3.cache.codec import codec_for

    item = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    return codec_for(storage).bytes_per_token(hidden_size, item) + 8 + (hidden_size * item + 8 if images else 0)


def server_segment(s: SGLangSettings, hidden_size: int, dtype: str, request: tuple[int, str],
                   images: bool = False) -> int:
    """Bytes a capture server lends the store for this config (eagle3.targets.mooncake.segment_bytes); `images`: the
    samples hold images (wire_bytes_per_token)."""
    tokens, storage = request
    return segment_bytes(s.mooncake.clients, tokens, wire_bytes_per_token(hidden_size, dtype, storage, images),
                         s.mooncake.segment_gb)


class LostStates(RuntimeError):
    """The server answered, but a prompt's states are not in the store: make the request again."""


def run_id(logs_dir: Path) -> str:
    """A run's name in its keys: its logs folder (one per output_dir), hashed."""
    return hashlib.sha256(str(Path(logs_dir).absolute()).encode()).hexdigest()[:12]


class StoreHandover:
    """One process's reads from the store: its keys, the objects read, checked and removed."""

    def __init__(self, addr: StoreAddress, logs_dir: Path, rank: int, storage: str):
        self.store = StateStore(addr, segment=0, what=f"process {rank}")
        self.run, self.rank, self.storage = run_id(logs_dir), rank, storage
        self.session = secrets.token_hex(4)
        self._n = itertools.count()
        self.lost = 0
        self.last_meta: dict[str, str] = {}
        # What a killed run of this rank left in the servers' segments (read by nobody, pinned for ever).
        left = self.store.remove_prefix(store_key_prefix(self.run, rank))
        if left:
            log.info("removed %d object(s) an earlier run of this rank left in the Mooncake Store", left)

    def keys(self, n: int) -> list[str]:
        """Fresh rids for `n` prompts: a key is never reused, so no stale object is ever read for a new request."""
        return [store_key(self.run, self.rank, self.session, next(self._n), self.storage) for _ in range(n)]

    def read(self, key: str, token_ids: list[int], *, layer_ids: list[int], hidden_size: int, sample: str,
             dtype: torch.dtype, server: str, image_positions: list[int] | None = None) -> Captured:
        """The checked states of one prompt (check_states), owned by the caller (copied out of the receive buffer)."""
        try:
            blob = self.store.get(key)
        except StoreError as e:
            raise self._why_missing(key, str(e), sample, server) from None
        tensors, meta = unpack(blob, f"sample {sample}: the store's object {key}")
        cap = check_states(tensors, meta, token_ids, layer_ids=layer_ids, hidden_size=hidden_size, sample=sample,
                           where=f"the store's object {key}", dtype=dtype, image_positions=image_positions)
        self.last_meta = meta

        def own(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.clone()

        return Captured(aux=own(cap.aux), final=own(cap.final), aux_scale=own(cap.aux_scale),
                        final_scale=own(cap.final_scale), image_embeds=own(cap.image_embeds))

    def _why_missing(self, key: str, why: str, sample: str, server: str) -> Exception:
        error = self.store.get_small(key + "#error")
        if error is not None:
            self.store.remove([key + "#error"])
            return StoreError(f"sample {sample}: {server}: {error.decode(errors='replace')}")
        if "(-800)" in why:
            return StoreError(f"sample {sample}: the states are in the store but this machine cannot read them from "
                              f"the segment of {server} ({why}): that server advertised an address this machine does not "
                              f"reach; start it with {ENV_HOSTNAME}=<its address on this network>")
        if "(-707)" in why:
            return StoreError(f"sample {sample}: {why}")
        if "(-900)" in why or "(-901)" in why:
            self.store.check_master(every_s=0)  # raises when the master is gone
        return LostStates(f"sample {sample}: no states in the store after {server} answered ({why})")

    def discard(self, keys: list[str]) -> None:
        """Remove a request's objects, read or not (a failed request's may still be there)."""
        try:
            self.store.remove(keys)
        except Exception as e:  # noqa: BLE001 - a dead master is reported by the next request, not here
            log.debug("could not remove %d object(s): %s", len(keys), e)

    def close(self) -> None:
        try:
            if not self.store.master_gone():
                self.store.remove_prefix(store_key_prefix(self.run, self.rank))
        finally:
            self.store.close()

    def describe(self) -> dict[str, Any]:
        return {"run": self.run, "rank": self.rank, "session": self.session, "lost": self.lost}
