"""Extraction at long context (issue 43): a 32K-token sample through the HF backend, the cache, fp8 storage and
verify-extraction on a tiny target whose window allows it; nothing bigger than the target's own forward needs
(the lm_head argmax and fp8 quantisation in blocks, states written out as the hooks fire); the SGLang capture
server's context length from `data.max_length`; `data.max_length` beyond the target's window refused.

    pytest -q tests/test_long_extraction.py            # the fast part
    pytest -q -m slow tests/test_long_extraction.py    # + the 32K-token sample end to end (~40 s)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import make_prepared, tiny_llama, tiny_target_cfg

from eagle3.config import ConfigError, load_config


def _with_rope(folder: Path, max_positions: int, scaling: dict | None = None) -> Path:
    conf = folder / "config.json"
    c = json.loads(conf.read_text())
    c["max_position_embeddings"] = max_positions
    if scaling:
        c["rope_scaling"] = scaling
        c["rope_parameters"] = {**scaling, "rope_theta": c.get("rope_parameters", {}).get("rope_theta", 10000.0)}
    conf.write_text(json.dumps(c))
    return folder


# -------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("scaling", "window"), [
    (None, 2048),
    ({"rope_type": "linear", "factor": 4.0}, 8192),  # both engines scale a linear window
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 2048),  # already scaled
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 256}, 2048),
])
def test_max_length_beyond_the_targets_window_is_a_config_error(tmp_path, scaling, window):
    target = _with_rope(tiny_llama(tmp_path / "t"), 2048, scaling)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"target:\n  path: {target}\ndata:\n  max_length: {window}\n")
    assert load_config(cfg_file).data.max_length == window
    with pytest.raises(ConfigError) as e:
        load_config(cfg_file, [f"data.max_length={window + 1}"])
    msg = str(e.value)
    assert f"data.max_length: {window + 1} tokens is beyond the target's context window of {window} tokens" in msg
    assert str(target / "config.json") in msg and f"at most {window}" in msg


def test_the_bundled_models_window_is_known_without_materialising_it():
    with pytest.raises(ConfigError, match="data.max_length: 16384 tokens is beyond the target's context window of "
                                          "8192 tokens .bundled:smollm2-135m-instruct"):
        load_config(None, ["data.max_length=16384"])
    assert load_config(None, ["data.max_length=8192"]).data.max_length == 8192


# ----------------------------------------------------------------------------------- bounded temporaries
def test_the_argmax_takes_a_long_sample_in_blocks_with_the_same_ids(monkeypatch):
    """lm_head_max never multiplies more than LOGITS_PER_BLOCK logits at once, and its ids are the full argmax."""
    from eagle3.targets import argmax

    g = torch.Generator().manual_seed(0)
    weight, final = torch.randn(1000, 16, generator=g), torch.randn(3000, 16, generator=g)
    want = (final @ weight.T).argmax(-1)
    seen = []
    real = argmax.row_max
    monkeypatch.setattr(argmax, "row_max", lambda z, *a: (seen.append(z.numel()), real(z, *a))[1])
    monkeypatch.setattr(argmax, "LOGITS_PER_BLOCK", 256 * 100)
    assert torch.equal(argmax.lm_head_argmax(weight, final, chunk=256), want)
    assert max(seen) <= 256 * 100 and len(seen) == -(-3000 // 100) * 4


def test_fp8_quantisation_in_blocks_is_bit_identical(monkeypatch):
    """quantize holds QUANTIZE_ELEMENTS float32 states at a time (each block checked finite as it comes), and the
    bytes are those of quantising the whole sample at once."""
    from eagle3.cache import codec as storage

    x = torch.randn(1000, 3 * 24, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[7] = 0  # an all-zero token keeps scale 0
    whole = storage.quantize(x, 3)
    seen = []
    real = torch.isfinite
    monkeypatch.setattr(storage.torch, "isfinite", lambda v: (seen.append(v.numel()), real(v))[1])
    monkeypatch.setattr(storage, "QUANTIZE_ELEMENTS", 72 * 64)
    blocks = storage.quantize(x, 3)
    assert max(seen) == 72 * 64 and sum(seen) == x.numel()
    assert torch.equal(whole[0].view(torch.uint8), blocks[0].view(torch.uint8)) and torch.equal(whole[1], blocks[1])
    x[500, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN/inf"):
        storage.quantize(x, 3)


def test_hf_capture_keeps_one_copy_of_the_states(tmp_path):
    """The hooks write each layer's input into its third of one [B, T, 3H] host tensor as the forward runs: the
    sequences' states are views of it (no concatenated or per-sequence copy) and the tap holds nothing after."""
    from eagle3.targets.hf import HFTarget

    target = tiny_llama(tmp_path / "t")
    cfg = tiny_target_cfg(target, make_prepared(tmp_path / "p", n=2, n_eval=1), tmp_path / "o")
    backend = HFTarget(cfg.target, cfg.extract)
    seqs = [list(range(3, 40)), list(range(5, 20))]
    a, b = backend.capture(seqs)
    assert a.aux.untyped_storage().data_ptr() == b.aux.untyped_storage().data_ptr()
    assert a.aux.shape == (37, 3 * 64) and b.aux.shape == (15, 3 * 64) and not backend.tap.states
    with torch.no_grad():
        hs = backend.model.model(torch.tensor([seqs[1]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(b.aux, torch.cat([hs[k][0] for k in backend.layer_ids], -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.final, hs[-1][0], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------- the SGLang backend
def test_the_capture_server_context_fits_max_length(tmp_path):
    """`--context-length` = data.max_length + 7 (SGLang 0.5.23 takes prompts shorter than its max_req_input_len,
    context - 6); one given in launch_args must leave that room; the window itself is allowed past when only the
    reserve runs over it; the preflight refuses a server that takes shorter prompts."""
    from types import SimpleNamespace

    from eagle3.config import Config
    from eagle3.targets.info import read_target_info
    from eagle3.targets.sglang import SGLangTarget, capture_env, capture_flags, longest_prompt

    target = _with_rope(tiny_llama(tmp_path / "t"), 4096)
    cfg = Config()
    cfg.target.path, cfg.target.backend, cfg.data.max_length = str(target), "sglang", 4000
    flags = capture_flags(cfg.target, cfg.data.max_length, str(target))
    assert flags[flags.index("--context-length") + 1] == "4007"
    info = read_target_info(target)
    assert capture_env(cfg.target, cfg.data.max_length, info) == {}
    cfg.data.max_length = 4096  # the whole window: the reserve lies past it, never prefilled
    assert capture_env(cfg.target, cfg.data.max_length, info) == {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    cfg.target.sglang.launch_args = ["--context-length", "5000"]
    flags = capture_flags(cfg.target, cfg.data.max_length, str(target))
    assert flags.count("--context-length") == 1 and flags[-1] == "5000"
    cfg.target.sglang.launch_args = ["--context-length=4096"]
    with pytest.raises(ValueError, match="--context-length 4096 is too short for data.max_length 4096 .SGLang "
                                         "needs 4103"):
        capture_flags(cfg.target, cfg.data.max_length, str(target))

    assert longest_prompt({"max_req_input_len": 4097, "context_length": 9999}) == 4096
    assert longest_prompt({"context_length": 4103}) == 4096 and longest_prompt({}) is None
    cfg.target.sglang.launch_args = []
    fake = SimpleNamespace(target=cfg.target, max_length=cfg.data.max_length, layer_ids=[2, 4, 6], num_layers=8,
                           vocab_size=256, pool=SimpleNamespace(urls=["http://127.0.0.1:9"]), handover=None,
                           _from_dumps=lambda *a, **k: pytest.fail("the preflight probed a server too short for the "
                                                                   "data"))
    fake._check_server_info = lambda url: SGLangTarget._check_server_info(fake, url)
    import eagle3.targets.sglang_flags as sglang

    real = sglang.server_info
    try:
        sglang.server_info = lambda url: {"disable_radix_cache": True, "max_req_input_len": 4096}
        with pytest.raises(RuntimeError, match="takes prompts of at most 4095 tokens, data.max_length is 4096 "
                                               ".start it with --context-length 4103"):
            SGLangTarget.preflight(fake)
    finally:
        sglang.server_info = real


# --------------------------------------------------------------------------------------- a 32K sample
@pytest.mark.slow
def test_a_32k_sample_through_extraction_fp8_and_verify(tmp_path):
    """A 32768-token train sample (and an eval one) of a tiny target whose window is 32768: the fp8 cache holds it,
    read back it is the backend's capture within fp8's rounding, and verify-extraction passes it."""
    from eagle3.cache import HiddenStateDataset
    from eagle3.cache.codec import dense
    from eagle3.extract import run as extract
    from eagle3.targets.hf import HFTarget
    from eagle3.verify_extraction import run as verify

    n = 32768
    target = _with_rope(tiny_llama(tmp_path / "t", hidden=32, heads=2, kv_heads=1, intermediate=64, layers=5), n)
    prepared = make_prepared(tmp_path / "p", n=1, n_eval=1, min_len=n, max_len=n, max_length=n)
    cfg = tiny_target_cfg(target, prepared, tmp_path / "o", storage="fp8", batch_tokens=n, preflight=False)
    cfg.data.max_length, cfg.target.aux_layer_ids = n, [1, 2, 3]
    backend = HFTarget(cfg.target, cfg.extract)
    out = extract(cfg, backend=backend)
    assert out["tokens"] == 2 * n
    ds = HiddenStateDataset(cfg.cache_dir, "train")
    item = dense(ds[0], torch.float32)
    assert item["aux"].shape == (n, 96) and item["final"].shape == (n, 32) and len(item["target_argmax"]) == n
    cap = backend.capture([item["input_ids"].tolist()])[0]
    for got, want in ((item["aux"], cap.aux), (item["final"], cap.final)):
        cos = torch.nn.functional.cosine_similarity(got.view(n, -1, 32), want.view(n, -1, 32), dim=-1)
        assert float(cos.min()) > 0.999
    assert verify(cfg, source=str(cfg.cache_dir), num_samples=1) == 0
