"""The on-disk hidden-state cache: sharded Arrow files, read back zero-copy.

    eagle3 cache info runs/smollm2-135m/cache

Layout (one folder per prepared split; every rank of a scaled-out extraction writes only its own files):

    <cache>/meta.json                                    fingerprint + layout (world size, samples per shard)
    <cache>/<split>/rank-00000-of-00002.json             that rank's manifest: committed shards, complete flag
    <cache>/<split>/rank-00000-of-00002-shard-00000.arrow

Each shard is an Arrow IPC stream (what `datasets.Dataset.from_file` reads) with columns sample_id (string),
input_ids (list<int32>), loss_mask (list<int8>), num_tokens (int32), aux (list<fixed_size_list<H3>>), final
(list<fixed_size_list<H>>) and target_argmax (list<int32>: the target's full-vocab argmax at each position, so
the trainer never reads the whole lm_head).

`extract.storage` (eagle3.cache.codec) decides how states are kept. `exact`: bf16/fp16 states as their raw 16-bit
patterns (uint16), so they round-trip bit-exactly (subnormals, -0.0, inf included) through a format that has no
bfloat16 type; float32 stays float32. `fp8` / `fp8-aux`: the fp8 states as their bytes (uint8) with an
`aux_scale` (list<fixed_size_list<float32, 3>>) / `final_scale` (<..., 1>) column beside them. The storage is part
of the fingerprint and of every shard's schema metadata, so shards of two storages are never read as one cache.

A cache is only valid for the exact target weights, dtype, layer ids (and their meaning) and prepared data it was
extracted from; `meta.json` records all of them and `check_fingerprint` refuses a mismatch instead of letting a
trainer learn from the wrong states (the seed's drafter trained on mismatched states reached 15% acceptance).

Integrity: every manifest entry records its shard's size, row count and SHA-256. Reading a cache always checks
size and rows (free); `verify_cache(full=True)` hashes every shard (`eagle3 cache info --verify`, the trainer
before it starts, extraction before it trusts the shards it resumes from). A damaged shard is named, and
re-running `eagle3 extract` re-extracts it. Caches of format 1 (no stored argmax, no checksums) are refused with
the one command that upgrades them in place: `eagle3 cache upgrade`.

The package, one room per job: `layout` (fingerprint, manifests, integrity), `codec` (one codec per storage and
the Arrow encoding), `writer` (shards written whole; extraction's opening and resuming), `dataset` (the reading
Dataset), `tools` (convert, upgrade, info).
"""

from eagle3.cache.codec import (
    CODECS,
    FP8_MAX,
    QUANTIZE_ELEMENTS,
    STATES,
    CacheError,
    Codec,
    codec_for,
    dense,
    dequantize,
    payload_bytes_per_token,
    quantize,
    record_batch,
    schema,
)
from eagle3.cache.dataset import HiddenStateDataset
from eagle3.cache.layout import (
    FORMAT_VERSION,
    SPLITS,
    Manifest,
    ShardEntry,
    check_fingerprint,
    damaged_error,
    expected_fingerprint,
    fingerprint_diff,
    manifests,
    rank_stem,
    read_meta,
    shard_name,
    verify_cache,
)
from eagle3.cache.tools import convert, print_info, summary, upgrade
from eagle3.cache.writer import (
    ShardWriter,
    clean_stale_tmp,
    load_manifest,
    open_cache,
    plan_rank,
    preflight_disk,
    remaining_tokens,
)

__all__ = [
    "CODECS", "FORMAT_VERSION", "FP8_MAX", "QUANTIZE_ELEMENTS", "SPLITS", "STATES", "CacheError", "Codec",
    "HiddenStateDataset", "Manifest", "ShardEntry", "ShardWriter", "check_fingerprint", "clean_stale_tmp", "codec_for",
    "convert", "damaged_error", "dense", "dequantize", "expected_fingerprint", "fingerprint_diff", "load_manifest",
    "manifests", "open_cache", "payload_bytes_per_token", "plan_rank", "preflight_disk", "print_info", "quantize",
    "rank_stem", "read_meta", "record_batch", "remaining_tokens", "schema", "shard_name", "summary", "upgrade",
    "verify_cache",
]
