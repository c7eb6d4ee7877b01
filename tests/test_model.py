"""The EAGLE-3 head: engine parameter names and shapes, save/load, engine folders, decode, target head reading."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.config import Config
from eagle3.formats import load_draft, save_draft
from eagle3.model import Eagle3Draft, Eagle3DraftConfig
from eagle3.targets.weights import load_target_head

sys.path.append(str(Path(__file__).parent))  # tests/models.py (appended: never shadow installed packages)
from models import kimi_wrapped, tiny_llama, ttt_unroll  # noqa: E402

H, V, VD = 64, 300, 100


def small_config(**kw) -> Eagle3DraftConfig:
    base = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, aux_layer_ids=[1, 4, 6])
    return Eagle3DraftConfig(**{**base, **kw})


def vocab(v: int = V, vd: int = VD) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft vocab = every third target id (sorted by id, as prepare writes it)."""
    ids = torch.arange(vd) * 3
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(vd), t2d


def make_draft(seed: int = 0, **kw) -> Eagle3Draft:
    torch.manual_seed(seed)
    m = Eagle3Draft(small_config(**kw), embed_weight=torch.randn(V, H))
    m.set_vocab(*vocab())
    return m


EXPECTED_SHAPES = {
    "fc.weight": (H, 3 * H),
    "midlayer.self_attn.q_proj.weight": (4 * 16, 2 * H),
    "midlayer.self_attn.k_proj.weight": (2 * 16, 2 * H),
    "midlayer.self_attn.v_proj.weight": (2 * 16, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, 4 * 16),
    "midlayer.mlp.gate_proj.weight": (128, H),
    "midlayer.mlp.up_proj.weight": (128, H),
    "midlayer.mlp.down_proj.weight": (H, 128),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.post_attention_layernorm.weight": (H,),
    "norm.weight": (H,),
    "lm_head.weight": (VD, H),
    "d2t": (VD,),
    "t2d": (V,),
}


def test_head_names_shapes_and_saved_files(tmp_path):
    m = make_draft()
    assert {n for n, _ in m.named_parameters()} == set(EXPECTED_SHAPES) - {"d2t", "t2d"}
    assert not m.embed_tokens.weight.requires_grad
    save_draft(m, tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in saved.items()} == EXPECTED_SHAPES  # no embed_tokens, no rope cache
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["format"] == "eagle3-draft" and cfg["draft_vocab_size"] == VD and cfg["aux_layer_ids"] == [1, 4, 6]
    assert cfg["layer_id_convention"] == "input-of-layer"
    # target id = i + d2t[i]
    assert m.draft_to_target(torch.tensor([0, 1, 99])).tolist() == [0, 3, 297]


def test_save_load_round_trip_is_exact(tmp_path):
    m = make_draft()
    save_draft(m, tmp_path)
    back = load_draft(tmp_path, embed_weight=m.embed_tokens.weight)
    assert back.config == m.config
    for k, v in m.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    ids = torch.randint(0, V, (2, 7))
    hid = torch.randn(2, 7, H)
    pos = torch.arange(7).expand(2, 7)
    a = m.decode(ids, hid, pos, None)
    b = back.decode(ids, hid, pos, None)
    assert torch.equal(a[1], b[1])


def _engine_folder(src: Eagle3Draft, folder: Path, layers0: bool, config: dict) -> Path:
    folder.mkdir()
    sd = src.draft_state_dict()
    if layers0:
        sd = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    save_file(sd, str(folder / "model.safetensors"))
    c = src.config
    llama = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
             "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
             "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
             "draft_vocab_size": c.draft_vocab_size, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
             "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
             "target_hidden_size": c.target_hidden_size, **config}
    (folder / "config.json").write_text(json.dumps(llama))
    return folder


def test_load_vllm_layers0_folder(tmp_path):
    m = make_draft()
    d = _engine_folder(m, tmp_path / "vllm", layers0=True, config={"eagle_aux_hidden_state_layer_ids": [1, 4, 6]})
    back = load_draft(d, embed_weight=m.embed_tokens.weight)
    assert back.config.aux_layer_ids == [1, 4, 6]  # vLLM ids are eagle3 ids
    for k, v in m.draft_state_dict().items():
        assert torch.equal(v, back.draft_state_dict()[k]), k


def test_load_sglang_midlayer_folder_needs_engine(tmp_path):
    m = make_draft()
    d = _engine_folder(m, tmp_path / "sgl", layers0=False,
                       config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 5],
                                                "use_aux_hidden_state": True}})
    with pytest.raises(ValueError, match="which engine"):
        load_draft(d)
    back = load_draft(d, embed_weight=m.embed_tokens.weight, engine="sglang", family="llama")
    assert back.config.aux_layer_ids == [1, 4, 6]  # SGLang Llama ids are shifted by one
    assert torch.equal(back.lm_head.weight, m.lm_head.weight)
    assert torch.equal(back.midlayer.self_attn.q_proj.weight, m.midlayer.self_attn.q_proj.weight)


def test_decode_incremental_matches_full_and_ttt_step0():
    m = make_draft()
    ids = torch.randint(0, V, (2, 9))
    hid = torch.randn(2, 9, H)
    pos = torch.arange(9).expand(2, 9)
    full_h, full_logits, ((k, v),) = m.decode(ids, hid, pos, None)
    assert k.shape == (2, 2, 9, 16)
    h1, l1, kv = m.decode(ids[:, :5], hid[:, :5], pos[:, :5], None)
    h2, l2, kv2 = m.decode(ids[:, 5:], hid[:, 5:], pos[:, 5:], kv)
    torch.testing.assert_close(torch.cat([l1, l2], 1), full_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv2[0][0], k, atol=1e-6, rtol=1e-6)
    # An explicit mask equal to "past visible + causal" gives the same result.
    mask = torch.ones(2, 4, 9, dtype=torch.bool).tril(5)
    _, l2m, _ = m.decode(ids[:, 5:], hid[:, 5:], pos[:, 5:], kv, attn_mask=mask)
    torch.testing.assert_close(l2m, l2, atol=1e-6, rtol=1e-6)
    # TTT step 0 on shifted tokens is decode over tokens x_{t+1}.
    aux = torch.randn(2, 9, 3 * H)
    ttt = ttt_unroll(m, m.project(aux), ids, 1)[0]
    shifted = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    _, dec, _ = m.decode(shifted, m.project(aux), pos, None)
    torch.testing.assert_close(ttt, dec, atol=1e-5, rtol=1e-5)


def test_missing_embeddings_error_is_clear():
    m = Eagle3Draft(small_config())
    with pytest.raises(RuntimeError, match="no token embeddings"):
        m.decode(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, H), torch.zeros(1, 2, dtype=torch.long), None)


def test_from_target_llama_and_kimi_dims():
    cfg = Config()
    cfg.target.aux_layer_ids = None
    smol = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
            "vocab_size": 49152, "num_hidden_layers": 30, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "max_position_embeddings": 8192}
    c = Eagle3DraftConfig.from_target(cfg.draft, cfg.target, smol, 8192)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (
        576, 9, 3, 64, 1536)
    assert c.rope_theta == 100000.0 and c.aux_layer_ids == [2, 15, 27] and c.draft_vocab_size == 8192
    kimi_text = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
                 "num_attention_heads": 64, "num_key_value_heads": 64, "qk_rope_head_dim": 64, "v_head_dim": 128,
                 "head_dim": 64, "intermediate_size": 18432, "vocab_size": 163840, "num_hidden_layers": 61,
                 "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 64.0}}
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": kimi_text}
    c = Eagle3DraftConfig.from_target(cfg.draft, cfg.target, kimi, 32000)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (
        7168, 64, 64, 128, 18432)
    assert c.rope_scaling is None and c.aux_layer_ids == [2, 30, 58] and c.vocab_size == 163840
    cfg.draft.num_attention_heads, cfg.draft.head_dim = 32, 64
    c = Eagle3DraftConfig.from_target(cfg.draft, cfg.target, kimi, 32000)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 32, 64)


def test_load_target_head_untied_llama(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tiny_llama(tmp_path / "t", vocab=256, hidden=64, layers=4)
    embed, lm_head, hf = load_target_head(str(folder))
    ref = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.equal(embed, ref.model.embed_tokens.weight) and torch.equal(lm_head, ref.lm_head.weight)
    assert not torch.equal(embed, lm_head) and hf["hidden_size"] == 64


def test_load_target_head_tied_and_sharded(tmp_path):
    folder = tiny_llama(tmp_path / "t", vocab=256, hidden=64, layers=4, tie=True)
    embed, lm_head, _ = load_target_head(str(folder))
    assert lm_head is embed
    # Split into two shards with an index, as large checkpoints ship.
    sd = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(sd)
    half = {n: ("model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors")
            for i, n in enumerate(names)}
    for shard in set(half.values()):
        save_file({n: sd[n] for n in names if half[n] == shard}, str(folder / shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": half}))
    e2, l2, _ = load_target_head(str(folder))
    assert torch.equal(e2, embed) and torch.equal(l2, embed)


def test_load_target_head_kimi_wrapper(tmp_path):
    folder = kimi_wrapped(tmp_path / "kimi")
    embed, lm_head, hf = load_target_head(str(folder))
    sd = load_file(str(folder / "model.safetensors"))
    assert torch.equal(embed, sd["language_model.model.embed_tokens.weight"])
    assert torch.equal(lm_head, sd["language_model.lm_head.weight"])
    cfg = Config()
    cfg.target.aux_layer_ids = None
    c = Eagle3DraftConfig.from_target(cfg.draft, cfg.target, hf, 64)
    assert c.num_key_value_heads == c.num_attention_heads == 4 and c.head_dim == 16  # v_head_dim of the tiny MLA
    assert c.target["architectures"] == ["KimiK25ForConditionalGeneration"]
