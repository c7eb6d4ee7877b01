"""The tiny targets of tests/test_sglang_real.py, in the shapes scripts/gpu_check_sglang.sh builds them
(`EAGLE3_SGLANG_DEVICE=cuda`), are configs SGLang 0.5.23 serves on CUDA GPUs at TP 1, 2 and 8: checked here, without
a GPU or SGLang, against the rules read in SGLang's source (and in the CUDA kernels it calls), each rule naming where.

    pytest -q tests/test_sglang_gpu_fixtures.py

The CPU fixtures (4 attention heads, MLA kv_lora 16 + rope 8) break three of them at TP 8: the last test shows the
rules catch what made the GPU suite unable to pass on 8 GPUs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).parent))  # tests/ helpers (appended: never shadow installed packages)
from sglang_cpu.tiny_models import target_config  # noqa: E402

SG = "sglang/srt"  # SGLang 0.5.23's source, as installed (site-packages/sglang/srt)
FA3 = "flash-attention hopper/flash_api.cpp (sgl-kernel's FA3)"


def _mla_problems(t: dict, tp: int) -> list[str]:
    """DeepSeek-V3 / Kimi-K2.5 text model: MLA attention, dense first layer, MoE."""
    out = []
    heads, nope, rope = t["num_attention_heads"], t["qk_nope_head_dim"], t["qk_rope_head_dim"]
    if heads % tp:
        out.append(f"{heads} MLA heads do not split over TP {tp} ({SG}/models/deepseek_v2.py:2057)")
    # On Hopper SGLang picks fa3 for MLA (sglang/srt/arg_groups/model_override_base.py:336-338); its absorbed MLA decode
    # and verify pass q_rope as q and the latent as V with q_nope in `qv` (layers/attention/flashattention_backend.py
    # :2016), which FA3 takes for head_size <= 64 and hdim_v >= 256 only, built for (64, 512); FlashMLA (576 = 512 +
    # 64, V 512; flashmla_backend.py:96 sizes its cache kv_lora + rope), FlashInfer's and TRT-LLM's MLA the same.
    if (t["kv_lora_rank"], rope) != (512, 64):
        out.append(f"MLA latent kv_lora_rank {t['kv_lora_rank']} + rope {rope}: the CUDA MLA kernels take 512 + 64 "
                   f"({FA3} q_v checks; FlashMLA head_size_k == 576, head_size_v == 512)")
    # The MHA prefill (fa3 handler, models/deepseek_common/attention_backend_handler.py:108-150) runs Q/K head
    # nope + rope against V head v_head_dim: FA3 takes a V head unlike Q/K's only for Q/K in (128, 192] and V in
    # (96, 128] (or Q/K <= 64 with V <= 512).
    qk, v = nope + rope, t["v_head_dim"]
    if qk != v and not (128 < qk <= 192 and 96 < v <= 128) and not (qk <= 64 and v <= 512):
        out.append(f"MLA prefill head {qk} (nope {nope} + rope {rope}) against V {v}: {FA3} takes Q/K (128, 192] "
                   "with V (96, 128]")
    if t["intermediate_size"] % tp:
        out.append(f"dense MLP width {t['intermediate_size']} does not split over TP {tp} ({SG}/layers/linear.py:693)")
    if t["moe_intermediate_size"] % tp:
        out.append(f"expert width {t['moe_intermediate_size']} does not split over TP {tp} "
                   f"({SG}/layers/moe/fused_moe_triton/layer.py:427)")
    return out


def _llama_problems(c: dict, tp: int) -> list[str]:
    out = []
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    if heads % tp:
        out.append(f"{heads} attention heads do not split over TP {tp} ({SG}/models/llama.py:183)")
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        out.append(f"{kv} KV heads neither split over TP {tp} nor replicate evenly ({SG}/models/llama.py:189,193)")
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    # fa3 for MHA on Hopper (sglang/srt/arg_groups/model_override_base.py:303-311): FA3 takes head dims that are a
    # multiple of 8 up to 256 (the GPU fixture has 64, a size every CUDA backend ships).
    if head_dim % 8 or head_dim > 256:
        out.append(f"head dim {head_dim}: {FA3} takes multiples of 8 up to 256")
    if c["intermediate_size"] % tp:
        out.append(f"MLP width {c['intermediate_size']} does not split over TP {tp} ({SG}/layers/linear.py:693)")
    return out


def _moonvit_problems(v: dict, text_hidden: int, tp: int) -> list[str]:
    """Kimi-K2.5's vision tower: SGLang builds it with the model (never runs it for text) and shards its heads."""
    out = []
    if v["num_attention_heads"] % tp:
        out.append(f"{v['num_attention_heads']} vision heads do not split over TP {tp} "
                   f"({SG}/layers/attention/vision.py:1132)")
    if (v["hidden_size"] // v["num_attention_heads"]) % 4:
        out.append(f"vision head dim {v['hidden_size'] // v['num_attention_heads']} not a multiple of 4 "
                   f"({SG}/models/kimi_k25.py:303, its 2-D rope)")
    if v["text_hidden_size"] != text_hidden:
        out.append(f"vision projector ends at {v['text_hidden_size']}, the text model is {text_hidden} wide")
    return out


def sglang_cuda_problems(config: dict, tp: int) -> list[str]:
    """Why SGLang 0.5.23 on CUDA GPUs would refuse (or fail on) this config.json at TP `tp`; empty when it serves it."""
    text = config.get("text_config") or config
    out = _llama_problems(text, tp) if text.get("model_type") == "llama" else _mla_problems(text, tp)
    # SGLang pads a vocab that does not split (layers/vocab_parallel_embedding.py:272-274); the fixtures keep it even.
    if text["vocab_size"] % tp:
        out.append(f"vocab {text['vocab_size']} does not split over TP {tp}")
    if "vision_config" in config:
        out += _moonvit_problems(config["vision_config"], text["hidden_size"], tp)
    return out


FAMILIES = ["llama", "deepseek", "kimi"]


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_gpu_fixture_is_a_config_sglang_serves_on_cuda(family, tp):
    config = target_config(family, "cuda")
    assert sglang_cuda_problems(config, tp) == []
    text = config.get("text_config") or config
    if family != "llama":  # Kimi-K2.5's own MLA dims, whatever the width
        assert {k: text[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")} == {
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_build_target_writes_the_shape_that_is_checked(family, tmp_path):
    """What the GPU suite's build_target writes is `target_config` (the checked dict), field for field, but the
    bookkeeping save_pretrained adds. Kimi's wrapper is deepseek's text config through the same kimi_sglang_wrapper
    (its 163840-row vocab makes a 455 MB folder: left to the GPU run)."""
    from test_sglang_real import build_target

    written = json.loads((build_target(family, tmp_path / "t", device="cuda") / "config.json").read_text())
    expected = target_config(family, "cuda")
    bookkeeping = {"_name_or_path", "architectures", "dtype", "transformers_version", "torch_dtype"}
    differ = {k for k in written.keys() | expected.keys() if written.get(k) != expected.get(k)} - bookkeeping
    assert {k for k in differ if k in expected and k in written} == set(), differ
    assert sglang_cuda_problems(written, 8) == []


def test_the_cpu_fixtures_are_what_broke_tp8():
    """The rules catch issue 60's finding: the CPU shapes (kept for the CPU suite) do not serve on 8 GPUs."""
    assert sglang_cuda_problems(target_config("llama", "cpu"), 8)[0].startswith("4 attention heads do not split")
    ds = " | ".join(sglang_cuda_problems(target_config("deepseek", "cpu"), 8))
    assert "4 MLA heads do not split over TP 8" in ds and "kv_lora_rank 16 + rope 8" in ds
    kimi = " | ".join(sglang_cuda_problems(target_config("kimi", "cpu"), 8))
    assert "2 vision heads do not split over TP 8" in kimi
    for family in FAMILIES:  # at TP 1 only the MLA latent stands in the way
        assert all("MLA latent" in p for p in sglang_cuda_problems(target_config(family, "cpu"), 1)), family
