"""Reuse one hidden-state cache for a draft-vocab ablation, honestly.

    python recipes/smollm2-135m/cache_view.py --cache runs/smollm2-135m/cache \
        --prepared runs/smollm2-135m/prepared --variant runs/smollm2-135m/abl/prepared-v4096 \
        --out runs/smollm2-135m/abl/cache-v4096

WHY: the cache fingerprint includes the prepared-data fingerprint, and that one includes `draft.vocab_size`
(eagle3/data/prepare.py fingerprint_inputs), so the trainer refuses a cache extracted for an 8K-vocab prepare when
it is given a 4K-vocab prepare -- even though the hidden states depend only on the token ids, not on the draft vocab.
Re-extracting would cost the whole extraction again. Instead this script:

1. checks that the variant prepared folder (a real `eagle3 prepare` with another draft.vocab_size) holds exactly the
   same samples as the one the cache was extracted from: same ids, input_ids and loss_mask in both splits, same
   max_length (else it refuses, naming the first differing sample);
2. writes a *view* of the cache: its split folders are symlinks to the original shards (no copy), and meta.json is
   the original with `prepared_fingerprint` set to the variant's, plus a `view_of` note saying where it came from.

The trainer's own fingerprint check then passes for the variant, and only for it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3.data.prepared import load_prepared


def same_samples(a: Path, b: Path) -> None:
    """Raise ValueError naming the first split/sample where two prepared folders differ in content."""
    pa, pb = load_prepared(a), load_prepared(b)
    if pa.meta.get("max_length") != pb.meta.get("max_length"):
        raise ValueError(f"max_length differs: {a} has {pa.meta.get('max_length')}, {b} {pb.meta.get('max_length')}")
    for split in ("train", "eval"):
        da, db = getattr(pa, split), getattr(pb, split)
        if len(da) != len(db):
            raise ValueError(f"{split}: {a} has {len(da)} samples, {b} has {len(db)}")
        for i, (ra, rb) in enumerate(zip(da, db, strict=True)):
            for col in ("id", "input_ids", "loss_mask"):
                if ra[col] != rb[col]:
                    raise ValueError(f"{split}[{i}] (id {ra['id']}): column {col} differs between {a} and {b}")


def write_view(cache: Path, variant: Path, out: Path) -> None:
    meta = json.loads((cache / "meta.json").read_text())
    vmeta = json.loads((variant / "meta.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval"):
        link = out / split
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to((cache / split).resolve(), target_is_directory=True)
    meta["fingerprint"]["prepared_fingerprint"] = vmeta["fingerprint"]
    meta["view_of"] = {"cache": str(cache.resolve()), "prepared_fingerprint_extracted_with":
                       json.loads((cache / "meta.json").read_text())["fingerprint"]["prepared_fingerprint"],
                       "why": "same samples (checked by recipes/smollm2-135m/cache_view.py); only draft.vocab_size differs"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, required=True, help="the extracted cache")
    p.add_argument("--prepared", type=Path, required=True, help="the prepared folder the cache was extracted from")
    p.add_argument("--variant", type=Path, required=True, help="a prepared folder differing only in draft vocab")
    p.add_argument("--out", type=Path, required=True, help="where the cache view goes")
    a = p.parse_args()
    fp = json.loads((a.cache / "meta.json").read_text())["fingerprint"]["prepared_fingerprint"]
    if fp != json.loads((a.prepared / "meta.json").read_text())["fingerprint"]:
        print(f"{a.cache} was not extracted from {a.prepared} (prepared fingerprints differ)", file=sys.stderr)
        return 2
    try:
        same_samples(a.prepared, a.variant)
    except ValueError as e:
        print(f"refusing to share the cache: {e}", file=sys.stderr)
        return 2
    write_view(a.cache, a.variant, a.out)
    print(f"cache view for {a.variant}: {a.out} -> {a.cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
