"""Rotary positions as the engines apply them: the target's RoPE theta and scaling (YaRN with its mscales, Llama-3.1's
`llama3`, linear) normalised into the head's config.json, transformers' spelling of it for training, the attention
factor YaRN adds, and the longest context a target is served at."""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("eagle3")


def rope_theta_of(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


# -------------------------------------------------------------------------------------------------- RoPE
# The head's RoPE is written to its config.json and both engines build it from there alone (SGLang 0.5.23
# `llama_eagle3.py` / `kimi_k25_eagle3.py` through `get_rope`, vLLM 0.32 `llama_eagle3.py` / `deepseek_eagle3.py`
# through theirs): neither copies the target's scaling into a draft. What must hold is that training rotates as
# the engines will, at every position the engines serve (they size a draft's rotary cache from the target's
# window: SGLang refuses a draft whose own window is shorter, vLLM raises the draft's max_position_embeddings).
ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "truncate", "attention_factor", "attn_factor", "extrapolation_factor"),
}
"""The scalings eagle3 trains as both engines serve them, and the keys either engine reads for each (written to the
export; others, e.g. a target's `partial_rotary_factor`, are not the head's). `dynamic` and `longrope` are refused:
transformers recomputes their frequencies from the sequence length at every call, the engines once."""


def normalise_rope(scaling: dict[str, Any] | None, max_positions: int | None) -> dict[str, Any] | None:
    """`scaling` as the engines read it, with every value an engine would default written out: `rope_type` (not the
    legacy `type`), llama3's and YaRN's `original_max_position_embeddings` (transformers and both engines default it
    to max_position_embeddings, which vLLM raises to the target's window for a draft), YaRN's `factor`
    (transformers derives a missing one as max / original, the engines take 1). None for plain RoPE, and for a
    factor of 1, which is the same rotation (no interpolation, mscale 1). ValueError for a scaling eagle3 does
    not reproduce (ROPE_KEYS)."""
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ROPE_KEYS:
        raise ValueError(f"RoPE scaling {kind!r} is not one eagle3 trains as the engines serve it (it supports "
                         f"{', '.join(ROPE_KEYS)}: transformers recomputes {kind!r} from the sequence length)")
    out: dict[str, Any] = {"rope_type": kind, **{k: scaling[k] for k in ROPE_KEYS[kind] if scaling.get(k) is not None}}
    if kind in ("llama3", "yarn") and "original_max_position_embeddings" not in out:
        if not max_positions:
            raise ValueError(f"{kind} RoPE scaling without original_max_position_embeddings or max_position_embeddings")
        out["original_max_position_embeddings"] = int(max_positions)
    if kind == "yarn" and "factor" not in out:
        out["factor"] = (max_positions or out["original_max_position_embeddings"]) / out["original_max_position_embeddings"]
    if "factor" not in out:
        raise ValueError(f"{kind} RoPE scaling without a factor")
    return None if float(out["factor"]) == 1.0 else out


def rope_scaling_of(hf: dict[str, Any]) -> dict[str, Any] | None:
    """An HF config's RoPE scaling, normalised (`normalise_rope`); None for plain RoPE."""
    return normalise_rope(hf.get("rope_scaling") or hf.get("rope_parameters"), hf.get("max_position_embeddings"))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict[str, Any], mla: bool) -> float:
    """The factor YaRN multiplies cos and sin by, as both engines compute it, or ValueError where they differ.

    Llama layer (`YaRNScalingRotaryEmbedding`): mscale(f, mscale) / mscale(f, mscale_all_dim) when both are given
    (SGLang: not None, vLLM: non-zero), else 0.1 ln f + 1; SGLang then multiplies by `attn_factor`, vLLM takes an
    explicit `attention_factor` instead. MLA layer (both engines make any scaling `deepseek_yarn`):
    mscale(f, mscale) / mscale(f, mscale_all_dim) with defaults 1 and 0, where transformers' DeepSeek-V3 falls back
    to 0.1 ln f + 1 unless both are given: the value is handed to transformers as `attention_factor`."""
    f = float(scaling["factor"])
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attn, explicit = float(scaling.get("attn_factor", 1.0)), scaling.get("attention_factor")
    if float(scaling.get("extrapolation_factor", 1.0)) != 1.0:
        raise ValueError("YaRN extrapolation_factor != 1: SGLang applies it, vLLM does not")
    if mla:
        if explicit is not None:
            raise ValueError("YaRN attention_factor on an MLA head: vLLM then serves another rotation "
                             "(deepseek_llama_scaling), SGLang ignores it")
        base = _yarn_mscale(f, float(1.0 if m is None else m)) / _yarn_mscale(f, float(0.0 if m_all is None else m_all))
        sglang, vllm = base * attn, base
    else:
        both = _yarn_mscale(f, float(m or 0)) / _yarn_mscale(f, float(m_all or 0))
        sglang = (both if m is not None and m_all is not None else _yarn_mscale(f)) * attn
        vllm = float(explicit) if explicit is not None else (both if m and m_all else _yarn_mscale(f))
    if not math.isclose(sglang, vllm, rel_tol=1e-9):
        raise ValueError(f"YaRN {scaling}: SGLang scales cos/sin by {sglang:.6g}, vLLM by {vllm:.6g}; no head "
                         "trained on it serves alike in both")
    return sglang


def transformers_rope(scaling: dict[str, Any] | None, theta: float, mla: bool) -> dict[str, Any]:
    """transformers' `rope_parameters` that rotate exactly as the engines serve `scaling` (normalised): YaRN's
    cos/sin factor given explicitly (`yarn_attention_factor`), and for MLA the DeepSeek YaRN the engines run, which
    always truncates its correction range."""
    if not scaling:
        return {"rope_type": "default", "rope_theta": theta}
    out = {k: v for k, v in scaling.items() if k not in ("attn_factor", "extrapolation_factor")}
    out["rope_theta"] = theta
    if out["rope_type"] == "yarn":
        out["attention_factor"] = yarn_attention_factor(scaling, mla)
        if mla:
            out["truncate"] = True
    return out


CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")
"""Where SGLang (`get_context_length`) and vLLM (`_get_and_verify_max_len`) read a model's context length."""


def context_window(hf: dict[str, Any]) -> int | None:
    """The longest sequence both engines serve a model with this (text) config at: the shortest of its length keys,
    times the factor of a `linear` or `dynamic` scaling (both engines scale such a window; YaRN, llama3 and
    longrope configs give the scaled window itself, and SGLang also takes any scaling with
    `original_max_position_embeddings` as given). None when the config names no length."""
    lengths = [int(hf[k]) for k in CONTEXT_KEYS if isinstance(hf.get(k), int | float) and hf[k] > 0]
    if not lengths:
        return None
    window = min(lengths)
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind in ("linear", "dynamic") and "original_max_position_embeddings" not in scaling:
        window = int(window * float(scaling.get("factor") or 1.0))
    return window
