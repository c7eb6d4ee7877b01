"""The MLA draft layer and the EAGLE-3.1 options (`fc_norm`, `norm_output`): names the engines load, MLA math equal to
transformers' DeepSeek-V3 attention, the training-time test equal to engine-style chain drafting for every
combination, exports and the published formats read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import assert_fast_equals_dense, ttt_unroll
from safetensors.torch import load_file, save_file

from eagle3.config import Config
from eagle3.export import export
from eagle3.formats import DraftFormatError, load_draft, read_draft, save_draft
from eagle3.model import Eagle3Draft, Eagle3DraftConfig

H, V, VD = 32, 120, 40
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
VARIANTS = [(arch, fc_norm, norm_output) for arch in ("llama", "mla") for fc_norm in (False, True)
            for norm_output in (False, True)]


def config(arch: str = "mla", fc_norm: bool = False, norm_output: bool = False, vocab: int = VD,
           **kw) -> Eagle3DraftConfig:
    extra = {**MLA, "head_dim": MLA["v_head_dim"], "rope_scaling": YARN} if arch == "mla" else {}
    base = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=4 if arch == "mla" else 2, head_dim=8,
                intermediate_size=48, vocab_size=V, draft_vocab_size=vocab, target_hidden_size=H,
                max_position_embeddings=256, aux_layer_ids=[2, 4, 6], arch=arch, fc_norm=fc_norm,
                norm_output=norm_output, rms_norm_eps=1e-6,
                target={"path": "/t", "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                        "num_layers": 9})
    return Eagle3DraftConfig(**{**base, **extra, **kw})


def make(arch: str = "mla", fc_norm: bool = False, norm_output: bool = False, seed: int = 0,
         vocab: int = VD, num_layers: int = 1) -> Eagle3Draft:
    torch.manual_seed(seed)
    m = Eagle3Draft(config(arch, fc_norm, norm_output, vocab, num_layers=num_layers), embed_weight=torch.randn(V, H))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)  # norms too: a swapped or skipped norm must show
    ids = torch.sort(torch.randperm(V)[:vocab]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    m.set_vocab(ids - torch.arange(vocab), t2d)
    return m


def test_mla_head_has_exactly_the_engines_weight_names():
    """The names and shapes SGLang's kimi_k25_eagle3.py and vLLM's deepseek_eagle3.py load (2H attention input)."""
    m = make("mla", fc_norm=True)
    n, r, v, heads = MLA["qk_nope_head_dim"], MLA["qk_rope_head_dim"], MLA["v_head_dim"], 4
    want = {
        "fc_norm.0.weight": (H,), "fc_norm.1.weight": (H,), "fc_norm.2.weight": (H,), "fc.weight": (H, 3 * H),
        "midlayer.self_attn.q_a_proj.weight": (24, 2 * H), "midlayer.self_attn.q_a_layernorm.weight": (24,),
        "midlayer.self_attn.q_b_proj.weight": (heads * (n + r), 24),
        "midlayer.self_attn.kv_a_proj_with_mqa.weight": (16 + r, 2 * H),
        "midlayer.self_attn.kv_a_layernorm.weight": (16,),
        "midlayer.self_attn.kv_b_proj.weight": (heads * (n + v), 16),
        "midlayer.self_attn.o_proj.weight": (H, heads * v),
        "midlayer.mlp.gate_proj.weight": (48, H), "midlayer.mlp.up_proj.weight": (48, H),
        "midlayer.mlp.down_proj.weight": (H, 48), "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,), "midlayer.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,), "lm_head.weight": (VD, H), "d2t": (VD,), "t2d": (V,),
    }
    assert {k: tuple(t.shape) for k, t in m.draft_state_dict().items()} == want


def test_mla_attention_equals_transformers_deepseek_v3():
    """q/k/v, interleaved RoPE on the shared rope key, YaRN's softmax scale: the same numbers as transformers'
    DeepseekV3Attention (what the engines implement) run over the draft's 2H attention input."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    m = make("mla")
    attn = m.midlayer.self_attn
    hf_cfg = DeepseekV3Config(hidden_size=2 * H, num_attention_heads=4, num_key_value_heads=4, **MLA,
                              rope_parameters={**YARN, "rope_theta": 10000.0}, max_position_embeddings=256,
                              attention_bias=False, rms_norm_eps=1e-6)
    hf_cfg._attn_implementation = "eager"
    ref = DeepseekV3Attention(hf_cfg, 0)
    ref.load_state_dict({k: v for k, v in attn.state_dict().items() if k != "o_proj.weight"}, strict=False)
    ref.o_proj = torch.nn.Identity()
    assert attn.scale != attn.head_dim**-0.5  # YaRN's mscale is in play
    x = torch.randn(2, 9, 2 * H)
    pos = torch.arange(3, 12).expand(2, 9)
    q, k, vv = attn.qkv(x, pos)
    ours = torch.nn.functional.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=attn.scale)
    ours = ours[..., : MLA["v_head_dim"]].transpose(1, 2).reshape(2, 9, -1)
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    theirs, _ = ref(x, DeepseekV3RotaryEmbedding(hf_cfg)(x, pos), causal)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def _chain_logits(m: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, t: int, steps: int,
                  pos: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Engine-style chain drafting from position t: step 0 over the target's features (tokens shifted by one),
    then each step feeds the previous step's handed-off hidden and the next token back through `decode`, its KV
    the step-0 prefix 0..t plus this position's earlier steps. `pos` [n]: the prompt's positions (default the
    index); the j-th draft token sits j past position t's, as vLLM advances a draft's positions."""
    n = ids.shape[1]
    pos = torch.arange(n) if pos is None else pos
    shifted = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    hid, logits, cache = m.decode(shifted, m.project(aux), pos[None], None)
    out = [logits[0, t]]
    kv = tuple((k[:, :, : t + 1], v[:, :, : t + 1]) for k, v in cache)
    h = hid[:, t : t + 1]
    for j in range(1, steps):
        tok = ids[:, t + 1 + j : t + 2 + j] if t + 1 + j < n else torch.zeros(1, 1, dtype=torch.long)
        h, lg, kv = m.decode(tok, h, (pos[t] + j).view(1, 1), kv)
        out.append(lg[0, 0])
    return out


@pytest.mark.parametrize("arch,fc_norm,norm_output", VARIANTS)
def test_ttt_equals_chain_drafting_and_dense(arch, fc_norm, norm_output):
    """Each TTT step at each position = what the engine's chain drafting computes there (which hidden is handed
    on, where fc_norm sits, the MLA attention); the fast attention = the dense reference, gradients included."""
    _assert_ttt_equals_chain_and_dense(make(arch, fc_norm, norm_output))


def _assert_ttt_equals_chain_and_dense(m: Eagle3Draft) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The check of the test above on head `m`: (aux, ids, the fast TTT logits of every step)."""
    torch.manual_seed(1)
    aux, ids = torch.randn(1, 11, 3 * H), torch.randint(0, V, (1, 11))
    fast = assert_fast_equals_dense(m, aux, ids, 4)
    with torch.no_grad():
        for t in (0, 3, 6):
            for j, lg in enumerate(_chain_logits(m, aux, ids, t, 4)):
                torch.testing.assert_close(fast[j][0, t], lg, atol=2e-5, rtol=2e-5)
    return aux, ids, fast


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_ttt_at_given_positions_equals_chain_drafting_there(arch):
    """Positions off the token index (an M-RoPE target's temporal row after a picture: one position for the whole
    picture, then the text resumes further on; vLLM drafts there): each TTT step at each position = chain drafting
    at those positions, fast = dense with gradients; at the index instead, the later tokens' logits differ."""
    m = make(arch)
    torch.manual_seed(5)
    aux, ids = torch.randn(1, 11, 3 * H), torch.randint(0, V, (1, 11))
    pos = torch.tensor([0, 1, 2, 2, 2, 2, 5, 6, 7, 8, 9])
    fast = assert_fast_equals_dense(m, aux, ids, 3, pos[None])
    with torch.no_grad():
        for t in (1, 4, 7):
            for j, lg in enumerate(_chain_logits(m, aux, ids, t, 3, pos)):
                torch.testing.assert_close(fast[j][0, t], lg, atol=2e-5, rtol=2e-5)
        index = ttt_unroll(m, m.project(aux), ids, 3)
    assert torch.allclose(index[0][0, :3], fast[0][0, :3], atol=1e-5)  # before the picture: the same positions
    assert not torch.allclose(index[0][0, 7], fast[0][0, 7], atol=1e-3)


def test_norm_output_and_fc_norm_change_the_computation():
    """Negative control for the test above: each option, flipped, changes what later steps compute."""
    torch.manual_seed(2)
    aux, ids = torch.randn(1, 9, 3 * H), torch.randint(0, V, (1, 9))
    base = make("mla", False, False)
    for flip in ({"norm_output": True}, {"fc_norm": True}):
        other = make("mla", **{"fc_norm": False, "norm_output": False, **flip})
        other.load_state_dict(base.state_dict(), strict=False)
        if flip.get("fc_norm"):
            with torch.no_grad():
                for norm in other.fc_norm:
                    norm.weight.uniform_(0.5, 1.5)
        a, b = ttt_unroll(base, base.project(aux), ids, 3), ttt_unroll(other, other.project(aux), ids, 3)
        differs = [not torch.allclose(x, y, atol=1e-4) for x, y in zip(a, b, strict=True)]
        assert differs == ([False, True, True] if "norm_output" in flip else [True, True, True]), flip


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm written out (float32 statistics, as the engines' and transformers' kernels compute it)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_fc_norm_normalises_each_aux_state_with_its_own_weights(arch):
    """EAGLE-3.1 fc_norm: fc(cat(rmsnorm(low) * w0, rmsnorm(mid) * w1, rmsnorm(high) * w2)), written out here. The
    three weights are random and distinct (make()), so a weight applied to another third, one norm over the
    concatenation or a skipped norm all give other numbers."""
    m = make(arch, fc_norm=True)
    torch.manual_seed(3)
    aux = torch.randn(2, 7, 3 * H) * torch.tensor([0.1, 1.0, 10.0]).repeat_interleave(H)  # three magnitudes
    eps = m.config.rms_norm_eps
    weights = [m.fc_norm[i].weight.detach() for i in range(3)]
    assert all(not torch.allclose(weights[i], weights[j]) for i, j in ((0, 1), (0, 2), (1, 2)))
    by_hand = torch.cat([_rms_norm(x, w, eps) for x, w in zip(aux.split(H, dim=-1), weights, strict=True)], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(m.project(aux), by_hand @ m.fc.weight.T, atol=1e-5, rtol=1e-5)
        swapped = torch.cat([_rms_norm(x, w, eps) for x, w in zip(aux.split(H, dim=-1), weights[::-1], strict=True)],
                            dim=-1)
        assert not torch.allclose(m.project(aux), swapped @ m.fc.weight.T, atol=1e-3)  # the check can tell


def _step0_output(m: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The layer's pre-`norm` output at step 0 (target features, tokens shifted by one), through causal SDPA: no
    TTT kernel, no `decode`, no hand-off."""
    feature = m.project(aux)
    q, k, v = m.attention_inputs(torch.nn.functional.pad(ids[:, 1:], (0, 1)), feature, torch.arange(ids.shape[1])[None])
    n_rep = q.shape[1] // k.shape[1]
    from eagle3.ttt import repeat_kv

    out = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                                           is_causal=True, scale=m.attn_scale)
    return m.after_attention(feature, out)


@pytest.mark.parametrize("arch", ["llama", "mla"])
@pytest.mark.parametrize("norm_output", [False, True])
def test_step_1_receives_the_pre_norm_or_with_norm_output_the_normed_hidden(monkeypatch, arch, norm_output):
    """What step 1 is fed, in the training-time test and in `decode` (the evaluator's drafting): step 0's pre-norm
    output h0 (EAGLE-3), or norm(h0) with the final norm's own weight (EAGLE-3.1 norm_output), norm written out
    here. The norm's weight is random, so the two differ by far more than the tolerance."""
    m = make(arch, fc_norm=True, norm_output=norm_output)
    torch.manual_seed(4)
    aux, ids = torch.randn(1, 9, 3 * H), torch.randint(0, V, (1, 9))
    with torch.no_grad():
        h0 = _step0_output(m, aux, ids)[0]  # [T, H]
        normed = _rms_norm(h0, m.norm.weight.detach(), m.config.rms_norm_eps)
        want, other = (normed, h0) if norm_output else (h0, normed)
        assert (want - other).abs().max() > 0.1

        seen: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        real_inputs, real_block = m.attention_inputs, m.block
        monkeypatch.setattr(m, "attention_inputs",
                            lambda i, hidden, p, **kw: seen.append(hidden) or real_inputs(i, hidden, p, **kw))
        monkeypatch.setattr(m, "block", lambda hidden, a: outputs.append(real_block(hidden, a)) or outputs[-1])
        ttt_unroll(m, m.project(aux), ids, 2)
        block0, fed1 = outputs[0], seen[1].reshape(-1, H)  # every row kept: rows in position order
        torch.testing.assert_close(block0, h0, atol=1e-5, rtol=1e-5)  # the block's output is step 0's output
        expected = _rms_norm(block0, m.norm.weight, m.config.rms_norm_eps) if norm_output else block0
        assert torch.equal(fed1, expected)
        monkeypatch.undo()

        handed, _, _ = m.decode(torch.nn.functional.pad(ids[:, 1:], (0, 1)), m.project(aux), torch.arange(9)[None],
                                None)
        torch.testing.assert_close(handed[0], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,fc_norm,norm_output", [("mla", True, True), ("llama", True, True), ("mla", False, False)])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_export_and_reload(tmp_path, engine, arch, fc_norm, norm_output):
    m = make(arch, fc_norm, norm_output)
    src = save_draft(m, tmp_path / "draft")
    out = export(src, tmp_path / engine, to=engine, dtype=None)
    cfg = json.loads((out / "config.json").read_text())
    names = set(load_file(str(out / "model.safetensors")))
    layer = cfg if (arch == "mla" or engine == "sglang") else cfg["transformer_layer_config"]
    assert cfg["fc_norm"] is fc_norm and cfg["norm_output"] is norm_output
    assert cfg["draft_vocab_size"] == VD and layer["vocab_size"] == V
    if arch == "mla":
        assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "kimi_k2"
        assert {k: cfg[k] for k in MLA} == MLA and cfg["num_hidden_layers"] == 1 and cfg["rope_interleave"] is True
        assert cfg["rope_scaling"]["factor"] == 4.0 and cfg["rope_scaling"]["rope_type"] == "yarn"
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ([1, 3, 5] if engine == "sglang" else [2, 4, 6])
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    prefix = "midlayer." if engine == "sglang" else "layers.0."
    assert f"{prefix}self_attn.o_proj.weight" in names and ("fc_norm.0.weight" in names) is fc_norm
    assert not any(n.startswith("layers.0." if engine == "sglang" else "midlayer.") for n in names)
    back = load_draft(out, embed_weight=m.embed_tokens.weight)
    assert (back.config.arch, back.config.fc_norm, back.config.norm_output) == (arch, fc_norm, norm_output)
    for k, v in m.draft_state_dict().items():
        assert torch.equal(back.draft_state_dict()[k], v), k


def test_mla_export_spells_plain_rope_as_yarn_factor_one(tmp_path):
    """SGLang's CPU RoPE factory builds only DeepSeek YaRN for MLA; factor 1 is the same rotation."""
    m = make("mla")
    m.config.rope_scaling = None
    out = export(save_draft(m, tmp_path / "d"), tmp_path / "sgl", to="sglang", dtype=None)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 1.0
    plain = Eagle3Draft(config("mla", rope_scaling=None)).midlayer.self_attn
    yarn1 = Eagle3Draft(config("mla", rope_scaling=cfg["rope_scaling"])).midlayer.self_attn
    x, pos = torch.randn(1, 5, H), torch.arange(40, 45)[None]
    for a, b in zip(plain.rotary_emb(x, pos), yarn1.rotary_emb(x, pos), strict=True):
        torch.testing.assert_close(a, b)
    assert plain.scale == yarn1.scale


# ------------------------------------------------------------------------------------------ published formats
def published_mla(folder: Path, m: Eagle3Draft, sglang_ids: list[int] | None) -> Path:
    """A folder laid out as the published Kimi-K2.5 MLA head is: a DeepSeek-V3 config (`model_type: kimi_k2`),
    full vocab (no d2t / t2d), `layers.0.*` names, ids (if any) under eagle_config in SGLang's spelling."""
    c = m.config
    assert c.arch == "mla" and c.vocab_size == c.draft_vocab_size
    folder.mkdir(parents=True)
    sd = {k.replace("midlayer.", "layers.0."): v for k, v in m.draft_state_dict().items() if k not in ("d2t", "t2d")}
    save_file(sd, str(folder / "model.safetensors"))
    conf = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_attention_heads,
            "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size, "draft_vocab_size": c.vocab_size,
            "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "rope_scaling": c.rope_scaling, "max_position_embeddings": c.max_position_embeddings,
            "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank, "qk_nope_head_dim": c.qk_nope_head_dim,
            "qk_rope_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim, "hidden_act": "silu",
            "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    if sglang_ids:
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True}
    (folder / "config.json").write_text(json.dumps(conf))
    return folder


def published_llama(folder: Path, m: Eagle3Draft) -> Path:
    """As lightseekorg's kimi-k2.5-eagle3: a Llama config with no draft_vocab_size and no eagle_config."""
    c = m.config
    assert c.arch == "llama" and c.vocab_size == c.draft_vocab_size
    folder.mkdir(parents=True)
    save_file({k: v for k, v in m.draft_state_dict().items() if k not in ("d2t", "t2d")},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
        "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings}))
    return folder


def test_published_heads_load_as_they_are(tmp_path):
    mla = make("mla", vocab=V)
    back = load_draft(published_mla(tmp_path / "mla", mla, [1, 3, 5]), embed_weight=mla.embed_tokens.weight,
                      engine="sglang", family="deepseek")
    assert back.config.arch == "mla" and back.config.aux_layer_ids == [2, 4, 6]  # [1, 3, 5] in SGLang's spelling
    assert back.config.draft_vocab_size == V and not back.d2t.any() and back.t2d.all()
    for k, v in mla.draft_state_dict().items():
        assert torch.equal(back.draft_state_dict()[k], v), k
    llama = make("llama", vocab=V)
    back = load_draft(published_llama(tmp_path / "llama", llama), embed_weight=llama.embed_tokens.weight)
    assert back.config.arch == "llama" and back.config.aux_layer_ids is None  # the engines' defaults apply
    assert back.config.draft_vocab_size == V
    torch.testing.assert_close(back.decode(torch.tensor([[3, 4]]), torch.randn(1, 2, H), torch.arange(2)[None],
                                           None)[1].shape, torch.zeros(1, 2, V).shape)


def test_a_folder_with_an_unknown_tensor_is_refused(tmp_path):
    """SGLang skips an unknown weight with a warning only; eagle3 names it instead of training or serving around it."""
    m = make("mla")
    folder = save_draft(m, tmp_path / "d")
    sd = load_file(str(folder / "model.safetensors"))
    sd["midlayer.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(DraftFormatError, match=r"unexpected tensors: \['midlayer.self_attn.q_proj.weight'\]"):
        load_draft(folder)
    config, _ = read_draft(folder)
    assert config.arch == "mla"


def test_non_finite_weights_are_never_exported(tmp_path):
    m = make("mla")
    with torch.no_grad():
        m.midlayer.self_attn.kv_b_proj.weight[0, 0] = float("nan")
    with pytest.raises(DraftFormatError, match="kv_b_proj.weight holds NaN"):
        export(save_draft(m, tmp_path / "d"), tmp_path / "out", to="sglang")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------- config
def test_mla_dimensions_default_from_the_target():
    cfg = Config()
    cfg.target.aux_layer_ids = None
    cfg.draft.arch = "mla"
    kimi = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
            "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
            "vocab_size": 163840, "num_hidden_layers": 61, "rope_theta": 50000.0, "max_position_embeddings": 262144,
            "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
    c = Eagle3DraftConfig.from_target(cfg.draft, cfg.target, kimi, 163840)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert c.intermediate_size == 18432 and c.rope_scaling["factor"] == 64.0 and c.aux_layer_ids == [2, 30, 58]
    smol = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "head_dim": 64,
            "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
            "num_hidden_layers": 30, "rope_theta": 100000.0}
    cfg.draft.kv_lora_rank = 128
    c = Eagle3DraftConfig.from_target(cfg.draft, cfg.target, smol, 8192)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        768, 128, 64, 32, 64)
    assert c.num_key_value_heads == 9 and c.rope_scaling is None
    Eagle3Draft(c)  # builds


def test_kimi_config_validates_with_the_mla_and_3_1_options():
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "eagle3.cli", "config", "show", "--config",
                          str(repo / "configs" / "kimi-k2.5.yaml"), "draft.arch=mla", "draft.fc_norm=true",
                          "draft.norm_output=true"], capture_output=True, text=True, cwd=repo)
    assert out.returncode == 0, out.stderr
    assert "arch: mla" in out.stdout and "fc_norm: true" in out.stdout and "norm_output: true" in out.stdout


# ------------------------------------------------------------------------------------------------ deeper heads
def test_deeper_head_has_exactly_the_engines_weight_names():
    """`draft.num_layers` 3: the first layer as before, then layers.1 and layers.2 on the residual stream (H-wide
    attention input), each with its pre-attention norm under vLLM's name and SGLang's, equal."""
    m = make("llama", num_layers=3)
    sd = {k: tuple(t.shape) for k, t in m.draft_state_dict().items()}
    one = {k: s for k, s in {k: tuple(t.shape) for k, t in make("llama").draft_state_dict().items()}.items()}
    stacked = {k: s for k, s in sd.items() if k.startswith("layers.")}
    assert {k: s for k, s in sd.items() if not k.startswith("layers.")} == one
    for i in (1, 2):
        assert {k.removeprefix(f"layers.{i}."): s for k, s in stacked.items() if k.startswith(f"layers.{i}.")} == {
            "self_attn.q_proj.weight": (4 * 8, H), "self_attn.k_proj.weight": (2 * 8, H),
            "self_attn.v_proj.weight": (2 * 8, H), "self_attn.o_proj.weight": (H, 4 * 8),
            "mlp.gate_proj.weight": (48, H), "mlp.up_proj.weight": (48, H), "mlp.down_proj.weight": (H, 48),
            "input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,)}
        names = m.draft_state_dict()
        assert torch.equal(names[f"layers.{i}.hidden_norm.weight"], names[f"layers.{i}.input_layernorm.weight"])


@pytest.mark.parametrize("fc_norm,norm_output,num_layers", [(False, False, 2), (True, True, 3)])
def test_deeper_head_ttt_equals_chain_drafting_and_dense(fc_norm, norm_output, num_layers):
    """Every layer's keys in the training-time test are what chain drafting's per-layer KV cache holds: each TTT
    step at each position = `decode`'s chain there; the fast attention = the dense reference, gradients included."""
    m = make("llama", fc_norm, norm_output, num_layers=num_layers)
    aux, ids, fast = _assert_ttt_equals_chain_and_dense(m)
    with torch.no_grad():
        # The stacked layers are in the computation: the first layer alone (same weights) drafts otherwise.
        alone = make("llama", fc_norm, norm_output)
        alone.load_state_dict(m.state_dict(), strict=False)
        first = ttt_unroll(alone, alone.project(aux), ids, 4)
        assert all(not torch.allclose(a, b, atol=1e-3) for a, b in zip(first, fast, strict=True))


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_deeper_head_export_and_reload(tmp_path, engine):
    m = make("llama", True, True, num_layers=2)
    out = export(save_draft(m, tmp_path / "draft"), tmp_path / engine, to=engine, dtype=None)
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg if engine == "sglang" else cfg["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 2
    saved = load_file(str(out / "model.safetensors"))
    assert torch.equal(saved["layers.1.hidden_norm.weight"], saved["layers.1.input_layernorm.weight"])
    first = "midlayer." if engine == "sglang" else "layers.0."  # the first layer as each engine spells it
    assert f"{first}self_attn.q_proj.weight" in saved and "layers.1.self_attn.q_proj.weight" in saved
    assert saved[f"{first}self_attn.q_proj.weight"].shape[1] == 2 * H
    assert saved["layers.1.self_attn.q_proj.weight"].shape[1] == H
    back = load_draft(out, embed_weight=m.embed_tokens.weight)
    assert back.config.num_layers == 2
    for k, v in m.draft_state_dict().items():
        assert torch.equal(back.draft_state_dict()[k], v), k


def test_a_deeper_head_whose_two_norm_names_differ_is_refused(tmp_path):
    """SGLang reads layers.1.hidden_norm, vLLM layers.1.input_layernorm: a folder where they differ would be served
    as two different heads."""
    d = save_draft(make("llama", num_layers=2), tmp_path / "draft")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["layers.1.hidden_norm.weight"] = tensors["layers.1.hidden_norm.weight"] + 1
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(DraftFormatError, match="two different heads"):
        read_draft(d)


def test_deeper_mla_heads_are_refused_where_the_engines_cannot_load_them():
    with pytest.raises(ValueError, match="only the Llama layer stacks"):
        config("mla", num_layers=2)
    cfg = Config()
    with pytest.raises(ValueError, match="draft.num_layers=2 with draft.arch='mla'"):
        type(cfg.draft).model_validate({"arch": "mla", "num_layers": 2})
