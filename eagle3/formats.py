"""Draft folders in every format eagle3 reads or writes: the one place that knows names, fields and id spellings.

    load_draft(folder, embed_weight=...)     any draft folder -> Eagle3Draft (evaluation, init_from, engine checks)
    save_draft(draft, folder)                eagle3's own folder (`"format": "eagle3-draft"`: checkpoints, best)
    read_draft(folder)                       any draft folder -> (Eagle3DraftConfig, `midlayer.*`-named tensors)
    validate(config, tensors, where)         one consistent head, or DraftFormatError naming the field
    engine_config / engine_tensors           the config.json and weights SGLang or vLLM read (eagle3.export)

Formats read: eagle3's own folders and its exports (the full eagle3 config rides along under `"eagle3"`); SGLang
folders (`LlamaForCausalLMEagle3` with a flat Llama config, `Eagle3DeepseekV2ForCausalLM` with a DeepSeek-V3
config); vLLM folders (speculators format for the Llama layer, a DeepSeek-V3 config for MLA); and the published
heads, which leave fields out: no `draft_vocab_size` = the full target vocab, no layer ids = the engines' default
ids, no `d2t` = the identity mapping. Names are read with one rule: `model.` dropped, `layers.0.` = `midlayer.`
(`layers.1.` on: a deeper head's stacked layers, their names as both engines spell them),
SGLang's legacy `aux_norm_{low,mid,high}` = `fc_norm.{0,1,2}`; a tensor or eagle3 config field nobody knows is an
error (SGLang would skip an unknown tensor with only a warning and serve a half-random head).

What each engine reads (SGLang 0.5.23 `llama_eagle3.py` / `kimi_k25_eagle3.py`, vLLM 0.32 `llama_eagle3.py` /
`deepseek_eagle3.py` and its speculators reader):

- SGLang, Llama layer: a flat Llama config (`num_hidden_layers: 1`, `vocab_size` = the TARGET's,
  `draft_vocab_size`, `target_hidden_size`, `eagle_config: {eagle_aux_hidden_state_layer_ids,
  use_aux_hidden_state}`) and `midlayer.*` weights. Missing `draft_vocab_size` makes SGLang use the target's
  lm_head silently, and `tie_word_embeddings: true` the embeddings: both are written explicitly.
- SGLang, MLA layer: a DeepSeek-V3 config (`q_lora_rank` is required) with the same EAGLE-3 fields. Its loader fuses
  `q_a_proj` + `kv_a_proj_with_mqa` and splits `kv_b_proj` into `w_kc`/`w_vc`: the same weights re-laid. SGLang's
  CPU RoPE factory builds only DeepSeek YaRN for these models, so plain RoPE is written as YaRN with factor 1,
  which is the same rotation (mscale 1, no interpolation).
- vLLM, Llama layer (speculators format): `speculators_model_type: "eagle3"`, the Llama fields inside
  `transformer_layer_config`, `draft_vocab_size` / `target_hidden_size` / `eagle_aux_hidden_state_layer_ids` at
  the top level, a `speculators_config`, and `layers.0.*` weights. Its reader defaults `norm_before_residual` to
  TRUE (residual = hidden_norm(feature)); eagle3's head (like SGLang's and EAGLE's) keeps the raw feature, so
  `norm_before_residual: false` and `norm_before_fc: false` are written explicitly.
- vLLM, MLA layer: the speculators reader knows only Llama/Qwen layers, so a DeepSeek-V3 config with
  `architectures: ["Eagle3DeepseekV2ForCausalLM"]` and the EAGLE-3 fields at the top level, `layers.0.*` weights.
- Deeper heads (`num_hidden_layers` > 1, Llama layer; SGLang's MLA head loads one): both engines stack plain
  pre-norm layers after the first, whose one norm before attention vLLM reads as `layers.{i}.input_layernorm` and
  SGLang as `layers.{i}.hidden_norm`: every folder carries both, equal (a folder where they differ is refused:
  the engines would serve two different heads).
- EAGLE-3.1, both engines and layers: `fc_norm` (one RMSNorm per aux state before fc, `fc_norm.{i}.weight`) and
  `norm_output` (the next draft step receives the post-`norm` hidden). vLLM's `norm_before_fc` (one norm over the
  concatenation) is a layout eagle3 does not train and is refused when read.

Layer ids are written in THAT engine's spelling for THAT target family (eagle3.layer_ids.to_engine_ids). The
`eagle3` block keeps the head's full eagle3 config and `eagle3_aux_layer_ids` repeats the ids in eagle3's
convention, so a reload or re-export is unambiguous. `d2t` stays int64 offsets (`target = i + d2t[i]`), `t2d`
bool; a full-vocab head has neither in the vLLM export (vLLM makes no mapping slot for one and refuses them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from eagle3.layer_ids import (
    LAYER_ID_CONVENTION,
    ArchFamily,
    Engine,
    arch_family,
    from_engine_ids,
    sglang_family,
    to_engine_ids,
)
from eagle3.model import FORMAT, Eagle3Draft, Eagle3DraftConfig, stacked_norm_aliases
from eagle3.rope import rope_scaling_of, rope_theta_of

log = logging.getLogger("eagle3")

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_MLA_ARCHS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
_MLA_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                 "v_head_dim": 128}
"""DeepSeek-V3's config defaults: what both engines assume for an MLA field a folder leaves out."""
_LEGACY_NAMES = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}


class DraftFormatError(ValueError):
    """A draft folder that cannot be read, written or served as-is; the message names the folder and field."""


# --------------------------------------------------------------------------------------------------- reading
def read_weights(folder: Path) -> dict[str, Tensor]:
    """Every tensor of a draft folder (one or several safetensors files, or a pytorch_model.bin), names as stored."""
    files = [folder / WEIGHTS_NAME] if (folder / WEIGHTS_NAME).is_file() else sorted(folder.glob("*.safetensors"))
    try:
        if files:
            out: dict[str, Tensor] = {}
            for f in files:
                out.update(load_file(str(f)))
            return out
        if (folder / "pytorch_model.bin").is_file():
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise DraftFormatError(f"{folder}: the weights cannot be read ({e}); the folder is damaged or incomplete") from e
    raise DraftFormatError(f"{folder}: no {WEIGHTS_NAME} / *.safetensors / pytorch_model.bin; not a draft folder")


def internal_name(name: str, where: Path) -> str:
    """A stored tensor name in eagle3's (= SGLang's) spelling: `model.` dropped, `layers.0.` -> `midlayer.`."""
    key = name.removeprefix("model.")
    if key.startswith("layers.0."):
        key = "midlayer." + key.removeprefix("layers.0.")
    head, _, rest = key.partition(".")
    return f"{_LEGACY_NAMES[head]}.{rest}" if head in _LEGACY_NAMES else key


def read_draft(folder: str | Path, *, engine: Engine | None = None, family: ArchFamily | None = None,
               aux_layer_ids: list[int] | None = None) -> tuple[Eagle3DraftConfig, dict[str, Tensor]]:
    """The head's config and tensors (eagle3 names; `embed_tokens.weight` kept when the folder ships one).

    Ids only under `eagle_config` are ambiguous (SGLang and vLLM read them with different meanings): they are read
    in `engine`'s spelling (the format that writes them there is SGLang's; `family=` when the folder does not name
    the target), and without `engine` they are an error; `aux_layer_ids` (eagle3's convention) overrides whatever
    the folder says.
    """
    folder = Path(folder)
    cfg_file = folder / CONFIG_NAME
    if not cfg_file.is_file():
        raise DraftFormatError(f"{folder}: no {CONFIG_NAME}; not a draft folder")
    try:
        raw = json.loads(cfg_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftFormatError(f"{cfg_file}: not valid JSON ({e})") from None
    config = read_config(raw, cfg_file, engine=engine, family=family)
    if aux_layer_ids is not None:
        config.aux_layer_ids = list(aux_layer_ids)
    tensors = {internal_name(k, folder): v for k, v in read_weights(folder).items()}
    if "d2t" not in tensors:
        if config.draft_vocab_size != config.vocab_size:
            raise DraftFormatError(f"{folder}: no d2t tensor but draft_vocab_size ({config.draft_vocab_size}) != "
                                   f"vocab_size ({config.vocab_size})")
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in tensors:  # SGLang's MLA loader ignores t2d; it follows from d2t
        tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
        tensors["t2d"][ids[(ids >= 0) & (ids < config.vocab_size)]] = True
    for sglang_name, name in stacked_norm_aliases(config.num_layers).items():
        if sglang_name in tensors and name in tensors and not torch.equal(tensors[sglang_name], tensors[name]):
            raise DraftFormatError(f"{folder}: {sglang_name} (what SGLang reads) differs from {name} (what vLLM "
                                   "reads): the engines would serve two different heads")
    return config, tensors


def read_config(raw: dict[str, Any], where: Path, *, engine: Engine | None = None,
                family: ArchFamily | None = None) -> Eagle3DraftConfig:
    """eagle3's own config (strict: every field known, none missing), or one an engine reads."""
    block = raw if raw.get("format") == FORMAT else raw.get("eagle3")
    if isinstance(block, dict) and block.get("format") == FORMAT:
        known = {f.name for f in dataclasses.fields(Eagle3DraftConfig)}
        unknown = sorted(set(block) - known - {"format"})
        if unknown:
            raise DraftFormatError(f"{where}: unknown draft config fields {unknown}")
        try:
            return Eagle3DraftConfig(**{k: v for k, v in block.items() if k != "format"})
        except TypeError as e:
            raise DraftFormatError(f"{where}: incomplete draft config: {e}") from None
        except ValueError as e:  # its RoPE scaling (eagle3.rope.normalise_rope)
            raise DraftFormatError(f"{where}: {e}") from None
    return _engine_config_to_eagle3(raw, where, engine, family)


def _is_mla(raw: dict[str, Any]) -> bool:
    return bool(set(raw.get("architectures") or []) & set(_MLA_ARCHS)) or (
        raw.get("model_type") in ("deepseek_v2", "deepseek_v3", "kimi_k2") and raw.get("kv_lora_rank") is not None)


def _engine_config_to_eagle3(raw: dict[str, Any], where: Path, engine: Engine | None,
                             family: ArchFamily | None) -> Eagle3DraftConfig:
    """An SGLang / vLLM / published config: a Llama or DeepSeek-V3 config, or a speculators one wrapping Llama."""
    layer = raw.get("transformer_layer_config") or raw
    missing = [f for f in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if f not in layer]
    if missing:
        raise DraftFormatError(f"{where}: not an EAGLE-3 draft config (missing {missing})")
    if raw.get("norm_before_fc") or (raw.get("speculators_model_type") and raw.get("norm_before_residual", True)):
        raise DraftFormatError(
            f"{where}: norm_before_fc / norm_before_residual (vLLM's speculators default when absent) is a head "
            "layout eagle3 does not train or evaluate (eagle3's residual is the raw fc output, as SGLang's)")
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    draft_vocab = raw.get("draft_vocab_size") or layer.get("draft_vocab_size")
    if draft_vocab is None:
        log.warning("%s: no draft_vocab_size; the head has the full target vocab (%d)", where, layer["vocab_size"])
        draft_vocab = layer["vocab_size"]
    mla = _is_mla(layer)
    try:
        rope_scaling = rope_scaling_of(layer)
    except ValueError as e:
        raise DraftFormatError(f"{where}: {e}") from None
    arch_fields: dict[str, Any] = {}
    if mla:
        arch_fields = {k: layer.get(k, v) for k, v in _MLA_DEFAULTS.items()}
        if arch_fields["q_lora_rank"] is None:
            raise DraftFormatError(f"{where}: q_lora_rank is null; SGLang's MLA head requires the low-rank query")
    num_layers = int(layer.get("num_hidden_layers") or 1)
    if num_layers > 1 and mla:
        raise DraftFormatError(f"{where}: num_hidden_layers={num_layers} on an MLA head; SGLang's MLA head loads one")
    return Eagle3DraftConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads if mla else (layer.get("num_key_value_heads") or heads),
        head_dim=arch_fields["v_head_dim"] if mla else (layer.get("head_dim") or hidden // heads),
        intermediate_size=layer["intermediate_size"],
        vocab_size=layer["vocab_size"],
        draft_vocab_size=draft_vocab,
        target_hidden_size=raw.get("target_hidden_size") or layer.get("target_hidden_size") or hidden,
        rms_norm_eps=layer.get("rms_norm_eps") or 1e-5,
        rope_theta=rope_theta_of(layer),
        rope_scaling=rope_scaling,
        max_position_embeddings=layer.get("max_position_embeddings") or 8192,
        aux_layer_ids=_engine_ids_to_eagle3(raw, where, engine, family),
        hidden_act=layer.get("hidden_act") or "silu",
        arch="mla" if mla else "llama",
        fc_norm=bool(raw.get("fc_norm") or raw.get("use_aux_norm") or layer.get("fc_norm")),
        norm_output=bool(raw.get("norm_output") or layer.get("norm_output")),
        **arch_fields,
    )


def _engine_ids_to_eagle3(raw: dict[str, Any], where: Path, engine: Engine | None,
                          family: ArchFamily | None) -> list[int] | None:
    eagle_cfg = raw.get("eagle_config") or {}
    if "eagle3_aux_layer_ids" in raw:  # written by eagle3's export, already in eagle3's convention
        return list(raw["eagle3_aux_layer_ids"])
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if top is not None or raw.get("speculators_model_type"):
        ids = top or eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        return from_engine_ids(list(ids), "vllm", "llama") if ids else None
    if eagle_cfg.get("eagle_aux_hidden_state_layer_ids") is None:
        log.warning("%s: the draft config names no aux layer ids; engines then capture their default ids "
                    "([2, L//2, L-3] for an L-layer target), which eagle3 uses too unless told otherwise", where)
        return None
    if engine is None:
        raise DraftFormatError(
            f"{where}: layer ids {eagle_cfg['eagle_aux_hidden_state_layer_ids']} under eagle_config mean different "
            "layers for SGLang and vLLM; say which engine this folder was made for (engine='sglang'|'vllm')")
    tgt = raw.get("target") or {}
    fam = family or (arch_family(tgt.get("architectures"), tgt.get("model_type")) if tgt else None)
    if engine == "sglang" and fam is None:
        raise DraftFormatError(f"{where}: SGLang spells ids differently for Llama and DeepSeek targets; pass family=")
    ids = from_engine_ids(list(eagle_cfg["eagle_aux_hidden_state_layer_ids"]), engine, fam or "llama")
    log.warning("%s: layer ids %s under eagle_config read as %s's spelling for a %s-family target = eagle3 ids %s",
                where, eagle_cfg["eagle_aux_hidden_state_layer_ids"], engine, fam or "llama", ids)
    return ids


def load_draft(folder: str | Path, embed_weight: Tensor | None = None, *, engine: Engine | None = None,
               family: ArchFamily | None = None, aux_layer_ids: list[int] | None = None,
               dtype: torch.dtype = torch.float32) -> Eagle3Draft:
    """Any draft folder as a head, validated, with `embed_weight` (else the folder's own embeddings, if any)."""
    config, tensors = read_draft(folder, engine=engine, family=family, aux_layer_ids=aux_layer_ids)
    own_embed = tensors.pop("embed_tokens.weight", None)
    validate(config, tensors, str(folder), need_ids=False)
    model = Eagle3Draft(config).to(dtype)
    skip = {"d2t", "t2d", *stacked_norm_aliases(config.num_layers)}  # the aliases: read_draft checked them equal
    model.load_state_dict({k: v for k, v in tensors.items() if k not in skip}, strict=False)
    model.set_vocab(tensors["d2t"], tensors["t2d"])
    embed = embed_weight if embed_weight is not None else own_embed
    if embed is not None:
        model.set_embeddings(embed)
    return model


# ------------------------------------------------------------------------------------------------ validation
def expected_shapes(config: Eagle3DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a head of this config and its shape, read off the model itself (built on the meta device)."""
    with torch.device("meta"):
        model = Eagle3Draft(config)
    return {k: tuple(v.shape) for k, v in model.draft_state_dict().items()}


def validate(config: Eagle3DraftConfig, tensors: dict[str, Tensor], where: str, need_ids: bool = True) -> None:
    """Raise DraftFormatError naming the field unless config and tensors describe one consistent head."""
    c = config

    def fail(msg: str) -> None:
        raise DraftFormatError(f"{where}: {msg}")

    if not c.draft_vocab_size:
        fail("draft_vocab_size is missing (SGLang would silently use the target's lm_head)")
    if need_ids and (not c.aux_layer_ids or len(c.aux_layer_ids) != 3):
        fail(f"aux_layer_ids must be three ids (low, mid, high), got {c.aux_layer_ids}")
    if c.layer_id_convention != LAYER_ID_CONVENTION:
        fail(f"layer_id_convention is {c.layer_id_convention!r}; eagle3 knows only {LAYER_ID_CONVENTION!r} ids")
    try:
        want = expected_shapes(c)
    except (ValueError, TypeError) as e:
        fail(f"the config does not describe a head: {e}")
    missing = sorted(set(want) - set(tensors))
    if missing:
        fail(f"tensors missing: {missing}")
    extra = sorted(set(tensors) - set(want))
    if extra:
        fail(f"unexpected tensors: {extra} (a {c.arch} head"
             f"{' with' if c.fc_norm else ' without'} fc_norm has exactly {sorted(want)})")
    _validate_vocab(c, tensors["d2t"], tensors["t2d"], fail)
    for name, shape in want.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            what = "rows != draft_vocab_size" if name == "lm_head.weight" and got[0] != shape[0] else "wrong shape"
            fail(f"{name} has shape {got}, config says {shape} ({what})")
        if tensors[name].is_floating_point() and not bool(torch.isfinite(tensors[name]).all()):
            fail(f"{name} holds NaN or infinite values; this head is broken")


def _validate_vocab(c: Eagle3DraftConfig, d2t: Tensor, t2d: Tensor, fail: Any) -> None:
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


# --------------------------------------------------------------------------------------------------- writing
def save_draft(draft: Eagle3Draft, out_dir: str | Path, state_dict: dict[str, Tensor] | None = None,
               dtype: torch.dtype | None = None) -> Path:
    """Write eagle3's own folder: `config.json` (`"format": "eagle3-draft"`) and `model.safetensors`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = draft.draft_state_dict(state_dict)
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    save_file({k: v.cpu() for k, v in tensors.items()}, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(draft.config.to_json(), indent=2) + "\n")
    return out


def target_family(config: Eagle3DraftConfig, where: str, to: Engine = "sglang",
                  override: ArchFamily | None = None) -> ArchFamily:
    """The target family the export spells layer ids for (layer_ids.sglang_family). vLLM reads ids as-is
    whatever the family, so only an SGLang export needs it known."""
    t = config.target or {}
    if override is None and not t.get("architectures") and not t.get("model_type"):
        raise DraftFormatError(
            f"{where}: the draft config does not name the target's architectures/model_type; SGLang spells layer "
            "ids differently for Llama- and DeepSeek-family targets, so the export cannot choose")
    if to == "vllm" and override is None:
        return arch_family(t.get("architectures"), t.get("model_type"))
    try:
        return sglang_family(t.get("architectures"), t.get("model_type"), override)
    except ValueError as e:
        raise DraftFormatError(f"{where}: {e}") from None


def _common_fields(c: Eagle3DraftConfig, dtype_name: str) -> dict[str, Any]:
    """The fields both layers' configs share (a Llama or DeepSeek-V3 config of the head's layers)."""
    return {
        "num_hidden_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "torch_dtype": dtype_name,
    }


def _llama_fields(c: Eagle3DraftConfig, dtype_name: str) -> dict[str, Any]:
    out = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **_common_fields(c, dtype_name),
           "head_dim": c.head_dim, "mlp_bias": False}
    if c.rope_scaling:
        out["rope_scaling"] = dict(c.rope_scaling)
    out["rope_parameters"] = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    return out


def _mla_fields(c: Eagle3DraftConfig, dtype_name: str) -> dict[str, Any]:
    yarn_identity = {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": c.max_position_embeddings,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    scaling = dict(c.rope_scaling) if c.rope_scaling else yarn_identity
    return {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2",
            **_common_fields(c, dtype_name), "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank,
            "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
            "v_head_dim": c.v_head_dim, "rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": c.rope_theta},
            "rope_interleave": True}


def engine_config(config: Eagle3DraftConfig, to: Engine, dtype_name: str, num_speculative_tokens: int = 3,
                  family_override: ArchFamily | None = None) -> dict[str, Any]:
    """The config.json an engine reads for this head (see the module docstring for each field's reason)."""
    where = "draft config"
    family = target_family(config, where, to, family_override)
    try:
        ids = to_engine_ids(list(config.aux_layer_ids or []), to, family)
    except ValueError as e:
        raise DraftFormatError(f"{where}: aux_layer_ids {config.aux_layer_ids}: {e}") from None
    if to == "sglang" and family == "deepseek" and ids[0] != 1:
        log.info("layer ids %s are in SGLang 0.5.23's spelling for DeepSeek/Kimi targets; releases before it add 1 "
                 "to every id (only ids starting at eagle3 id 2 have a spelling both read alike)", ids)
    eagle_config = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    if config.arch == "mla":
        out = {**_mla_fields(config, dtype_name), "eagle_config": eagle_config}
        if to == "vllm":
            out.update(eagle_aux_hidden_state_layer_ids=ids, norm_before_residual=False)
    elif to == "sglang":
        out = {**_llama_fields(config, dtype_name), "eagle_config": eagle_config}
    else:
        out = _speculators_config(config, dtype_name, ids, num_speculative_tokens)
    out["eagle3_aux_layer_ids"] = list(config.aux_layer_ids or [])
    out["eagle3"] = config.to_json()
    out["eagle3_export"] = {"engine": to, "target_family": family, "engine_layer_ids": ids}
    return out


def _speculators_config(config: Eagle3DraftConfig, dtype_name: str, ids: list[int],
                        num_speculative_tokens: int) -> dict[str, Any]:
    layer = _llama_fields(config, dtype_name)
    layer["architectures"] = ["LlamaForCausalLM"]
    for k in ("draft_vocab_size", "target_hidden_size", "fc_norm", "norm_output"):
        layer.pop(k)
    verifier = (config.target or {}).get("path")
    if not verifier:
        raise DraftFormatError("draft config: target.path is missing; vLLM's speculators config needs the verifier")
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        "eagle_aux_hidden_state_layer_ids": ids,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list((config.target or {}).get("architectures") or [])},
        },
        "torch_dtype": dtype_name,
    }


def engine_tensors(tensors: dict[str, Tensor], to: Engine, dtype: torch.dtype | None) -> dict[str, Tensor]:
    """Engine-named tensors: `midlayer.*` for SGLang, `layers.0.*` for vLLM; floats cast, d2t int64, t2d bool.

    A full-vocab head (identity mapping, already checked by `validate`) has no d2t/t2d in the vLLM export."""
    out: dict[str, Tensor] = {}
    full_vocab = tensors["d2t"].numel() == tensors["t2d"].numel() and not tensors["d2t"].any()
    for k, v in tensors.items():
        if to == "vllm" and full_vocab and k in ("d2t", "t2d"):
            continue
        if k == "d2t":
            v = v.to(torch.int64)
        elif k == "t2d":
            v = v.to(torch.bool)
        elif dtype is not None:
            v = v.to(dtype)
        name = "layers.0." + k.removeprefix("midlayer.") if (to == "vllm" and k.startswith("midlayer.")) else k
        out[name] = v.contiguous()
    return out
