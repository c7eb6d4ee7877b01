"""verify-extraction: passes correct states, catches shifted layers, pre-norm finals and missing tokens."""

from __future__ import annotations

import pytest
import torch
from models import make_prepared, tiny_deepseek_v3, tiny_llama, tiny_target_cfg

from eagle3.extract import run as extract
from eagle3.targets.base import Captured
from eagle3.targets.hf import HFTarget
from eagle3.verify_extraction import run as verify


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    return {"llama": tiny_llama(root / "llama"), "deepseek": tiny_deepseek_v3(root / "ds"),
            "prepared": make_prepared(root / "prepared", n=6, n_eval=2)}


class Faulty:
    """An HF backend that makes one engine mistake on purpose, while reporting the configured layer ids."""

    def __init__(self, cfg, fault: str):
        self.fault = fault
        shifted = cfg.model_copy(deep=True)
        ids = cfg.target.layer_ids(HFTarget(cfg.target, cfg.extract).num_layers)
        if fault == "shift":  # an engine whose id k means "output of layer k" = eagle3 id k+1
            shifted.target.aux_layer_ids = [i + 1 for i in ids]
        self.inner = HFTarget(shifted.target, shifted.extract)
        self.name, self.layer_ids, self.dtype = "faulty", ids, self.inner.dtype
        self.num_layers, self.hidden_size, self.vocab_size = (self.inner.num_layers, self.inner.hidden_size,
                                                              self.inner.vocab_size)
        self._pre: dict[str, torch.Tensor] = {}
        self.inner.norm.register_forward_hook(lambda _m, args, _o: self._pre.__setitem__("x", args[0]))

    def capture(self, seqs):
        out = []
        for s in seqs:
            c = self.inner.capture([s])[0]
            if self.fault == "prenorm":
                c = Captured(c.aux, self._pre["x"][0].clone())
            if self.fault == "prefix":  # a prefix-cache hit: the first 3 tokens never come back
                c = Captured(c.aux[3:], c.final[3:])
            if self.fault == "one-token":  # one token's middle-layer state wrong (cosine 0.7), the rest right
                aux, h, t = c.aux.clone(), self.hidden_size, len(s) // 2
                a = aux[t, h:2 * h].float()
                u = torch.randn(h, generator=torch.Generator().manual_seed(t))
                u = u - (u @ a) / (a @ a) * a  # orthogonal to a
                aux[t, h:2 * h] = (0.7 * a + 0.51**0.5 * u * a.norm() / u.norm()).to(aux.dtype)
                c = Captured(aux, c.final)
            out.append(c)
        return out

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_correct_backend_passes(world, tmp_path, capsys, kind):
    cfg = tiny_target_cfg(world[kind], world["prepared"], tmp_path)
    cfg.target.dtype = "bfloat16"
    assert verify(cfg, "backend", 3) == 0
    out = capsys.readouterr().out
    assert "PASS: 3 sample(s)" in out and "FAIL" not in out


def test_catches_off_by_one_layers(world, tmp_path, capsys):
    cfg = tiny_target_cfg(world["llama"], world["prepared"], tmp_path)
    assert verify(cfg, "backend", 2, backend=Faulty(cfg, "shift")) == 1
    out = capsys.readouterr().out
    ids = cfg.target.layer_ids(8)
    assert f"matches id {ids[0] + 1}" in out and "off by one" in out
    assert "output of layer k" in out and "FAIL: aux layers off by one" in out


def test_catches_prenorm_final(world, tmp_path, capsys):
    cfg = tiny_target_cfg(world["deepseek"], world["prepared"], tmp_path)
    assert verify(cfg, "backend", 2, backend=Faulty(cfg, "prenorm")) == 1
    out = capsys.readouterr().out
    assert "PRE-norm" in out
    assert out.count("off by") == 0  # the aux layers are fine and reported fine


def test_catches_missing_tokens(world, tmp_path, capsys):
    cfg = tiny_target_cfg(world["llama"], world["prepared"], tmp_path)
    assert verify(cfg, "backend", 2, backend=Faulty(cfg, "prefix")) == 1
    out = capsys.readouterr().out
    assert "missing tokens" in out and "prefix" in out


def test_a_few_wrong_tokens_fail_although_the_mean_passes(world, tmp_path, capsys):
    """One token of a 36-token sample wrong: the layer's mean cosine still clears 0.99 (35 right tokens), the
    worst token does not, and the report names the token and the layer."""
    prepared = make_prepared(tmp_path / "long", n=3, n_eval=1, min_len=36, max_len=37)
    cfg = tiny_target_cfg(world["llama"], prepared, tmp_path)
    assert verify(cfg, "backend", 2, backend=Faulty(cfg, "one-token")) == 1
    out = capsys.readouterr().out
    ids = cfg.target.layer_ids(8)
    line = next(x for x in out.splitlines() if f"aux[1] id {ids[1]}" in x)
    mean = float(line.split("cosine ")[1].split()[0])
    assert mean >= 0.99 and "token 18: cosine 0.7000 < 0.999 (the mean passes)" in line, out
    assert "FAIL: single tokens' states are wrong" in out
    assert all("FAIL" not in x for x in out.splitlines() if "aux[0]" in x or "aux[2]" in x or "final" in x)


def test_verifies_a_cache(world, tmp_path, capsys):
    good = tiny_target_cfg(world["llama"], world["prepared"], tmp_path / "good")
    good.target.dtype = "bfloat16"
    extract(good)
    assert verify(good, str(good.cache_dir), 4) == 0
    assert "PASS: 4 sample(s)" in capsys.readouterr().out
    bad = tiny_target_cfg(world["llama"], world["prepared"], tmp_path / "bad")
    extract(bad, backend=Faulty(bad, "shift"))  # an engine cache written with the other convention
    assert verify(bad, str(bad.cache_dir), 2) == 1
    assert "off by one" in capsys.readouterr().out


class OtherHead(HFTarget):
    """Right states, but an argmax from another lm_head (e.g. a cache extracted against another checkpoint)."""

    @property
    def lm_head_weight(self):
        g = torch.Generator().manual_seed(0)
        w = super().lm_head_weight
        return torch.randn(w.shape, generator=g).to(w)


def test_catches_a_stored_argmax_from_another_lm_head(world, tmp_path, capsys):
    cfg = tiny_target_cfg(world["llama"], world["prepared"], tmp_path / "other-head")
    extract(cfg, backend=OtherHead(cfg.target, cfg.extract))
    assert verify(cfg, str(cfg.cache_dir), 2) == 1
    out = capsys.readouterr().out
    assert "stored ids are not the target lm_head's argmax" in out and "other weights?" in out
