"""Read only the target's token embeddings and lm_head from its safetensors shards.

The draft needs the target's embeddings (frozen inputs) and lm_head (the teacher, and the draft lm_head's
initialisation), nothing else. Kimi-K2.5's full weights are hundreds of GB (docs/kimi-k2.5.md), so the model is never instantiated: the
shard index (`model.safetensors.index.json` weight_map) says which file holds each tensor and `safe_open`
reads just those two.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.targets.info import TargetInfo, read_target_info

_EMBED = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
          "model.language_model.embed_tokens.weight", "embed_tokens.weight")
_LM_HEAD = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


def _weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index when sharded, else by listing the single file(s)."""
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        return dict(json.loads(index[0].read_text())["weight_map"])
    out: dict[str, str] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"target.path: no *.safetensors (or index) in {folder}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                out[k] = f.name
    return out


def _find(names: dict[str, str], candidates: tuple[str, ...], suffix: str) -> str | None:
    for c in candidates:
        if c in names:
            return c
    hits = [k for k in names if k.endswith(suffix) and "vision" not in k and "mm_projector" not in k]
    return hits[0] if len(hits) == 1 else None


def _read(folder: Path, names: dict[str, str], name: str) -> torch.Tensor:
    with safe_open(str(folder / names[name]), framework="pt") as sf:
        return sf.get_tensor(name)


def load_lm_head(path: str | Path) -> torch.Tensor:
    """The target's lm_head [V, H] alone (the embeddings when tied), without loading the model."""
    info, names = _open(path)
    head_name = _find(names, _LM_HEAD, "lm_head.weight")
    if head_name is not None and not info.tied:
        return _read(info.folder, names, head_name)
    return load_target_head(path)[1]


def _open(path: str | Path) -> tuple[TargetInfo, dict[str, str]]:
    info = read_target_info(path)
    return info, _weight_map(info.folder)


def load_target_head(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(embed [V, H], lm_head [V, H], the target's config.json as a dict) without loading the model.

    Accepts a folder path or a `bundled:` name (`target.path`). Tied embeddings (no lm_head
    tensor, or `tie_word_embeddings`) return the embedding matrix as the lm_head too.
    """
    info, names = _open(path)
    folder = info.folder
    embed_name = _find(names, _EMBED, "embed_tokens.weight")
    if embed_name is None:
        raise KeyError(f"target.path {folder}: no token embedding tensor (looked for {', '.join(_EMBED)})")
    embed = _read(folder, names, embed_name)
    tied = info.tied
    head_name = _find(names, _LM_HEAD, "lm_head.weight")
    if head_name is None or tied:
        if head_name is None and not tied:
            raise KeyError(f"target.path {folder}: no lm_head tensor and tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = _read(folder, names, head_name)
    if lm_head.shape != embed.shape:
        raise ValueError(f"target.path {folder}: lm_head {tuple(lm_head.shape)} and embeddings "
                         f"{tuple(embed.shape)} differ in shape")
    return embed, lm_head, info.config
