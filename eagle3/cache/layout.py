"""The cache's layout and its record of itself: what it was extracted from (the fingerprint in meta.json), which
files each rank committed (manifests with sizes and SHA-256), and whether the files are still what they say.

    <cache>/meta.json                                    fingerprint + layout (world size, samples per shard)
    <cache>/<split>/rank-00000-of-00002.json             that rank's manifest: committed shards, complete flag
    <cache>/<split>/rank-00000-of-00002-shard-00000.arrow
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.cache.codec import CacheError
from eagle3.fsutil import file_problem, write_json_atomic
from eagle3.layer_ids import LAYER_ID_CONVENTION
from eagle3.targets.info import TargetInfo, read_target_info, weights_id

if TYPE_CHECKING:
    from eagle3.config import Storage, TargetConfig

log = logging.getLogger("eagle3")

FORMAT_VERSION = 2
SPLITS = ("train", "eval")
_LABELS = {
    "layer_ids": "layer ids", "layer_id_convention": "layer-id convention", "dtype": "target dtype",
    "weights_id": "target weights id", "target_path": "target path", "revision": "target revision",
    "prepared_fingerprint": "prepared samples fingerprint", "max_length": "max_length", "hidden_size": "hidden size",
    "num_layers": "number of target layers", "architectures": "target architectures", "format": "cache format",
    "storage": "storage (extract.storage)", "positions": "kept M-RoPE positions (re-extract to add them)",
}


# ------------------------------------------------------------------------------------------------ fingerprint
def expected_fingerprint(target: TargetConfig, storage: Storage, prepared: dict[str, Any] | str | Path
                         ) -> dict[str, Any]:
    """What a cache of `target`'s states for the prepared data (its meta.json, or the folder holding it) must have
    been extracted with; computed from config.json and the weight file listing, without loading the model (the
    trainer calls this before training)."""
    from eagle3.bundled import resolve_target_path

    folder = resolve_target_path(target.path)
    info = read_target_info(folder)
    num_layers = info.num_layers
    if isinstance(prepared, dict):
        prepared_meta = prepared
    else:  # the samples the states belong to: never guessed (a missing file is an error)
        from eagle3.data.prepared import read_prepared_meta

        prepared_meta = read_prepared_meta(Path(prepared), check_files=False)
    return {
        "format": FORMAT_VERSION,
        "target_path": target.path,
        "revision": target.revision,
        "weights_id": weights_id(folder, target.revision),
        "architectures": info.architectures,
        "num_layers": num_layers,
        "hidden_size": info.hidden_size,
        "dtype": target.dtype,
        "layer_ids": target.layer_ids(num_layers),
        "layer_id_convention": LAYER_ID_CONVENTION,
        # The samples, not the draft vocab: states do not depend on it.
        "prepared_fingerprint": prepared_meta.get("samples_fingerprint"),
        "max_length": prepared_meta["max_length"],
        "storage": storage,
        # image samples: the cache also keeps the target's merged input embeddings at their image tokens, and an
        # M-RoPE target's positions (vLLM's draft positions; a cache written without them cannot train them)
        **(_image_keys(info) if "images" in (prepared_meta.get("fingerprint_inputs") or {}) else {}),
    }


def _image_keys(info: TargetInfo) -> dict[str, Any]:
    return {"image_embeds": True, **({"positions": "mrope-temporal"} if info.mrope else {})}


def fingerprint_diff(found: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """One readable line per differing field."""
    out = []
    for key in sorted(set(found) | set(expected)):
        if found.get(key) != expected.get(key):
            label = _LABELS.get(key, key)
            out.append(f"was extracted with {label} {found.get(key)!r} but the config asks for {expected.get(key)!r}")
    return out


def read_meta(cache_dir: str | Path, upgraded: bool = True) -> dict[str, Any]:
    """meta.json; a format-1 cache is refused (with the command that upgrades it) unless `upgraded` is False."""
    path = Path(cache_dir) / "meta.json"
    if not path.is_file():
        raise CacheError(f"{cache_dir} is not a hidden-state cache (no meta.json): run `eagle3 extract` first")
    try:
        meta = json.loads(path.read_text())
        version = meta["fingerprint"].get("format")
    except (ValueError, KeyError, AttributeError) as e:
        raise CacheError(f"{path} is damaged ({e}); delete it and re-run `eagle3 extract --config ...`: it is "
                         "rebuilt from the manifests' record of what the shards hold") from e
    if upgraded and version != FORMAT_VERSION:
        raise CacheError(f"cache {cache_dir} is format {version}; this eagle3 reads format {FORMAT_VERSION} (the "
                         "target's argmax stored with every sample, a checksum for every shard). Upgrade it in place "
                         f"once: eagle3 cache upgrade {cache_dir} --config <your config>")
    return meta


def check_fingerprint(cache_dir: str | Path, expected: dict[str, Any]) -> None:
    """Raise CacheError naming every field where the cache differs from what the config asks for."""
    found = read_meta(cache_dir)["fingerprint"]
    diff = fingerprint_diff(found, expected)
    if diff:
        lines = "\n".join(f"  cache {diff_line}" for diff_line in diff)
        raise CacheError(
            f"hidden-state cache {cache_dir} does not match the config:\n{lines}\n"
            f"Use a new extract.cache_dir, or delete {cache_dir} and extract again."
        )


# --------------------------------------------------------------------------------------------------- layout
def rank_stem(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}"


def shard_name(rank: int, world_size: int, index: int) -> str:
    return f"{rank_stem(rank, world_size)}-shard-{index:05d}.arrow"


@dataclass
class ShardEntry:
    index: int
    file: str
    num_samples: int
    num_tokens: int
    bytes: int
    skipped_nonfinite: list[str] = field(default_factory=list)
    """Sample ids of this shard's plan left out because the target gave NaN/inf states (never trained on)."""
    sha256: str = ""
    """The shard file's SHA-256 (hex), checked by verify_cache(full=True)."""


@dataclass
class Manifest:
    """What one rank has committed for one split. Updated atomically, only after the shard file is in place."""

    split: str
    rank: int
    world_size: int
    planned_samples: int
    planned_shards: int
    shards: list[ShardEntry] = field(default_factory=list)
    fingerprint: dict[str, Any] | None = None
    """What the shards were extracted with (meta.json's), so a lost meta.json is rebuilt from the shards' own
    record, never from a config; None in manifests written before it was recorded."""
    layout: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return {s.index for s in self.shards} == set(range(self.planned_shards))

    @staticmethod
    def path(cache_dir: Path, split: str, rank: int, world_size: int) -> Path:
        return Path(cache_dir) / split / f"{rank_stem(rank, world_size)}.json"

    @classmethod
    def load(cls, path: Path) -> Manifest:
        d = json.loads(path.read_text())
        shards = [ShardEntry(**s) for s in d.pop("shards")]
        d.pop("complete", None)
        return cls(**d, shards=shards)

    def save(self, cache_dir: Path) -> None:
        data = {"split": self.split, "rank": self.rank, "world_size": self.world_size,
                "planned_samples": self.planned_samples, "planned_shards": self.planned_shards,
                "shards": [s.__dict__ for s in sorted(self.shards, key=lambda s: s.index)], "complete": self.complete,
                "fingerprint": self.fingerprint, "layout": self.layout}
        write_json_atomic(self.path(cache_dir, self.split, self.rank, self.world_size), data)


# -------------------------------------------------------------------------------------------------- integrity
def shard_problem(path: Path, entry: ShardEntry, full: bool) -> str | None:
    """What is wrong with one listed shard (fsutil.file_problem against its manifest entry), or None; the
    SHA-256 only when `full`."""
    return file_problem(path, entry.bytes, entry.sha256 if full else None, "the manifest")


def damaged_shards(cache_dir: Path, split: str, entries: list[ShardEntry], full: bool = True,
                   label: str = "") -> dict[str, str]:
    """{file: problem} of `entries` of one split. Hashed in threads (hashlib releases the GIL), with progress:
    hashing a Kimi-sized cache reads every byte of it once."""
    from concurrent.futures import ThreadPoolExecutor

    from eagle3.logs import Progress

    out: dict[str, str] = {}
    if not entries:
        return out
    total = sum(e.bytes for e in entries) if full else len(entries)
    with Progress(total, label or f"verify {split}", unit="B" if full else "shard",
                  disable=not full or total < 1e9) as prog, \
            ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        checks = [(e, pool.submit(shard_problem, Path(cache_dir) / split / e.file, e, full)) for e in entries]
        for e, fut in checks:
            problem = fut.result()
            if problem is not None:
                out[e.file] = problem
            prog.update(e.bytes if full else 1)
    return out


def verify_cache(cache_dir: str | Path, full: bool = True, part: tuple[int, int] = (0, 1)) -> list[str]:
    """'<split>/<file>: <problem>' for every listed shard of the cache that is missing, cut short or (`full`)
    damaged. `part` (i, n) checks every n-th shard from the i-th: ranks of a trainer share the work."""
    cache_dir = Path(cache_dir)
    out = []
    for split in SPLITS:
        found, _ = manifests(cache_dir, split)
        entries = sorted((s for m in found for s in m.shards), key=lambda s: s.file)[part[0]::part[1]]
        out += [f"{split}/{f}: {p}" for f, p in damaged_shards(cache_dir, split, entries, full).items()]
    return out


def damaged_error(cache_dir: Path, problems: list[str]) -> CacheError:
    listed = "\n".join(f"  {p}" for p in problems[:20]) + (f"\n  ... {len(problems) - 20} more" if len(problems) > 20
                                                          else "")
    return CacheError(f"cache {cache_dir}: {len(problems)} shard(s) are missing or damaged:\n{listed}\nRe-run the "
                      "same `eagle3 extract --config ...` command: it re-extracts exactly those shards.")


def manifests(cache_dir: str | Path, split: str) -> tuple[list[Manifest], list[int]]:
    """The manifests of all ranks for a split, and the ranks that are missing or incomplete."""
    meta = read_meta(cache_dir)
    world = int(meta["layout"]["world_size"])
    found, incomplete = [], []
    for r in range(world):
        p = Manifest.path(Path(cache_dir), split, r, world)
        if not p.is_file():
            incomplete.append(r)
            continue
        m = Manifest.load(p)
        found.append(m)
        if not m.complete:
            incomplete.append(r)
    return found, incomplete

