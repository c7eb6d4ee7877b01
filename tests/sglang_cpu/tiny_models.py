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

from models import deepseek_v3_config, llama_config, tiny_deepseek_v3, tiny_llama  # noqa: E402  (tests/models.py)

__all__ = ["sglang_tiny_llama", "sglang_tiny_deepseek_v3", "sglang_deepseek_fields", "tiny_eagle3_draft",
           "DEEPSEEK_SGLANG_FIELDS", "target_shape", "target_config", "kimi_sglang_wrapper"]

DEEPSEEK_SGLANG_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                          "num_nextn_predict_layers": 0}


# ------------------------------------------------------------------ the (family, device) shapes of the real suite
_MOONVIT_CPU = {"patch_size": 2, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 2,
                "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                "text_hidden_size": None, "vt_hidden_size": 16, "mm_hidden_size": 16}
"""Kimi-K2.5's MoonViT tower in miniature: SGLang builds it (random, never run: extraction is text only). Its
projector's `text_hidden_size` is the text model's (`kimi_sglang_wrapper` fills it in)."""
_MLA_GPU = {"hidden": 256, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 128,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "intermediate_size": 1024, "moe_intermediate_size": 512, "n_routed_experts": 8}
"""DeepseekV3 / Kimi-K2.5 on GPUs: Kimi's own MLA dims (kv_lora 512 + rope 64, the only latent the CUDA MLA kernels
take; nope 128 + rope 64 = 192 and v 128, FA3's one Q/K != V prefill shape), 8 heads (one per rank at TP 8), and
widths that split 8 ways (dense MLP 128 a rank, each expert 64 a rank); hidden 256 keeps it small (a multiple of 256
like Kimi's 7168, so the same fused q/kv-a GEMM runs). tests/test_sglang_gpu_fixtures.py checks it at TP 1/2/8."""
_SHAPES = {
    ("llama", "cpu"): {"model": {"vocab": 512, "hidden": 64, "layers": 8}},
    ("deepseek", "cpu"): {"model": {"vocab": 512, "layers": 6}},
    ("kimi", "cpu"): {"model": {"vocab": 163840, "layers": 6}, "vision": _MOONVIT_CPU},
    # GQA kept: 2 KV heads are replicated at TP 8 (SGLang requires tp % kv_heads == 0 there); head dim 64.
    ("llama", "cuda"): {"model": {"vocab": 512, "hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2,
                                  "intermediate": 1024}},
    ("deepseek", "cuda"): {"model": {"vocab": 512, "layers": 6, **_MLA_GPU}},
    ("kimi", "cuda"): {"model": {"vocab": 163840, "layers": 6, **_MLA_GPU},
                       "vision": {**_MOONVIT_CPU, "num_attention_heads": 8, "hidden_size": 64, "intermediate_size": 128,
                                  "vt_hidden_size": 64, "mm_hidden_size": 64}},
}


def target_shape(family: str, device: str) -> dict:
    """The tiny target of `family` that tests/test_sglang_real.py builds for SGLang on `device` (`cpu`: the CPU
    stand-ins, small and fast; `cuda`: SGLang's own kernels at TP 1/2/8): `model`, the keyword arguments of
    tests/models.py's builder (`tiny_llama`, `tiny_deepseek_v3`, `kimi_wrapped`), and for Kimi `vision`, the
    MoonViT fields of its wrapper. The CPU shapes are the suite's as they always were."""
    shape = _SHAPES[(family, "cpu" if device == "cpu" else "cuda")]
    return {k: dict(v) for k, v in shape.items()}


def kimi_sglang_wrapper(wrapper: dict, vision: dict) -> dict:
    """A Kimi-K2.5 wrapper config.json (tests/models.py `kimi_wrapped`) as SGLang loads it: the DeepSeek fields in
    its text_config, the miniature vision tower (its projector ends at the text model's width), text only."""
    text = sglang_deepseek_fields(wrapper["text_config"])
    # The real checkpoint brings its image processor as remote code, which SGLang loads for a multimodal model
    # even without a tokenizer; the tiny one has none, so it declares itself text-only. SGLang still builds the
    # KimiK25ForConditionalGeneration wrapper, which embeds the tokens and calls its LLM with input_ids=None.
    return {**wrapper, "text_config": text,
            "vision_config": {**wrapper["vision_config"], **vision, "text_hidden_size": text["hidden_size"]},
            "language_model_only": True}


def target_config(family: str, device: str) -> dict:
    """The config.json SGLang reads for `family`'s target on `device`, without building its weights (what
    build_target writes, up to the fields save_pretrained adds: tests/test_sglang_gpu_fixtures.py checks both)."""
    shape = target_shape(family, device)
    kw = shape["model"]
    if family == "llama":
        return llama_config(**kw).to_dict()
    text = deepseek_v3_config(kw.pop("vocab"), kw.pop("hidden", 64), kw.pop("layers"), **kw).to_dict()
    if family == "deepseek":
        return sglang_deepseek_fields(text)
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text, "vision_config": {"model_type": "moonvit"}}
    return kimi_sglang_wrapper(wrapper, shape["vision"])


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
