"""MLA, EAGLE-3.1 and deeper (two-layer) heads, trained here, served as-is by the real SGLang 0.5.23 on CPU with the
acceptance the built-in evaluator computes (within 2%) on the same prompts.

    bash scripts/setup_sglang_cpu.sh && pytest -m sglang tests/test_engine_heads.py

Each head is tests/three_feature_heads.py's: its drafts depend on all three aux features in their order, on each
fc_norm weight's third and on norm_output, as well as on the attention (MLA or Llama), its RoPE and the
`[embeds | hidden]` order; then the real trainer fine-tunes it a few steps (`draft.init_from`) on an extracted
cache of its target. SGLang loads eagle3's export (`Eagle3DeepseekV2ForCausalLM` or `LlamaForCausalLMEagle3`); its
log must show no skipped weight. The Llama-layer head has two layers (`draft.num_layers`), its stacked layer's norm
random: SGLang reads it as `layers.1.hidden_norm`. The negative controls rewrite the export as a mistaken engine would
read it (norm_output flipped, the low and mid fc_norm weights swapped, the low and mid features swapped): SGLang must
then serve the rewritten head's τ, far from the right one's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sglang_real import CPU_FLAGS, DTYPE, IDS, _omp_bind, build_target, sglang_env  # noqa: F401
from three_feature_heads import flip_norm_output, moved, swap_low_mid_features, swap_low_mid_norms, three_feature_setup

from eagle3.config import Config

pytestmark = pytest.mark.sglang

VARIANTS = [("deepseek", "mla", True, True, 1), ("llama", "llama", True, True, 2), ("llama", "mla", False, False, 1)]
"""(target family, draft arch, fc_norm, norm_output, num_layers): MLA on both families, the 3.1 options on both
layers, a deeper head on the Llama layer (SGLang's MLA head loads one layer)."""
CONTROLS = {
    ("deepseek", "mla", True, True, 1): [("flipped-norm-output", flip_norm_output)],
    ("llama", "llama", True, True, 2): [("swapped-fc-norms", swap_low_mid_norms)],
    ("llama", "mla", False, False, 1): [("swapped-features", swap_low_mid_features)],
}
"""The negative controls each variant is served with: one per engine start, each on what the variant can show."""


def trained_head(root: Path, family: str, arch: str, fc_norm: bool, norm_output: bool, num_layers: int = 1) -> Config:
    from eagle3.trainer import run as train

    cfg, _ = three_feature_setup(root, build_target(family, root / "target"), IDS[family], arch, fc_norm, norm_output,
                                 dtype=DTYPE, num_layers=num_layers)
    t = cfg.train
    t.max_steps, t.batch_tokens, t.lr, t.warmup_ratio, t.eval_every, t.save_every = 4, 256, 1e-4, 0.0, 2, 2
    t.mixed_precision = "no"
    train(cfg)
    cfg.eval.engine = "sglang"
    cfg.target.sglang.launch_args = list(CPU_FLAGS)
    cfg.target.sglang.startup_timeout_s = 900
    return cfg


def _server_log(cfg: Config) -> str:
    return "\n".join(p.read_text(errors="replace") for p in Path(cfg.output_dir).rglob("*sglang*.log"))


@pytest.mark.parametrize("family,arch,fc_norm,norm_output,num_layers", VARIANTS,
                         ids=[f"{f}-{a}{'-3.1' if n or o else ''}{f'-{k}-layers' if k > 1 else ''}"
                              for f, a, n, o, k in VARIANTS])
def test_engine_serves_the_trained_head_with_the_builtin_acceptance(tmp_path, family, arch, fc_norm, norm_output,
                                                                    num_layers):
    from eagle3.evaluate import run

    _omp_bind(1)
    cfg = trained_head(tmp_path, family, arch, fc_norm, norm_output, num_layers)
    report = run(cfg)
    s, b = report["engines"]["sglang"], report["sets"]["eval-split"]
    served = json.loads((Path(s["draft"]) / "config.json").read_text())
    assert served["architectures"] == (["Eagle3DeepseekV2ForCausalLM"] if arch == "mla" else ["LlamaForCausalLMEagle3"])
    assert (served["fc_norm"], served["norm_output"], served["num_hidden_layers"]) == (fc_norm, norm_output, num_layers)
    log = _server_log(cfg)
    assert log and "skipping unexpected weight" not in log  # SGLang's MLA loader's only word on a weight it drops
    assert b["greedy_mismatches"] == 0
    assert 1.3 <= b["tau"] <= 3.9, b  # the attention and MLP outputs matter: neither trivial nor exact
    assert s["tau"] == pytest.approx(s["builtin_tau"], rel=0.02), (s, b["tau"])

    # Negative controls: the export rewritten as a mistaken engine would read it (each fc_norm weight on another
    # third, the features in another order, the other hand-off between draft steps) is another head, and SGLang
    # serves that one: its τ is the built-in's for the rewritten head, and far from the right one's.
    for name, rewrite in CONTROLS[(family, arch, fc_norm, norm_output, num_layers)]:
        cfg.eval.checkpoint = str(rewrite(Path(s["draft"]), tmp_path / name))
        other = run(cfg)
        o = other["engines"]["sglang"]
        assert moved(other["sets"]["eval-split"], b), (name, other["sets"], b)
        assert o["tau"] == pytest.approx(o["builtin_tau"], rel=0.02), (name, o)
