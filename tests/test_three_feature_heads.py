"""The engine tests' heads (tests/three_feature_heads.py) on the built-in evaluator alone: each one's drafts depend on
what the engines must get right, so that an engine test comparing τ can fail. Without noise the head is exact at
draft position 0 (the low and mid terms cancel where they should); with it, every mistaken reading an engine could
make (the low and mid features swapped, their fc_norm weights swapped, fc_norm ignored, norm_output flipped, a deeper
head's stacked norms left at their initial ones) moves τ by more than 10%, five times the engine tests' 2% tolerance.

    pytest -q tests/test_three_feature_heads.py        # ~1 minute on 2 CPU cores
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_sglang_real import IDS, build_target
from three_feature_heads import (
    flip_norm_output,
    rms,
    swap_low_mid_features,
    swap_low_mid_norms,
    three_feature_setup,
    unit_stacked_norms,
)

from eagle3.formats import load_draft, save_draft
from eagle3.model import Eagle3Draft

VARIANTS = [("llama", "llama", True, True, 1), ("llama", "mla", False, False, 1), ("deepseek", "mla", True, True, 1),
            ("llama", "llama", True, True, 2)]


def _tau(cfg, folder: Path) -> float:
    from eagle3.evaluate import run

    cfg.eval.checkpoint, cfg.eval.engine = str(folder), "builtin"
    result = run(cfg)["sets"]["eval-split"]
    assert result["greedy_mismatches"] == 0
    return result["tau"]


def _without_fc_norm(folder: Path, out: Path) -> Path:
    """The same weights served by an engine that ignores fc_norm."""
    d = load_draft(folder)
    plain = Eagle3Draft(replace(d.config, fc_norm=False))
    plain.load_state_dict(d.state_dict(), strict=False)
    plain.set_vocab(d.d2t, d.t2d)
    return save_draft(plain, out)


@pytest.mark.parametrize("family,arch,fc_norm,norm_output,num_layers", VARIANTS,
                         ids=[f"{f}-{a}{'-3.1' if n else ''}{f'-{k}-layers' if k > 1 else ''}"
                              for f, a, n, _, k in VARIANTS])
def test_every_mistaken_reading_moves_tau(tmp_path, family, arch, fc_norm, norm_output, num_layers):
    cfg, _ = three_feature_setup(tmp_path, build_target(family, tmp_path / "target"), IDS[family], arch, fc_norm,
                                 norm_output, num_layers=num_layers)
    head = Path(cfg.draft.init_from)
    tau = _tau(cfg, head)
    assert 1.3 <= tau <= 3.9, tau  # the attention and MLP outputs matter: neither trivial nor exact
    controls = {"features swapped": swap_low_mid_features(head, tmp_path / "features"),
                "norm_output flipped": flip_norm_output(head, tmp_path / "flipped")}
    if fc_norm:
        controls |= {"fc_norm weights swapped": swap_low_mid_norms(head, tmp_path / "norms"),
                     "fc_norm ignored": _without_fc_norm(head, tmp_path / "plain")}
    if num_layers > 1:
        controls["stacked norms left at ones"] = unit_stacked_norms(head, tmp_path / "unit")
    moved = {name: _tau(cfg, folder) for name, folder in controls.items()}
    if fc_norm:  # the low and mid states differ by the small q alone: only fc_norm's weights tell them apart
        moved.pop("features swapped")
    assert all(abs(t - tau) > 0.1 * tau for t in moved.values()), (tau, moved)


def test_without_noise_the_low_and_mid_terms_cancel_exactly(tmp_path, monkeypatch):
    """Noise off: the head copies the target at draft position 0 on every prompt, though its fc has large low and
    mid columns (the cancellation is exact), and swapping the two fc_norm weights breaks the copy."""
    import three_feature_heads

    monkeypatch.setattr(three_feature_heads, "NOISE", 0.0)
    monkeypatch.setattr(three_feature_heads.three_feature_head, "__defaults__", (0, 0.0, three_feature_heads.CANCELLED))
    from eagle3.evaluate import run

    cfg, draft = three_feature_setup(tmp_path, build_target("llama", tmp_path / "target"), IDS["llama"], "llama",
                                     True, False)
    from eagle3.cache import HiddenStateDataset

    h = draft.config.hidden_size
    aux = HiddenStateDataset(cfg.cache_dir, "train")[0]["aux"].float()
    with torch.no_grad():  # each state's term in the dims the lm_head reads
        normed = [norm(x) for norm, x in zip(draft.fc_norm, aux.chunk(3, dim=-1), strict=True)]
        low, mid, high = (x @ draft.fc.weight[h // 2:, i * h: (i + 1) * h].T for i, x in enumerate(normed))
    assert rms(low) > rms(high) and rms(mid) > rms(high)  # the low and mid columns are large ...
    assert rms(low + mid) < 1e-3 * rms(high)  # ... and cancel
    cfg.eval.checkpoint, cfg.eval.engine = cfg.draft.init_from, "builtin"
    assert run(cfg)["sets"]["eval-split"]["acceptance_rate"][0] == 1.0
    cfg.eval.checkpoint = str(swap_low_mid_norms(Path(cfg.draft.init_from), tmp_path / "norms"))
    assert run(cfg)["sets"]["eval-split"]["acceptance_rate"][0] < 0.5
