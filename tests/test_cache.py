"""The Arrow cache: bit-exact 16-bit round trip, zero-copy reads, fingerprint refusal, info."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eagle3.cache import (
    CacheError,
    HiddenStateDataset,
    Manifest,
    ShardWriter,
    check_fingerprint,
    print_info,
    shard_name,
    verify_cache,
)
from eagle3.fsutil import write_json_atomic

H = 8


def _fingerprint(dtype: str = "bfloat16") -> dict:
    return {"format": 2, "storage": "exact", "target_path": "t", "revision": None, "weights_id": "w", "architectures": ["X"],
            "num_layers": 6, "hidden_size": H, "dtype": dtype, "layer_ids": [2, 3, 4],
            "layer_id_convention": "input-of-layer", "prepared_fingerprint": "p", "max_length": 64}


def _special(t: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(t, width, generator=torch.Generator().manual_seed(seed)) * 3
    flat = x.view(-1)
    specials = [2.5e4, -2.5e4, 1e-8, -1e-8, 1e-40, -0.0, 0.0, float("inf"), float("-inf"), 65504.0, 3e38]
    n = min(len(specials), flat.numel())
    flat[:n] = torch.tensor(specials[:n])
    return x.to(dtype)


def _write_cache(root, dtype: torch.dtype, samples: list[int], per_batch: int = 2, world: int = 1) -> list[dict]:
    fp = _fingerprint(str(dtype).removeprefix("torch."))
    (root / "train").mkdir(parents=True)
    (root / "eval").mkdir()
    write_json_atomic(root / "meta.json", {"fingerprint": fp, "layout": {"world_size": world}})
    rows = [{"sample_id": f"s{i}", "input_ids": list(range(3, 3 + t)), "loss_mask": [i % 2] * t,
             "aux": _special(t, 3 * H, dtype, i), "final": _special(t, H, dtype, 100 + i),
             "target_argmax": list(range(t))} for i, t in enumerate(samples)]
    w = ShardWriter(root / "train" / shard_name(0, world, 0), H, dtype)
    for k in range(0, len(rows), per_batch):
        w.write(rows[k: k + per_batch])
    entry = w.commit(0)
    assert not w.tmp.exists() and entry.num_samples == len(rows) and entry.num_tokens == sum(samples)
    Manifest("train", 0, world, len(rows), 1, [entry]).save(root)
    Manifest("eval", 0, world, 0, 0).save(root)
    return rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    rows = _write_cache(tmp_path, dtype, [5, 1, 9, 4, 7])
    ds = HiddenStateDataset(tmp_path, "train")
    assert len(ds) == 5 and ds.lengths == [5, 1, 9, 4, 7]
    for i, r in enumerate(rows):
        item = ds[i]
        assert item["sample_id"] == r["sample_id"]
        assert item["aux"].dtype == dtype and item["aux"].shape == r["aux"].shape
        assert item["final"].shape == r["final"].shape
        bits = torch.int16 if dtype != torch.float32 else torch.int32
        # bit patterns, so -0.0 vs 0.0 and subnormals count
        assert torch.equal(item["aux"].view(bits), r["aux"].view(bits))
        assert torch.equal(item["final"].view(bits), r["final"].view(bits))
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].tolist() == r["input_ids"]
        assert item["loss_mask"].tolist() == r["loss_mask"]
    if dtype == torch.bfloat16:
        a = ds[0]["aux"].view(-1)
        assert a[0].item() == pytest.approx(24960.0)  # bf16(2.5e4)
        assert torch.signbit(a[5]) and a[5].item() == 0.0  # -0.0 survives
        assert a[4].item() != 0.0 and abs(a[4].item()) < 1.2e-38  # subnormal kept
        assert torch.isinf(a[7]) and torch.isinf(a[8])


def test_reads_are_zero_copy_views_of_the_mapping(tmp_path):
    _write_cache(tmp_path, torch.bfloat16, [6, 6])
    ds = HiddenStateDataset(tmp_path, "train")
    a, b = ds[0]["aux"], ds[0]["aux"]
    assert a.data_ptr() == b.data_ptr()  # same mapped bytes, no copy per access
    batch = ds._batches[0]
    assert a.data_ptr() == batch.states["aux"].ctypes.data


def test_shards_are_readable_by_datasets(tmp_path):
    from datasets import Dataset

    _write_cache(tmp_path, torch.bfloat16, [3, 4])
    d = Dataset.from_file(str(tmp_path / "train" / shard_name(0, 1, 0)))
    assert d["sample_id"] == ["s0", "s1"] and d["num_tokens"] == [3, 4]
    assert np.asarray(d[1]["aux"]).shape == (4, 3 * H)


def test_fingerprint_mismatch_names_the_field(tmp_path):
    _write_cache(tmp_path, torch.bfloat16, [3])
    check_fingerprint(tmp_path, _fingerprint())
    want = {**_fingerprint(), "layer_ids": [3, 3, 4]}
    with pytest.raises(CacheError, match=r"layer ids \[2, 3, 4\] but the config asks for \[3, 3, 4\]"):
        check_fingerprint(tmp_path, want)
    with pytest.raises(CacheError, match="target dtype 'bfloat16' but the config asks for 'float32'"):
        HiddenStateDataset(tmp_path, "train", expected={**_fingerprint(), "dtype": "float32"})


def test_incomplete_cache_refused_and_reported(tmp_path, capsys):
    _write_cache(tmp_path, torch.bfloat16, [3, 5], world=2)  # rank 1 of 2 never wrote anything
    with pytest.raises(CacheError, match=r"incomplete: rank\(s\) \[1\]"):
        HiddenStateDataset(tmp_path, "train")
    assert len(HiddenStateDataset(tmp_path, "train", allow_incomplete=True)) == 2  # what rank 0 finished
    print_info(tmp_path)
    assert "INCOMPLETE" in capsys.readouterr().out


def test_print_info(tmp_path, capsys):
    _write_cache(tmp_path, torch.bfloat16, [10, 20])
    print_info(tmp_path)
    out = capsys.readouterr().out
    assert "train: 2 samples, 30 tokens" in out
    assert f"payload minimum {4 * H * 2 + 5}" in out
    assert "layer ids: [2, 3, 4]" in out and "complete" in out


# -------------------------------------------------------------------------------------------------- integrity
def _flip(path, at: int, n: int = 64) -> None:
    """Overwrite n bytes in place (same size): what a bad copy or a failing disk leaves."""
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in old))


def test_a_shard_damaged_in_place_is_found_by_its_checksum(tmp_path, capsys):
    _write_cache(tmp_path, torch.bfloat16, [10, 20, 30])
    assert print_info(tmp_path, verify=True) == 0
    assert "integrity: all 1 shards intact" in capsys.readouterr().out
    shard = tmp_path / "train" / shard_name(0, 1, 0)
    _flip(shard, shard.stat().st_size // 2)
    assert len(HiddenStateDataset(tmp_path, "train")) == 3  # size and rows still match: only the checksum knows
    with pytest.raises(CacheError, match=rf"1 shard\(s\) are missing or damaged:\n  train/{shard.name}: its "
                                         r"SHA-256 differs.*\nRe-run the same `eagle3 extract"):
        print_info(tmp_path, verify=True)
    assert verify_cache(tmp_path, full=False) == []


@pytest.mark.parametrize("damage", ["truncate", "delete", "garbage-header"])
def test_a_cut_or_missing_shard_is_named_on_every_read(tmp_path, damage):
    _write_cache(tmp_path, torch.bfloat16, [10, 20, 30])
    shard = tmp_path / "train" / shard_name(0, 1, 0)
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    elif damage == "delete":
        shard.unlink()
    else:
        _flip(shard, 0, 16)
    want = {"truncate": r"\d+ bytes where the manifest records", "delete": "missing",
            "garbage-header": "unreadable"}[damage]
    with pytest.raises(CacheError, match=rf"train/{shard.name}: {want}"):
        HiddenStateDataset(tmp_path, "train")
    if damage != "garbage-header":  # the cheap check (size) already finds it
        assert verify_cache(tmp_path, full=False) == verify_cache(tmp_path) != []


def test_a_format_1_cache_is_refused_with_the_upgrade_command(tmp_path):
    _write_cache(tmp_path, torch.bfloat16, [3])
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["fingerprint"]["format"] = 1
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CacheError, match=rf"format 1; .*eagle3 cache upgrade {tmp_path} --config"):
        HiddenStateDataset(tmp_path, "train")


@pytest.mark.parametrize("seed", range(12))
def test_fuzzed_damage_is_always_found_and_never_a_library_traceback(tmp_path, seed):
    """Random damage to a shard (bytes flipped anywhere, cut anywhere, or deleted): the full check always finds
    it, and a reader either loads (damage the size check cannot see) or raises a CacheError naming the shard,
    never a pyarrow exception."""
    import random

    rng = random.Random(seed)
    _write_cache(tmp_path, torch.bfloat16, [rng.randint(1, 40) for _ in range(6)])
    shard = tmp_path / "train" / shard_name(0, 1, 0)
    size = shard.stat().st_size
    kind = ("flip", "cut", "delete")[seed % 3]
    if kind == "flip":
        _flip(shard, rng.randrange(size), rng.randint(1, 512))
    elif kind == "cut":
        shard.write_bytes(shard.read_bytes()[: rng.randrange(size)])
    else:
        shard.unlink()
    assert verify_cache(tmp_path) and verify_cache(tmp_path)[0].startswith(f"train/{shard.name}: ")
    try:
        ds = HiddenStateDataset(tmp_path, "train")
    except CacheError as e:
        assert f"train/{shard.name}" in str(e)
    else:
        assert kind == "flip" and len(ds) == 6
