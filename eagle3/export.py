"""`eagle3 export`: write a trained head as SGLang or vLLM load it, atomically, never over a foreign folder.

    eagle3 export --to sglang runs/smollm2/checkpoints/best runs/smollm2/export/sglang
    eagle3 export --to vllm   runs/smollm2/checkpoints/best runs/smollm2/export/vllm

What each engine reads, and in which spelling, is eagle3.formats' business; this module resolves the checkpoint,
refuses an inconsistent or non-finite head, and writes the folder. Weights are written in bfloat16 by default
(what both engines serve a draft in next to a bf16 target; `dtype=None` keeps the checkpoint's own dtype).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from eagle3.checkpoints import resolve_draft_folder
from eagle3.engines.hybrid_rule import HEAD_PROBS, RULE_FILE, parse_rule
from eagle3.formats import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DraftFormatError,
    engine_config,
    engine_tensors,
    read_draft,
    validate,
)
from eagle3.fsutil import atomic_dir
from eagle3.layer_ids import ArchFamily, Engine
from eagle3.locks import writes
from eagle3.model_card import CARD_NAME, model_card
from eagle3.paths import RunPaths
from eagle3.precision import DTYPES

log = logging.getLogger("eagle3")
ExportError = DraftFormatError


# ------------------------------------------------------------------------------------------------- export
def _is_replaceable(out: Path) -> bool:
    """An output folder we may replace: absent, empty, or a previous eagle3 export (nothing else in it)."""
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    names = {p.name for p in out.iterdir()}
    if not names:
        return True
    if not names <= {CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, HYBRID_DIR}:
        return False
    try:
        return "eagle3" in json.loads((out / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return False


IMAGE_INPUTS_OF = {"sglang": "target-embeddings", "vllm": "placeholder"}
"""What each engine feeds an EAGLE-3 draft at an image token (docs/kimi-k2.5.md "Images"): SGLang 0.5.23 the
target's merged input embeddings, vLLM 0.32 the placeholder token's embedding."""


HYBRID_DIR = RULE_FILE.split("/")[0]


def _served_rule(hybrid: dict[str, Any], to: Engine) -> dict[str, Any]:
    """The hybrid rule as the engine's plugin reads it, or an ExportError where that engine cannot serve it."""
    try:
        hybrid = parse_rule(json.dumps(hybrid), "--hybrid")
    except ValueError as e:
        raise ExportError(str(e)) from e
    head_probs = set(hybrid.get("features", [])) & set(HEAD_PROBS)
    if to == "sglang" and hybrid["rule"] == "router" and head_probs:
        raise ExportError(f"--hybrid: SGLang's topk-1 chain keeps no probabilities of the head's tokens, so a router "
                          f"on {sorted(head_probs)} is served by vLLM only (eagle3.engines.sglang_hybrid): export it "
                          "--to vllm, or fit one on the other features for SGLang")
    return hybrid


@writes(lambda out, **_: out, "export")
def export(checkpoint: str | Path, out: str | Path, to: Engine = "sglang", dtype: str | None = "bfloat16",
           num_speculative_tokens: int = 3, target_family: ArchFamily | None = None,
           paths: RunPaths | None = None, hybrid: dict[str, Any] | None = None) -> Path:
    """Write `config.json` + `model.safetensors` for `to` into `out` (atomically), with its model card
    (`README.md`, eagle3.model_card); return `out`.

    `checkpoint`: an eagle3 draft folder, a training step folder (its `draft/`), or an eagle3 export.
    `dtype`: weights dtype of the export (`bfloat16` default; None keeps the checkpoint's).
    `target_family`: SGLang's layer-id spelling for a target outside eagle3's table (`target.layer_id_family`).
    `paths`: the run's folders for the card (a config's `cfg.paths`; default: the layout around the checkpoint).
    `hybrid`: eagle3's hybrid drafter rule (eagle3.engines.hybrid_rule; e.g. the router benchmarks/bench_hybrid.py
    fitted), written beside the head (RULE_FILE) for `EAGLE3_HYBRID=auto` (the vLLM and SGLang plugins).
    """
    if to not in ("sglang", "vllm"):
        raise ExportError(f"unknown engine {to!r}; choose sglang or vllm")
    if hybrid is not None:
        hybrid = _served_rule(hybrid, to)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or None")
    folder = resolve_draft_folder(checkpoint)
    config, tensors = read_draft(folder)
    served = IMAGE_INPUTS_OF[to]
    if config.image_inputs not in (None, served):
        raise ExportError(f"{folder}: the head was trained with draft.image_inputs={config.image_inputs!r}, and {to} "
                          f"feeds a draft {served!r} inputs at image tokens: it would meet inputs it never saw there "
                          f"(export for {'vllm' if to == 'sglang' else 'sglang'}, or train with "
                          f"draft.image_inputs={served})")
    tensors.pop("embed_tokens.weight", None)  # engines use the target's embeddings
    validate(config, tensors, str(folder))
    if config.features == "top":
        # A top-only ablation head ignores the low/mid thirds; engines feed all three, so zero their fc columns.
        fc = tensors["fc.weight"].clone()
        fc[:, : 2 * (fc.shape[1] // 3)] = 0
        tensors = {**tensors, "fc.weight": fc}
    torch_dtype = DTYPES[dtype] if dtype else tensors["fc.weight"].dtype
    dtype_name = str(torch_dtype).removeprefix("torch.")
    cfg_json = engine_config(config, to, dtype_name, num_speculative_tokens, target_family)
    weights = engine_tensors(tensors, to, torch_dtype)

    out = Path(out)
    if out.resolve() == folder.resolve():
        raise ExportError(f"{out}: the output folder is the checkpoint itself; choose another folder")
    if not _is_replaceable(out):
        raise ExportError(f"{out}: exists and is not an eagle3 export; refusing to overwrite it")
    with atomic_dir(out) as tmp:
        save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg_json, indent=2) + "\n")
        (tmp / CARD_NAME).write_text(model_card(folder, config, cfg_json, to, out, num_speculative_tokens,
                                                target_family, paths, hybrid))
        if hybrid is not None:
            (tmp / RULE_FILE).parent.mkdir()
            (tmp / RULE_FILE).write_text(json.dumps(hybrid, indent=1) + "\n")
    log.info("exported a %s head for %s to %s (layer ids %s in %s's spelling for a %s-family target)", config.arch,
             to, out, cfg_json["eagle3_export"]["engine_layer_ids"], to, cfg_json["eagle3_export"]["target_family"])
    return out
