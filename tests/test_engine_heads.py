"""MLA and EAGLE-3.1 heads, trained here, served as-is by the real SGLang 0.5.23 on CPU with the acceptance the
built-in evaluator computes (within 2%) on the same prompts.

    bash scripts/setup_sglang_cpu.sh && pytest -m sglang tests/test_engine_heads.py

Each head starts as test_sglang_eval's exact copying head on its "repeating" target (the high aux feature copied
through fc into the target's final norm and lm_head), with random attention and MLP outputs added so that the
attention (MLA or Llama), its RoPE, the `[embeds | hidden]` order, fc_norm and the hand-off between draft steps
all change which tokens are drafted; then the real trainer fine-tunes it a few steps (`draft.init_from`) on an
extracted cache of that target. SGLang loads eagle3's export (`Eagle3DeepseekV2ForCausalLM` or
`LlamaForCausalLMEagle3`); its log must show no skipped weight. The negative control flips `norm_output` in the
exported config: SGLang must then follow the flipped head, not the trained one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from models import make_prepared, tiny_target_cfg
from safetensors.torch import load_file
from test_sglang_eval import make_repeating_target
from test_sglang_real import CPU_FLAGS, DTYPE, IDS, _omp_bind, build_target, sglang_env  # noqa: F401

from eagle3.config import Config
from eagle3.model import repeat_kv

pytestmark = pytest.mark.sglang

NOISE = float(os.environ.get("EAGLE3_TEST_HEAD_NOISE", "0.1"))
VARIANTS = [("deepseek", "mla", True, True), ("llama", "llama", True, True), ("llama", "mla", False, False)]
"""(target family, draft arch, fc_norm, norm_output): MLA on both families, the 3.1 options on both layers."""


def trained_head(root: Path, family: str, arch: str, fc_norm: bool, norm_output: bool) -> Config:
    from eagle3.cache import HiddenStateDataset
    from eagle3.data.prepared import load_vocab
    from eagle3.extract import run as extract
    from eagle3.formats import save_draft
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig
    from eagle3.targets.weights import load_target_head
    from eagle3.trainer import run as train

    ids = IDS[family]
    target = build_target(family, root / "target")
    make_repeating_target(target, special=ids[-1] - 1)
    embed, lm_head, hf = load_target_head(str(target))
    vocab, h = embed.shape
    prepared = make_prepared(root / "prepared", n=24, n_eval=4, vocab=vocab, draft_vocab=vocab - 1, max_len=40)
    cfg = tiny_target_cfg(target, prepared, root / "run")
    cfg.target.aux_layer_ids, cfg.target.dtype = ids, DTYPE
    cfg.draft.arch, cfg.draft.fc_norm, cfg.draft.norm_output = arch, fc_norm, norm_output
    cfg.draft.vocab_size = vocab - 1
    d2t, t2d = load_vocab(prepared / "vocab.safetensors")
    draft = Eagle3Draft(Eagle3DraftConfig.from_target(cfg.draft, cfg.target, hf, vocab - 1))
    draft.set_vocab(d2t, t2d)
    draft.init_from_target(lm_head, embed)
    text = hf.get("text_config") or hf
    assert text["num_hidden_layers"] > ids[-1]
    cfg.extract.cache_dir = str(root / "cache")
    extract(cfg)
    g = torch.Generator().manual_seed(0)
    final_norm = next(v for k, v in load_file(str(target / "model.safetensors")).items()
                      if k.endswith("model.norm.weight"))
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * h:] = torch.eye(h)
        # The same logits through another split of the final scale: norm.weight = target's * c, lm_head / c (c
        # with random signs). Step 0 stays exact, but a post-norm hand-off (norm_output) carries c into later steps.
        c = torch.empty(h).uniform_(0.5, 2.0, generator=g) * (torch.randint(0, 2, (h,), generator=g) * 2 - 1)
        draft.norm.weight.copy_(final_norm * c)
        draft.lm_head.weight.div_(c)
        if fc_norm:
            for norm in draft.fc_norm:
                norm.weight.uniform_(0.9, 1.1, generator=g)
        sample = HiddenStateDataset(cfg.cache_dir, "train")[0]
        aux, tokens = sample["aux"].float()[None], sample["input_ids"][None].long()
        for weight in (draft.midlayer.self_attn.o_proj.weight, draft.midlayer.mlp.down_proj.weight):
            weight.zero_()
            before = _layer_output(draft, aux, tokens)
            weight.copy_(torch.randn(weight.shape, generator=g))
            added = _layer_output(draft, aux, tokens) - before
            weight.mul_(NOISE * _rms(draft.project(aux)) / _rms(added))  # a set share of the feature's size
    start = save_draft(draft, root / "start")
    cfg.draft.init_from = str(start)
    t = cfg.train
    t.max_steps, t.batch_tokens, t.lr, t.warmup_ratio, t.eval_every, t.save_every = 4, 256, 1e-4, 0.0, 2, 2
    t.mixed_precision = "no"
    train(cfg)

    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "Count to ten"}\n{"prompt": "abc abc abc"}\n')
    cfg.data.chat_template = "auto"
    cfg.eval.prompt_sets, cfg.eval.max_new_tokens, cfg.eval.engine = [str(prompts)], 24, "sglang"
    cfg.target.device = "cpu"
    cfg.target.sglang.launch_args = list(CPU_FLAGS)
    cfg.target.sglang.startup_timeout_s = 900
    return cfg


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def _layer_output(draft, aux: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder layer's pre-norm output at step 0 (features in, tokens shifted by one), in float32."""
    shifted = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    feature = draft.project(aux)
    q, k, v = draft.attention_inputs(shifted, feature, torch.arange(tokens.shape[1])[None])
    n_rep = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                                           is_causal=True, scale=draft.attn_scale)
    return draft.after_attention(feature, out)


def _server_log(cfg: Config) -> str:
    return "\n".join(p.read_text(errors="replace") for p in Path(cfg.output_dir).rglob("*sglang*.log"))


@pytest.mark.parametrize("family,arch,fc_norm,norm_output", VARIANTS,
                         ids=[f"{f}-{a}{'-3.1' if n or o else ''}" for f, a, n, o in VARIANTS])
def test_engine_serves_the_trained_head_with_the_builtin_acceptance(tmp_path, family, arch, fc_norm, norm_output):
    from eagle3.evaluate import run

    _omp_bind(1)
    cfg = trained_head(tmp_path, family, arch, fc_norm, norm_output)
    report = run(cfg)
    s, b = report["engines"]["sglang"], report["sets"]["prompts"]
    served = json.loads((Path(s["draft"]) / "config.json").read_text())
    assert served["architectures"] == (["Eagle3DeepseekV2ForCausalLM"] if arch == "mla" else ["LlamaForCausalLMEagle3"])
    assert (served["fc_norm"], served["norm_output"]) == (fc_norm, norm_output)
    log = _server_log(cfg)
    assert log and "skipping unexpected weight" not in log  # SGLang's MLA loader's only word on a weight it drops
    assert b["greedy_mismatches"] == 0
    assert 1.3 <= b["tau"] <= 3.9, b  # the attention and MLP outputs matter: neither trivial nor exact
    assert s["tau"] == pytest.approx(s["builtin_tau"], rel=0.02), (s, b["tau"])

    if (family, arch) != ("deepseek", "mla"):
        return
    # Negative control: the same weights with norm_output flipped are another head, and SGLang serves that one.
    flipped = tmp_path / "flipped"
    shutil.copytree(s["draft"], flipped)
    conf = json.loads((flipped / "config.json").read_text())
    conf["norm_output"] = conf["eagle3"]["norm_output"] = not norm_output
    (flipped / "config.json").write_text(json.dumps(conf))
    cfg.eval.checkpoint = str(flipped)
    other = run(cfg)
    o = other["engines"]["sglang"]
    assert abs(other["sets"]["prompts"]["tau"] - b["tau"]) > 0.1 * b["tau"], (other["sets"]["prompts"], b)
    assert o["tau"] == pytest.approx(o["builtin_tau"], rel=0.02), o
