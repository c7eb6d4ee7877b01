"""One split of a cache as a torch Dataset: items are zero-copy views of the memory-mapped Arrow shards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from eagle3.cache.codec import CacheError, DecodedBatch, column_np, shard_storage
from eagle3.cache.layout import (
    Manifest,
    ShardEntry,
    check_fingerprint,
    damaged_error,
    fingerprint_diff,
    manifests,
    read_meta,
    shard_problem,
)
from eagle3.precision import DTYPES


class HiddenStateDataset(torch.utils.data.Dataset):
    """One split of a cache as a torch Dataset; items are zero-copy views of the memory-mapped shards.

    `item["aux"]` is [T, 3H] and `item["final"]` [T, H] in the target dtype; `input_ids` int64 [T];
    `loss_mask` int8 [T]; `target_argmax` int64 [T] (the target's full-vocab argmax, a target token id). In an fp8 cache the fp8 states come as float8_e4m3fn with `aux_scale` [T, 3] / `final_scale`
    [T, 1] float32 beside them: `eagle3.cache.dense(item, ds.dtype)` dequantises (the trainer does it on its
    device, after collation). The tensors share memory with the file mapping: copy before writing into them.
    """

    def __init__(self, cache_dir: str | Path, split: str = "train", allow_incomplete: bool = False,
                 expected: dict[str, Any] | None = None):
        self.cache_dir = Path(cache_dir)
        self.meta = read_meta(cache_dir)
        if expected is not None:
            check_fingerprint(cache_dir, expected)
        self.fingerprint = self.meta["fingerprint"]
        self.dtype = DTYPES[self.fingerprint["dtype"]]
        self.hidden_size = int(self.fingerprint["hidden_size"])
        self.layer_ids = list(self.fingerprint["layer_ids"])
        self.storage = self.fingerprint["storage"]
        found, incomplete = manifests(cache_dir, split)
        if incomplete and not allow_incomplete:
            raise CacheError(f"cache {cache_dir} split {split!r} is incomplete: rank(s) {incomplete} have not "
                             f"finished; re-run the same extract command (it resumes) or pass allow_incomplete")
        self._batches: list[DecodedBatch] = []
        self._maps: list[pa.MemoryMappedFile] = []
        where_b, where_r, lengths = [], [], []
        for m in sorted(found, key=lambda m: m.rank):
            if m.fingerprint is not None and fingerprint_diff(m.fingerprint, self.fingerprint):
                raise CacheError(f"{Manifest.path(self.cache_dir, split, m.rank, m.world_size)}: its shards were "
                                 f"extracted with {fingerprint_diff(m.fingerprint, self.fingerprint)} against "
                                 f"{self.cache_dir / 'meta.json'}; the cache mixes two jobs: extract into a new folder")
            for s in sorted(m.shards, key=lambda s: s.index):
                for rb in self._open_shard(split, s):
                    self._batches.append(DecodedBatch(rb, self.dtype))
                    n = rb.num_rows
                    where_b.append(np.full(n, len(self._batches) - 1, dtype=np.int64))
                    where_r.append(np.arange(n, dtype=np.int64))
                    lengths.append(column_np(rb.column("num_tokens")))
        def cat(xs: list[np.ndarray], dt: type) -> np.ndarray:
            return np.concatenate(xs) if xs else np.zeros(0, dtype=dt)

        self._where_b, self._where_r = cat(where_b, np.int64), cat(where_r, np.int64)
        self.num_tokens: np.ndarray = cat(lengths, np.int32)

    def _open_shard(self, split: str, entry: ShardEntry) -> list[pa.RecordBatch]:
        """One shard's record batches, mapped; its size and row count checked against the manifest (free, unlike
        the checksum), and a shard Arrow cannot read named instead of surfacing as a pyarrow traceback."""
        path = self.cache_dir / split / entry.file
        problem = shard_problem(path, entry, full=False)
        try:
            if problem is None:
                mm = pa.memory_map(str(path), "r")
                self._maps.append(mm)
                stream = pa.ipc.open_stream(mm)
                self._check_shard(split, entry.file, stream.schema)
                batches = list(stream)
                rows = sum(rb.num_rows for rb in batches)
                if rows != entry.num_samples:
                    problem = f"{rows} samples where the manifest records {entry.num_samples}"
        except (pa.ArrowException, OSError) as e:
            problem = f"unreadable ({e})"
        if problem is not None:
            raise damaged_error(self.cache_dir, [f"{split}/{entry.file}: {problem}"])
        return batches

    def _check_shard(self, split: str, file: str, sch: pa.Schema) -> None:
        """Every shard must hold what meta.json says: a shard copied in from a cache of another storage or dtype
        would otherwise be read with the wrong layout or trained on beside states of another precision."""
        storage, dtype = shard_storage(sch)
        want = str(self.dtype).removeprefix("torch.")
        if storage != self.storage or (dtype is not None and dtype != want):
            raise CacheError(f"cache {self.cache_dir}: shard {split}/{file} stores {dtype} states as {storage!r}, but "
                             f"the cache (meta.json) is {want} as {self.storage!r}; shards of different storage or "
                             "dtype are never mixed: extract it again into its own extract.cache_dir")

    def __len__(self) -> int:
        return len(self._where_b)

    @property
    def lengths(self) -> list[int]:
        """Token count of every item (for token-budget batching), in index order."""
        return self.num_tokens.tolist()

    @property
    def sample_ids(self) -> list[str]:
        """Every item's prepared sample id, in index order (extraction stores shards by rank and length, and skips a
        sample with NaN states: index i is not the prepared split's row i)."""
        return [sid for b in self._batches for sid in b.sample_ids.to_pylist()]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for a cache split of {len(self)} samples")
        return self._batches[int(self._where_b[i])].item(int(self._where_r[i]))

    def iter_collated(self, index_batches: list[list[int]], pin: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Collated batches of `index_batches`, prefetched in a thread (`pin`: pinned for a CUDA copy)."""
        from eagle3.batching import iter_batches

        return iter_batches(self, index_batches, pin=pin)

