"""Tiny random checkpoints that the real SGLang 0.5.23 loads on CPU, written as HF folders.

Builds on tests/models.py (`tiny_llama`, `tiny_deepseek_v3`) and adds what SGLang needs that transformers
does not write (facts from ../../shared/SGLANG-CPU.md item 2):
- DeepseekV3 on SGLang's CPU path requires a rope_scaling (`get_rope_cpu` in
  srt/layers/rotary_embedding/factory.py asserts it): yarn with factor 1.0 (and mscale 1 / mscale_all_dim 1)
  computes exactly plain rope, so HF and SGLang agree;
- SGLang reads moe_layer_freq, topk_method, scoring_func, num_nextn_predict_layers from config.json.

`tiny_eagle3_draft` writes a random EAGLE-3 draft head in the layout SGLang's `LlamaForCausalLMEagle3`
(srt/models/llama_eagle3.py) loads: fc over 3 concatenated target states, one `midlayer`, a draft-vocab lm_head,
and d2t / t2d vocab maps (identity on the first draft_vocab target ids).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

from models import tiny_deepseek_v3, tiny_llama  # noqa: E402  (tests/models.py)

__all__ = ["sglang_tiny_llama", "sglang_tiny_deepseek_v3", "sglang_deepseek_fields", "tiny_eagle3_draft",
           "DEEPSEEK_SGLANG_FIELDS"]

DEEPSEEK_SGLANG_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                          "num_nextn_predict_layers": 0}


def sglang_tiny_llama(path: str | Path, **kw) -> Path:
    """tests/models.py `tiny_llama` as is (SGLang loads a plain HF Llama folder)."""
    path = Path(path)
    if not (path / "config.json").exists():
        tiny_llama(path, **kw)
    return path


def sglang_deepseek_fields(cfg: dict) -> dict:
    """A DeepseekV3 config.json dict with what SGLang's CPU path needs added (yarn rope, factor 1.0 = plain rope,
    and the four fields above); also used for the `text_config` of a Kimi-K2.5-shaped wrapper."""
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    yarn = {"type": "yarn", "rope_type": "yarn", "factor": 1.0,
            "original_max_position_embeddings": cfg["max_position_embeddings"],
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    # transformers 5 reads rope_parameters, SGLang rope_scaling
    return {**cfg, "rope_scaling": dict(yarn), "rope_parameters": dict(yarn, rope_theta=theta), "rope_theta": theta,
            **DEEPSEEK_SGLANG_FIELDS}


def sglang_tiny_deepseek_v3(path: str | Path, **kw) -> Path:
    """tests/models.py `tiny_deepseek_v3`, with the config fields SGLang needs written into config.json."""
    path = Path(path)
    if (path / "config.json").exists() and json.loads((path / "config.json").read_text()).get("topk_method"):
        return path
    tiny_deepseek_v3(path, **kw)
    conf = path / "config.json"
    conf.write_text(json.dumps(sglang_deepseek_fields(json.loads(conf.read_text())), indent=2))
    return path


def tiny_eagle3_draft(path: str | Path, target: str | Path, aux_layer_ids=(1, 2, 3), draft_vocab: int = 64,
                      intermediate: int = 128, seed: int = 0) -> Path:
    """A random EAGLE-3 draft head for `target` (a tiny HF folder), in SGLang's LlamaForCausalLMEagle3 layout.

    aux_layer_ids are in SGLang's spelling (`eagle_aux_hidden_state_layer_ids`). The draft has the target's
    hidden size, head layout, vocab and rope; it borrows the target's embeddings (no embed_tokens weight)."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    if (path / "model.safetensors").exists():
        return path
    t = json.loads((Path(target) / "config.json").read_text())
    h, vocab = t["hidden_size"], t["vocab_size"]
    heads = t["num_attention_heads"]
    kv_heads = heads if t.get("model_type") == "deepseek_v3" else t.get("num_key_value_heads", heads)
    head_dim = h // heads
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.1):
        return (torch.randn(*shape, generator=g) * std).float()

    def norm(n):
        return (torch.rand(n, generator=g) + 0.5).float()

    weights = {
        "fc.weight": w(h, 3 * h),
        "midlayer.hidden_norm.weight": norm(h),
        "midlayer.input_layernorm.weight": norm(h),
        "midlayer.post_attention_layernorm.weight": norm(h),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(intermediate, h),
        "midlayer.mlp.up_proj.weight": w(intermediate, h),
        "midlayer.mlp.down_proj.weight": w(h, intermediate),
        "norm.weight": norm(h),
        "lm_head.weight": w(draft_vocab, h, std=1.0),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        "t2d": torch.arange(vocab) < draft_vocab,
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": h, "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": t["max_position_embeddings"],
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": h,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "bos_token_id": t.get("bos_token_id"), "eos_token_id": t.get("eos_token_id"),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
