"""Run by an engine's own Python (SGLang 0.5.23 or vLLM 0.32, see tests/test_engine_rope.py): the rotary embedding
each engine builds from an exported draft config.json, applied to the test's queries and keys.

    <engine python> tests/engine_rope_check.py sglang|vllm CASES.json TENSORS.safetensors OUT.safetensors

For each case the config goes through the engine's transformers config class (as the engine loads a draft), then
the rope is built with the arguments the engine's model code passes (SGLang `llama.py` / `deepseek_v2.py` behind
`llama_eagle3.py` / `kimi_k25_eagle3.py`; vLLM `llama.py` / `deepseek_v2.py` behind `llama_eagle3.py` /
`deepseek_eagle3.py`), and `forward_native` rotates `q.<name>` / `k.<name>` at positions 0..T-1: what the CPU
servers run. For MLA the softmax scale is written too. Imports neither eagle3 nor anything outside the engine.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file, save_file


def _config(case: dict):
    from transformers import DeepseekV3Config, LlamaConfig

    raw = dict(case["config"].get("transformer_layer_config") or case["config"])
    raw.pop("architectures", None)
    raw.pop("model_type", None)
    return (DeepseekV3Config if case["arch"] == "mla" else LlamaConfig).from_dict(raw)


def _sglang(case: dict, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    from sglang.srt.layers.rotary_embedding.factory import get_rope, get_rope_wrapper

    c = _config(case)
    params = dict(c.rope_parameters)
    theta = params.get("rope_theta", 10000)
    positions = torch.arange(q.shape[0])
    if case["arch"] == "llama":  # llama.py LlamaModel / LlamaAttention
        rope = get_rope(c.head_dim, rotary_dim=c.head_dim, max_position=c.max_position_embeddings, base=theta,
                        rope_scaling=params, is_neox_style=True)
        qr, kr = rope.forward_native(positions, q.flatten(1), k.flatten(1))
        return qr.view_as(q), kr.view_as(k), float("nan")
    from sglang.srt.configs.model_config import compute_mla_mscale_scaling

    # kimi_k25_eagle3.py Eagle3MLADecoderLayer, then deepseek_v2.py DeepseekV2AttentionMLA
    scaling = params if params.get("rope_type") != "default" else None
    if scaling:
        scaling["rope_type"] = "deepseek_yarn"
    rope = get_rope_wrapper(c.qk_rope_head_dim, rotary_dim=c.qk_rope_head_dim, max_position=c.max_position_embeddings,
                            base=theta, rope_scaling=scaling, is_neox_style=not getattr(c, "rope_interleave", True),
                            device="cpu")
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    if scaling and scaling.get("apply_yarn_scaling", True):
        scale = compute_mla_mscale_scaling(scaling, scale)
    qr, kr = rope.forward_native(positions, q, k)
    return qr, kr, float(scale)


def _vllm(case: dict, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    c = _config(case)
    positions = torch.arange(q.shape[0])
    if case["arch"] == "llama":  # llama.py LlamaAttention
        rope = get_rope(c.head_dim, max_position=c.max_position_embeddings, rope_parameters=c.rope_parameters,
                        is_neox_style=True)
        qr, kr = rope.forward_native(positions, q.flatten(1).clone(), k.flatten(1).clone())
        return qr.view_as(q), kr.view_as(k), float("nan")
    from vllm.model_executor.models.deepseek_v2 import yarn_get_mscale

    params = c.rope_parameters  # deepseek_v2.py DeepseekV2MLAAttention
    if params["rope_type"] != "default":
        params["rope_type"] = "deepseek_llama_scaling" if params.get("attention_factor") == 1.0 else "deepseek_yarn"
    rope = get_rope(c.qk_rope_head_dim, max_position=c.max_position_embeddings, rope_parameters=params,
                    is_neox_style=False)
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    if params["rope_type"] == "deepseek_yarn":
        scale *= yarn_get_mscale(params["factor"], float(params.get("mscale_all_dim", False))) ** 2
    qr, kr = rope.forward_native(positions, q, k)  # q_pe [T, heads, rope], k_pe [T, 1, rope]
    return qr, kr, float(scale)


def main() -> None:
    engine, cases_file, tensors_file, out_file = sys.argv[1:5]
    cases = json.loads(open(cases_file).read())
    tensors = load_file(tensors_file)
    out: dict[str, torch.Tensor] = {}
    run = _sglang if engine == "sglang" else _vllm
    if engine == "vllm":  # vLLM's custom ops read the current config when built; a default one, as its tests use
        from vllm.config import VllmConfig, set_current_vllm_config

        context = set_current_vllm_config(VllmConfig())
        context.__enter__()
    for case in cases:
        name = case["name"]
        qr, kr, scale = run(case, tensors[f"q.{name}"].clone(), tensors[f"k.{name}"].clone())
        out[f"q.{name}"], out[f"k.{name}"] = qr.contiguous(), kr.contiguous()
        out[f"scale.{name}"] = torch.tensor([scale], dtype=torch.float64)
    save_file(out, out_file)


if __name__ == "__main__":
    main()
