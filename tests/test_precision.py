"""`auto` precision: bf16 only where the device runs it natively, float32 elsewhere; a warning for an explicit bf16
on a CPU that emulates it; a cache of one dtype never read as another (capability mocked through /proc/cpuinfo)."""

from __future__ import annotations

import logging

import pytest

from eagle3 import precision
from eagle3.config import Config, load_config


@pytest.fixture
def cpu(monkeypatch):
    """Set the CPU's flags as /proc/cpuinfo would report them."""
    monkeypatch.delenv("EAGLE3_NATIVE_BF16", raising=False)
    monkeypatch.setattr(precision, "_said", set())
    monkeypatch.setattr(precision, "_pending", [])

    def set_flags(*flags: str) -> None:
        monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(("fpu", "avx2", "fma", *flags)))
    return set_flags


def test_auto_is_float32_without_native_bf16_and_bf16_with_it(cpu, caplog):
    caplog.set_level(logging.INFO, logger="eagle3")
    cpu()  # AVX2 only: the common laptop / cloud VM
    assert load_config(None).target.dtype == "float32"
    assert precision.resolve_mixed_precision("auto", "cpu") == "no"
    assert "target.dtype=auto: float32 (the CPU has no avx512_bf16 or amx_bf16)" in caplog.text
    for flag in ("avx512_bf16", "amx_bf16"):
        cpu(flag)
        assert load_config(None).target.dtype == "bfloat16"
        assert precision.resolve_mixed_precision("auto", "cpu") == "bf16"
    assert f"target.dtype=auto: bfloat16 (the CPU has {flag})" in caplog.text
    load_config(None)
    assert caplog.text.count(f"target.dtype=auto: bfloat16 (the CPU has {flag})") == 1  # once per process


def test_explicit_bf16_on_an_emulating_cpu_runs_with_a_warning(cpu, caplog, tmp_path):
    assert logging.getLogger("eagle3").propagate, "an earlier test's setup_logging leaked: caplog would see nothing"
    cpu()
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("target:\n  dtype: bfloat16\ntrain:\n  mixed_precision: bf16\n")
    cfg = load_config(cfg_file)
    assert cfg.target.dtype == "bfloat16"  # still runs as asked
    assert precision.resolve_mixed_precision(cfg.train.mixed_precision, "cpu") == "bf16"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("target.dtype=bfloat16 on cpu" in w and "several times slower than float32" in w for w in warnings), warnings
    assert any("train.mixed_precision=bf16 on the CPU" in w for w in warnings), warnings
    cpu("avx512_bf16")
    caplog.clear()
    load_config(cfg_file)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_the_override_and_a_cuda_target(cpu, monkeypatch):
    monkeypatch.setenv("EAGLE3_NATIVE_BF16", "1")
    assert Config().target.dtype == "bfloat16"
    monkeypatch.setenv("EAGLE3_NATIVE_BF16", "0")
    assert Config().target.dtype == "float32"
    # a GPU target validated on a machine without CUDA (a login node): GPUs run bf16
    assert load_config(None, ["target.device=cuda"]).target.dtype == "bfloat16"


def test_a_cache_of_another_dtype_is_refused(cpu, tmp_path):
    """auto resolves per machine; the fingerprint records the concrete dtype, so a float32 cache is never trained
    on as bf16 (or the other way round) after a move to another CPU."""
    from models import tiny_llama

    from eagle3.cache import expected_fingerprint, fingerprint_diff

    target = str(tiny_llama(tmp_path / "t"))
    cpu()
    a = load_config(None, [f"target.path={target}"])
    cpu("amx_bf16")
    b = load_config(None, [f"target.path={target}"])
    meta = {"fingerprint": "p", "max_length": 2048}
    fa = expected_fingerprint(a.target, a.extract.storage, meta)
    fb = expected_fingerprint(b.target, b.extract.storage, meta)
    assert (fa["dtype"], fb["dtype"]) == ("float32", "bfloat16")
    assert any("dtype" in d for d in fingerprint_diff(fa, fb))


def test_all_finite_reads_the_exponent_bits_of_every_dtype_the_states_come_in():
    """The hand-over's finiteness check (eagle3.precision.all_finite): inf, -inf and NaN found at any position in
    bf16, fp16, float32 and fp8 (whose only non-finite patterns are NaN), the extremes and -0.0 pass."""
    import torch

    from eagle3.precision import all_finite

    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(3000, 50).to(dt)
        assert all_finite(x)
        for bad in (float("inf"), float("-inf"), float("nan")):
            for at in ((0, 0), (1234, 7), (2999, 49)):
                y = x.clone()
                y[at] = bad
                assert not all_finite(y, block=4096), (dt, bad, at)
        y = x.clone()
        y[0, 0], y[0, 1], y[-1, -1] = torch.finfo(dt).max, -torch.finfo(dt).max, -0.0
        assert all_finite(y)
    q = torch.randn(3000, 50).to(torch.float8_e4m3fn)
    assert all_finite(q)
    for nan in (0x7F, 0xFF):
        q2 = q.clone()
        q2.view(torch.uint8)[5, 5] = nan
        assert not all_finite(q2)
    q2.view(torch.uint8)[5, 5] = 0x7E  # 448, the largest finite e4m3fn
    assert all_finite(q2) and all_finite(torch.empty(0, dtype=torch.bfloat16))
