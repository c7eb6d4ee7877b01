"""The prepared-data folder: the contract between `prepare` and every later stage.

    <prepared_dir>/train/            HF datasets folder: id (str), input_ids (list<int32>), loss_mask (list<int8>)
    <prepared_dir>/eval/             same columns, the held-out split
    <prepared_dir>/vocab.safetensors d2t int64 [draft_vocab] (target = i + d2t[i]), t2d bool [target_vocab]
    <prepared_dir>/meta.json         fingerprint, tokenizer, template, max_length, summary, vocab coverage, and
                                     every other file's size and SHA-256 (checked on every read)

The draft vocab is counted once here and only loaded afterwards: regenerating it on resume silently misaligns
a trained lm_head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3.fsutil import damaged_files
from eagle3.logs import UserError


class PreparedError(UserError, ValueError):
    """Prepared data that is missing or damaged, phrased for the user (the fix: re-run `eagle3 prepare`)."""


@dataclass
class Prepared:
    train: Any  # datasets.Dataset
    eval: Any  # datasets.Dataset
    d2t: torch.Tensor
    t2d: torch.Tensor
    meta: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]


def save_vocab(path: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    save_file({"d2t": d2t.to(torch.int64).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}, str(path))


def load_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d), copied out of the file's mapping: a file rewritten in place must never change a vocab in use."""
    t = load_file(str(path))
    return t["d2t"].clone(), t["t2d"].clone()


def is_prepared(prepared_dir: Path) -> bool:
    return all((prepared_dir / n).exists() for n in ("train", "eval", "vocab.safetensors", "meta.json"))


def read_prepared_meta(prepared_dir: str | Path, check_files: bool = True) -> dict[str, Any]:
    """meta.json, with every file it records checked (size and SHA-256: prepared data is small next to a cache).
    Missing or damaged prepared data is one error that names the file and says to re-run `prepare`, which
    rebuilds it; a cache extracted from the same samples stays valid."""
    d = Path(prepared_dir)
    redo = "re-run `eagle3 prepare --config ...` (it rebuilds them; a cache of the same samples stays valid)"
    if not is_prepared(d):
        raise PreparedError(f"no prepared data in {d} (train/, eval/, vocab.safetensors and meta.json): run "
                            "`eagle3 prepare --config ...` first")
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (ValueError, OSError) as e:
        raise PreparedError(f"{d / 'meta.json'} is damaged ({e}): {redo}") from None
    problems = damaged_files(d, meta.get("files", {})) if check_files else []
    if problems:
        raise PreparedError(f"the prepared data in {d} is damaged: {'; '.join(problems)}; {redo}")
    return meta


def load_prepared(prepared_dir: str | Path) -> Prepared:
    from datasets import load_from_disk

    d = Path(prepared_dir)
    meta = read_prepared_meta(d)
    d2t, t2d = load_vocab(d / "vocab.safetensors")
    return Prepared(load_from_disk(str(d / "train")), load_from_disk(str(d / "eval")), d2t, t2d, meta)
