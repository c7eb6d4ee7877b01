"""`eagle3 data show`: one prepared sample as the target sees it, with the spans the loss trains on marked.

    eagle3 data show --config configs/smollm2-135m.yaml              # the first train sample
    eagle3 data show --config configs/smollm2-135m.yaml --index 7    # the 8th train sample (--split eval)
    eagle3 data show --config configs/smollm2-135m.yaml --id sharegpt:41

A wrong loss mask trains a head on the wrong tokens and nothing errors, so the sample is decoded stretch by
stretch exactly as its tokens are (special tokens included): trained stretches (loss_mask 1, what the model
generates: answers, their tool-call sections and end-of-turn tokens) between `[[` and `]]`, or in colour on a
terminal; everything between them is prompt. Below it: trained and prompt token counts, and the source record the
sample was made from, read back from its file (samples prepared before eagle3 recorded their record show the
repaired conversation instead).
"""

from __future__ import annotations

import json
import sys
from itertools import groupby
from pathlib import Path
from typing import Any

from eagle3.config import Config, DataConfig
from eagle3.data.prepared import load_prepared
from eagle3.data.sources import read_conversations, read_record, source_name
from eagle3.data.templates import load_tokenizer
from eagle3.data.types import turn_to_row
from eagle3.logs import UserError

OPEN, CLOSE = "[[", "]]"
_GREEN, _RESET = "\033[42;30m", "\033[0m"
LONG_STRING = 2000
"""Strings of the source record longer than this are shortened in the print (a debugging view, not a dump)."""


def find_sample(prepared_dir: Path, index: int | None, sample_id: str | None, split: str) -> tuple[str, int, dict[str, Any]]:
    """(split, index, row) of the asked sample: by id in either split, else by index in `split`."""
    prepared = load_prepared(prepared_dir)
    splits = {"train": prepared.train, "eval": prepared.eval}
    if sample_id is not None:
        for name, ds in splits.items():
            ids = ds["id"]
            if sample_id in ids:
                i = ids.index(sample_id)
                return name, i, ds[i]
        raise UserError(f"no sample with id {sample_id!r} in {prepared_dir} (train or eval); ids look like "
                        f"{prepared.train['id'][:3]}")
    ds = splits[split]
    i = 0 if index is None else index
    if not 0 <= i < len(ds):
        raise UserError(f"--index {i}: the {split} split of {prepared_dir} has {len(ds)} samples (0..{len(ds) - 1})")
    return split, i, ds[i]


def marked_text(tokenizer: Any, ids: list[int], mask: list[int], color: bool) -> str:
    """The sample's text, each trained stretch marked; stretches are decoded whole, so multi-token characters
    stay intact."""
    out = []
    pos = 0
    for trained, group in groupby(mask):
        n = len(list(group))
        text = tokenizer.decode(ids[pos:pos + n], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        pos += n
        if trained:
            text = f"{_GREEN}{text}{_RESET}" if color else f"{OPEN}{text}{CLOSE}"
        out.append(text)
    return "".join(out)


def _shorten(value: Any) -> Any:
    if isinstance(value, str) and len(value) > LONG_STRING:
        return value[:LONG_STRING] + f"... ({len(value) - LONG_STRING} more characters)"
    if isinstance(value, list):
        return [_shorten(v) for v in value]
    if isinstance(value, dict):
        return {k: _shorten(v) for k, v in value.items()}
    return value


def source_record(data: DataConfig, row: dict[str, Any]) -> tuple[str, Any]:
    """(where, record): the raw record the sample came from, else (older folders) the conversation as read."""
    by_name = {source_name(s): s for s in data.sources}
    src = by_name.get(row.get("source") or "")
    if src is not None and row.get("record") is not None:
        return f"{src.path}, record {row['record']}", read_record(src, int(row["record"]))
    base_id = str(row["id"]).split("#")[0]  # prepare makes repeated ids unique with #n
    for src in data.sources:
        for conv in read_conversations(src):
            if conv.id == base_id:
                return (f"{src.path}, conversation {conv.id!r} as read (repaired)",
                        {"id": conv.id, "tools": conv.tools, "turns": [turn_to_row(t) for t in conv.turns]})
    return "not found in data.sources", None


def show(cfg: Config, index: int | None = None, sample_id: str | None = None, split: str = "train",
         color: bool | None = None) -> str:
    split, i, row = find_sample(cfg.prepared_dir, index, sample_id, split)
    tokenizer = load_tokenizer(cfg.target)
    ids, mask = [int(t) for t in row["input_ids"]], [int(m) for m in row["loss_mask"]]
    color = sys.stdout.isatty() if color is None else color
    trained = sum(mask)
    spans = sum(1 for m, _ in groupby(mask) if m)
    where, record = source_record(cfg.data, row)
    mark = "in colour" if color else f"between {OPEN} and {CLOSE}"
    lines = [
        f"sample {row['id']!r} ({split} split, index {i}) of {cfg.prepared_dir}",
        f"tokens: {len(ids)} = {trained} trained (loss_mask 1, in {spans} span{'s' if spans != 1 else ''}) + "
        f"{len(ids) - trained} prompt; trained spans are {mark}",
        "-" * 100,
        marked_text(tokenizer, ids, mask, color),
        "-" * 100,
        f"source: {where}",
    ]
    if record is not None:
        lines.append(json.dumps(_shorten(record), indent=2, ensure_ascii=False))
    return "\n".join(lines)
