"""Write a trained head as SGLang or vLLM load it (the fields each engine reads: below).

    eagle3 export --to sglang runs/smollm2/checkpoints/best runs/smollm2/export/sglang
    eagle3 export --to vllm   runs/smollm2/checkpoints/best runs/smollm2/export/vllm

Both engines name the architecture `LlamaForCausalLMEagle3` but read different files:

- SGLang: a flat Llama config (`num_hidden_layers: 1`, `vocab_size` = the TARGET's, `draft_vocab_size`,
  `target_hidden_size`, `eagle_config: {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}`) and
  `midlayer.*` weights. SGLang skips tensor names it does not know without a word, so `layers.0.*` names would
  leave the layer random; `midlayer.*` is the only safe spelling. Missing `draft_vocab_size` makes SGLang use
  the target lm_head silently, and `tie_word_embeddings: true` makes it use the embeddings as lm_head: both are
  written explicitly.
- vLLM (speculators format): `speculators_model_type: "eagle3"`, the Llama fields inside
  `transformer_layer_config`, `draft_vocab_size` / `target_hidden_size` / `eagle_aux_hidden_state_layer_ids` at
  the top level, a `speculators_config` (proposal method + verifier), and `layers.0.*` weights. vLLM's
  speculators reader defaults `norm_before_residual` to TRUE (residual = hidden_norm(feature)); eagle3's head
  (like SGLang's and EAGLE's) keeps the raw feature as the residual, so `norm_before_residual: false` and
  `norm_before_fc: false` are written explicitly.

Layer ids are written in THAT engine's spelling for THAT target family (eagle3.layer_ids.to_engine_ids: vLLM as-is;
SGLang Llama-family k-1; SGLang DeepSeek/Kimi as-is). The `eagle3` block keeps the head's full eagle3 config
(ids in eagle3's convention, the convention's name, the target) and `eagle3_aux_layer_ids` repeats the ids for
`Eagle3Draft.from_pretrained`, so a reload or re-export is unambiguous.

Weights are written in bfloat16 by default (what both engines serve a draft in next to a bf16 target; `dtype=None`
keeps the checkpoint's own dtype). `d2t` stays int64 offsets (`target = i + d2t[i]`), `t2d` bool. Every
inconsistency (missing or contradictory vocab sizes, mapping, shapes, ids) is an error, never a default.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.checkpoints import resolve_draft_folder
from eagle3.fsutil import atomic_dir
from eagle3.layer_ids import LAYER_ID_CONVENTION, arch_family, to_engine_ids
from eagle3.model import CONFIG_NAME, FORMAT, WEIGHTS_NAME, Eagle3DraftConfig
from eagle3.precision import DTYPES

EngineName = Literal["sglang", "vllm"]
_LAYER_KEYS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
)
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", *(f"midlayer.{k}" for k in _LAYER_KEYS))


class ExportError(ValueError):
    """The checkpoint cannot be exported as-is; the message names the folder and the offending field."""


# --------------------------------------------------------------------------------------------------- reading
def read_draft(folder: Path) -> tuple[Eagle3DraftConfig, dict[str, torch.Tensor]]:
    """eagle3's config and `midlayer.*`-named tensors of an eagle3 draft folder or of an eagle3 export."""
    raw = json.loads((folder / CONFIG_NAME).read_text())
    if raw.get("format") == FORMAT:
        block = raw
    elif isinstance(raw.get("eagle3"), dict) and raw["eagle3"].get("format") == FORMAT:
        block = raw["eagle3"]
    else:
        raise ExportError(
            f"{folder / CONFIG_NAME}: not an eagle3 draft or export (no \"format\": \"{FORMAT}\"); to convert a "
            "foreign SGLang/vLLM draft, load it with Eagle3Draft.from_pretrained(path, engine=...) and save_pretrained"
        )
    known = {f.name for f in fields(Eagle3DraftConfig)}
    unknown = sorted(set(block) - known - {"format"})
    if unknown:
        raise ExportError(f"{folder / CONFIG_NAME}: unknown draft config fields {unknown}")
    try:
        config = Eagle3DraftConfig(**{k: v for k, v in block.items() if k != "format"})
    except TypeError as e:
        raise ExportError(f"{folder / CONFIG_NAME}: incomplete draft config: {e}") from None
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise ExportError(f"{folder}: no {WEIGHTS_NAME}")
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(weights), "pt") as f:
        for name in f.keys():
            key = name.removeprefix("model.")
            if key.startswith("layers.0."):
                key = "midlayer." + key.removeprefix("layers.0.")
            tensors[key] = f.get_tensor(name)
    return config, tensors


# ------------------------------------------------------------------------------------------------ validation
def validate(config: Eagle3DraftConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise ExportError naming the field unless config and tensors describe one consistent head."""
    c = config

    def fail(msg: str) -> None:
        raise ExportError(f"{where}: {msg}")

    if not c.draft_vocab_size:
        fail("draft_vocab_size is missing (SGLang would silently use the target's lm_head)")
    if not c.aux_layer_ids or len(c.aux_layer_ids) != 3:
        fail(f"aux_layer_ids must be three ids (low, mid, high), got {c.aux_layer_ids}")
    if c.layer_id_convention != LAYER_ID_CONVENTION:
        fail(f"layer_id_convention is {c.layer_id_convention!r}; eagle3 exports only {LAYER_ID_CONVENTION!r} ids")
    missing = [k for k in REQUIRED if k not in tensors]
    if missing:
        fail(f"tensors missing: {missing}")
    extra = sorted(set(tensors) - set(REQUIRED))
    if extra:
        fail(f"unexpected tensors: {extra}")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dtype.is_floating_point or d2t.dim() != 1:
        fail(f"d2t must be a 1-D integer tensor of offsets, got {d2t.dtype} {tuple(d2t.shape)}")
    if d2t.numel() != c.draft_vocab_size:
        fail(f"d2t has {d2t.numel()} entries but draft_vocab_size is {c.draft_vocab_size}")
    if t2d.dim() != 1 or t2d.numel() != c.vocab_size:
        fail(f"t2d has shape {tuple(t2d.shape)} but the target vocab_size is {c.vocab_size}")
    t2d_b = t2d.bool()
    if int(t2d_b.sum()) != c.draft_vocab_size:
        fail(f"t2d marks {int(t2d_b.sum())} target tokens but draft_vocab_size is {c.draft_vocab_size}")
    target_ids = torch.arange(c.draft_vocab_size) + d2t.long()
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= c.vocab_size:
        fail("d2t maps draft ids outside the target vocab")
    if not torch.equal(target_ids, torch.nonzero(t2d_b).view(-1)):
        fail("d2t is inconsistent with t2d (i + d2t[i] must list exactly the ids t2d marks, in increasing order)")
    h, th = c.hidden_size, c.target_hidden_size
    q_out = c.num_attention_heads * c.head_dim
    kv_out = c.num_key_value_heads * c.head_dim
    shapes = {
        "fc.weight": (h, 3 * th),
        "lm_head.weight": (c.draft_vocab_size, h),
        "norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q_out, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv_out, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv_out, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q_out),
        "midlayer.mlp.gate_proj.weight": (c.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (c.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, c.intermediate_size),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
    }
    for name, want in shapes.items():
        got = tuple(tensors[name].shape)
        if got != want:
            what = "rows != draft_vocab_size" if name == "lm_head.weight" and got[0] != want[0] else "wrong shape"
            fail(f"{name} has shape {got}, config says {want} ({what})")


def _family(config: Eagle3DraftConfig, where: str):
    t = config.target or {}
    if not t.get("architectures") and not t.get("model_type"):
        raise ExportError(
            f"{where}: the draft config does not name the target's architectures/model_type; SGLang spells layer "
            "ids differently for Llama- and DeepSeek-family targets, so the export cannot choose"
        )
    return arch_family(t.get("architectures"), t.get("model_type"))


# ------------------------------------------------------------------------------------------------ configs
def _llama_fields(c: Eagle3DraftConfig, dtype_name: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype_name,
    }
    if c.rope_scaling:
        out["rope_scaling"] = dict(c.rope_scaling)
    return out


def engine_config(config: Eagle3DraftConfig, to: EngineName, dtype_name: str,
                  num_speculative_tokens: int = 3) -> dict[str, Any]:
    """The config.json an engine reads for this head (see the module docstring for each field's reason)."""
    where = "draft config"
    family = _family(config, where)
    try:
        ids = to_engine_ids(list(config.aux_layer_ids or []), to, family)
    except ValueError as e:
        raise ExportError(f"{where}: aux_layer_ids {config.aux_layer_ids}: {e}") from None
    if to == "sglang":
        out = _llama_fields(config, dtype_name)
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    else:
        layer = _llama_fields(config, dtype_name)
        layer["architectures"] = ["LlamaForCausalLM"]
        for k in ("draft_vocab_size", "target_hidden_size"):
            layer.pop(k)
        verifier = (config.target or {}).get("path")
        if not verifier:
            raise ExportError(f"{where}: target.path is missing; vLLM's speculators config needs the verifier")
        out = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "speculators_model_type": "eagle3",
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "norm_before_residual": False,
            "norm_before_fc": False,
            "eagle_aux_hidden_state_layer_ids": ids,
            "transformer_layer_config": layer,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier,
                             "architectures": list((config.target or {}).get("architectures") or [])},
            },
            "torch_dtype": dtype_name,
        }
    out["eagle3_aux_layer_ids"] = list(config.aux_layer_ids or [])
    out["eagle3"] = config.to_json()
    out["eagle3_export"] = {"engine": to, "target_family": family, "engine_layer_ids": ids}
    return out


def engine_tensors(tensors: dict[str, torch.Tensor], to: EngineName, dtype: torch.dtype | None
                   ) -> dict[str, torch.Tensor]:
    """Engine-named tensors: `midlayer.*` for SGLang, `layers.0.*` for vLLM; floats cast, d2t int64, t2d bool.

    A full-vocab head (identity mapping, already checked by `validate`) has no d2t/t2d in the vLLM export."""
    out: dict[str, torch.Tensor] = {}
    full_vocab = tensors["d2t"].numel() == tensors["t2d"].numel() and not tensors["d2t"].any()
    for k, v in tensors.items():
        if to == "vllm" and full_vocab and k in ("d2t", "t2d"):
            continue  # vLLM makes no mapping slot for a full-vocab head and refuses the tensors (0.32)
        if k == "d2t":
            v = v.to(torch.int64)
        elif k == "t2d":
            v = v.to(torch.bool)
        elif dtype is not None:
            v = v.to(dtype)
        name = "layers.0." + k.removeprefix("midlayer.") if (to == "vllm" and k.startswith("midlayer.")) else k
        out[name] = v.contiguous()
    return out


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
    if not names <= {CONFIG_NAME, WEIGHTS_NAME}:
        return False
    try:
        return "eagle3" in json.loads((out / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return False


def export(checkpoint: str | Path, out: str | Path, to: EngineName = "sglang", dtype: str | None = "bfloat16",
           num_speculative_tokens: int = 3) -> Path:
    """Write `config.json` + `model.safetensors` for `to` into `out` (atomically); return `out`.

    `checkpoint`: an eagle3 draft folder, a training step folder (its `draft/`), or an eagle3 export.
    `dtype`: weights dtype of the export (`bfloat16` default; None keeps the checkpoint's).
    """
    if to not in ("sglang", "vllm"):
        raise ExportError(f"unknown engine {to!r}; choose sglang or vllm")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or None")
    folder = resolve_draft_folder(checkpoint)
    config, tensors = read_draft(folder)
    validate(config, tensors, str(folder))
    if getattr(config, "features", "fused") == "top":
        # A top-only ablation head ignores the low/mid thirds; engines feed all three, so zero their fc columns.
        fc = tensors["fc.weight"].clone()
        fc[:, : 2 * (fc.shape[1] // 3)] = 0
        tensors = {**tensors, "fc.weight": fc}
    torch_dtype = DTYPES[dtype] if dtype else tensors["fc.weight"].dtype
    dtype_name = str(torch_dtype).removeprefix("torch.")
    cfg_json = engine_config(config, to, dtype_name, num_speculative_tokens)
    weights = engine_tensors(tensors, to, torch_dtype)

    out = Path(out)
    if out.resolve() == folder.resolve():
        raise ExportError(f"{out}: the output folder is the checkpoint itself; choose another folder")
    if not _is_replaceable(out):
        raise ExportError(f"{out}: exists and is not an eagle3 export; refusing to overwrite it")
    with atomic_dir(out) as tmp:
        save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg_json, indent=2) + "\n")
    return out
