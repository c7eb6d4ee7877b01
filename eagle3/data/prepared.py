"""The prepared-data folder: the contract between `prepare` and every later stage.

    <prepared_dir>/train/            HF datasets folder: id (str), input_ids (list<int32>), loss_mask (list<int8>)
    <prepared_dir>/eval/             same columns, the held-out split
    <prepared_dir>/vocab.safetensors d2t int64 [draft_vocab] (target = i + d2t[i]), t2d bool [target_vocab]
    <prepared_dir>/meta.json         fingerprint, tokenizer, template, max_length, summary, vocab coverage

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
    t = load_file(str(path))
    return t["d2t"], t["t2d"]


def is_prepared(prepared_dir: Path) -> bool:
    return all((prepared_dir / n).exists() for n in ("train", "eval", "vocab.safetensors", "meta.json"))


def load_prepared(prepared_dir: str | Path) -> Prepared:
    from datasets import load_from_disk

    d = Path(prepared_dir)
    if not is_prepared(d):
        raise FileNotFoundError(f"no prepared data in {d}: run `eagle3 prepare --config ...` first")
    d2t, t2d = load_vocab(d / "vocab.safetensors")
    meta = json.loads((d / "meta.json").read_text())
    return Prepared(load_from_disk(str(d / "train")), load_from_disk(str(d / "eval")), d2t, t2d, meta)
