"""The `draft.features: top` ablation: only the high state reaches fc, in training, eval and the export alike."""

from __future__ import annotations

import torch
from test_export import H, _outputs, make_draft

from eagle3.config import load_config
from eagle3.export import export
from eagle3.formats import load_draft, save_draft


def test_top_only_ignores_low_and_mid() -> None:
    draft = make_draft()
    draft.config.features = "top"
    aux = torch.randn(1, 5, 3 * H)
    noisy = aux.clone()
    noisy[..., : 2 * H] = torch.randn(1, 5, 2 * H)
    assert torch.equal(draft.project(aux), draft.project(noisy))
    draft.config.features = "fused"
    assert not torch.equal(draft.project(aux), draft.project(noisy))


def test_top_only_export_behaves_like_the_head_for_an_engine_feeding_all_three(tmp_path) -> None:
    draft = make_draft()
    draft.config.features = "top"
    save_draft(draft, tmp_path / "draft")
    out = export(tmp_path / "draft", tmp_path / "sglang", to="sglang", dtype=None)
    engine_like = load_draft(out, embed_weight=draft.embed_tokens.weight)
    engine_like.config.features = "fused"  # an engine knows nothing of the ablation
    for a, b in zip(_outputs(draft), _outputs(engine_like)):
        torch.testing.assert_close(a, b)


def test_config_knob() -> None:
    assert load_config(None, ["draft.features=top"]).draft.features == "top"


def test_reloaded_export_keeps_the_full_draft_config(tmp_path) -> None:
    draft = make_draft(family="deepseek")
    draft.config.features = "top"
    save_draft(draft, tmp_path / "draft")
    for engine in ("sglang", "vllm"):
        out = export(tmp_path / "draft", tmp_path / engine, to=engine, dtype=None)
        again = load_draft(out, embed_weight=draft.embed_tokens.weight)
        assert again.config.features == "top"
        assert again.config.target == draft.config.target
        assert again.config.aux_layer_ids == draft.config.aux_layer_ids
