"""Offline extraction end to end on tiny targets: exact states, refusal, SIGKILL resume, 2-rank split, online."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from models import kill_after_batches, make_prepared, tiny_deepseek_v3, tiny_llama, tiny_target_cfg

from eagle3.cache import CacheError, HiddenStateDataset, expected_fingerprint, summary
from eagle3.data.prepared import load_prepared
from eagle3.extract import preflight_disk, run
from eagle3.targets.hf import HFTarget

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("extract")
    return {"llama": tiny_llama(root / "llama"), "deepseek": tiny_deepseek_v3(root / "ds"),
            "prepared": make_prepared(root / "prepared", n=10, n_eval=3)}


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind,dtype", [("llama", "bfloat16"), ("deepseek", "float32")])
def test_offline_cache_equals_backend_states(world, tmp_path, kind, dtype):
    cfg = tiny_target_cfg(world[kind], world["prepared"], tmp_path, shard_samples=4, batch_tokens=80,
                          max_batch_size=3)
    cfg.target.dtype = dtype
    out = run(cfg)
    assert out["samples"] == 13 and out["shards"] == 3 + 1
    ds = HiddenStateDataset(cfg.cache_dir, "train", expected=expected_fingerprint(cfg.target, cfg.extract.storage, cfg.prepared_dir))
    prepared = load_prepared(world["prepared"])
    assert sorted(ds[i]["sample_id"] for i in range(len(ds))) == sorted(prepared.train["id"])
    assert len(HiddenStateDataset(cfg.cache_dir, "eval")) == 3
    backend = HFTarget(cfg.target, cfg.extract)
    want_dtype = getattr(torch, dtype)
    for i in (0, 5, 9):
        item = ds[i]
        row = prepared.train[prepared.train["id"].index(item["sample_id"])]
        assert item["input_ids"].tolist() == row["input_ids"] and item["loss_mask"].tolist() == row["loss_mask"]
        c = backend.capture([row["input_ids"]])[0]  # alone, no padding: batched extraction must agree
        assert item["aux"].dtype == want_dtype and item["aux"].shape == c.aux.shape
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 1.6e-2, "atol": 5e-2}
        torch.testing.assert_close(item["aux"], c.aux, **tol)
        torch.testing.assert_close(item["final"], c.final, **tol)
    # a second run finds everything done and touches nothing
    before = _files(cfg.cache_dir)
    assert run(cfg)["samples"] == 0
    assert _files(cfg.cache_dir) == before


def test_refuses_cache_with_other_fingerprint(world, tmp_path):
    cfg = tiny_target_cfg(world["llama"], world["prepared"], tmp_path, shard_samples=8)
    cfg.extract.max_samples = 2
    run(cfg)
    cfg.target.aux_layer_ids = [3, 4, 6]
    with pytest.raises(CacheError, match=r"(?s)layer ids \[2, 4, 5\] but the config asks for \[3, 4, 6\].*new "
                                         r"extract.cache_dir"):
        run(cfg)
    cfg.target.aux_layer_ids = None
    cfg.target.dtype = "bfloat16"
    with pytest.raises(CacheError, match="target dtype 'float32' but the config asks for 'bfloat16'"):
        run(cfg)


def test_a_lost_meta_json_is_rebuilt_only_from_what_the_shards_say(world, tmp_path):
    """Issue 27's first case: with meta.json deleted, extraction under other layer ids must not adopt the shards
    (the head would be trained on, and exported as, ids its features never came from); under the same config it
    rebuilds meta.json from the manifests and finds nothing to do."""
    cfg = tiny_target_cfg(world["llama"], world["prepared"], tmp_path, shard_samples=8)
    run(cfg)
    meta = (cfg.cache_dir / "meta.json").read_text()
    (cfg.cache_dir / "meta.json").unlink()
    shards = _files(cfg.cache_dir)
    cfg.target.aux_layer_ids = [3, 4, 6]
    with pytest.raises(CacheError, match=r"(?s)meta.json is missing, and the shards listed in .*rank-00000-of-00001"
                                         r".json were extracted for another job.*layer ids \[2, 4, 5\]"):
        run(cfg)
    assert not (cfg.cache_dir / "meta.json").exists() and _files(cfg.cache_dir) == shards
    cfg.target.aux_layer_ids = None
    assert run(cfg)["samples"] == 0  # the same job: meta.json rebuilt, every shard kept
    assert (cfg.cache_dir / "meta.json").read_text() == meta and len(HiddenStateDataset(cfg.cache_dir, "train")) == 10


def test_disk_preflight_refuses(tmp_path):
    with pytest.raises(CacheError, match="not enough disk"):
        preflight_disk(tmp_path, tokens=10**12, hidden_size=7168, dtype="bfloat16")
    preflight_disk(tmp_path, tokens=100, hidden_size=64, dtype="bfloat16")


def _write_cfg(world, out: Path, **extract) -> Path:
    cfg = _cfg_at(world, out, **extract)
    p = out / "cfg.yaml"
    out.mkdir(parents=True, exist_ok=True)
    p.write_text(cfg.to_yaml())
    return p


def _extract(cfg_path: Path, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in env.items()}}
    return subprocess.run([sys.executable, "extract.py", "--config", str(cfg_path)], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=300)


def _cfg_at(world, out: Path, **extract):
    return tiny_target_cfg(world["llama"], world["prepared"], out, shard_samples=3, batch_tokens=64,
                           max_batch_size=2, **extract)


@pytest.mark.parametrize("storage", ["exact", "fp8"])
def test_sigkill_then_resume_is_byte_identical(world, tmp_path, storage):
    # Reference: one uninterrupted run (in-process; same thread count and batches as the subprocess).
    run(_cfg_at(world, tmp_path / "ref", storage=storage))
    # A real SIGKILL after 3 forward batches: shard 0 (2 batches) committed, shard 1 half written.
    cfg_path = _write_cfg(world, tmp_path / "run", storage=storage)
    r = _extract(cfg_path, **kill_after_batches(3))
    assert r.returncode == -signal.SIGKILL, r.stderr
    cache = tmp_path / "run" / "cache"
    assert sorted(p.name for p in (cache / "train").glob("*.arrow")) == ["rank-00000-of-00001-shard-00000.arrow"]
    assert list((cache / "train").glob("*.tmp")), "the kill should have left a half-written shard behind"
    assert summary(cache)["splits"]["train"]["incomplete_ranks"] == [0]
    with pytest.raises(CacheError, match="incomplete"):
        HiddenStateDataset(cache, "train")
    # The same job again finishes it.
    out = run(_cfg_at(world, tmp_path / "run", storage=storage))
    assert out["samples"] == 10 - 3 + 3  # train shards 1..3 (3+3+1 samples) and the eval shard (3)
    assert not list(cache.rglob("*.tmp"))
    ref, got = _files(tmp_path / "ref" / "cache"), _files(cache)
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k] == ref[k], f"{k} differs from the uninterrupted run"
    ids = [HiddenStateDataset(cache, "train")[i]["sample_id"] for i in range(10)]
    assert len(set(ids)) == 10


def _check_two_ranks(cache: Path) -> None:
    assert yaml.safe_load((cache / "meta.json").read_text())["layout"]["world_size"] == 2
    for split, n in (("train", 10), ("eval", 3)):
        ds = HiddenStateDataset(cache, split)
        ids = [ds[i]["sample_id"] for i in range(len(ds))]
        assert len(ids) == n and len(set(ids)) == n
    assert {p.name.split("-shard")[0] for p in (cache / "train").glob("*.arrow")} == {
        "rank-00000-of-00002", "rank-00001-of-00002"}


def test_two_ranks_cover_every_sample_once(world, tmp_path, monkeypatch):
    cfg = _cfg_at(world, tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    run(cfg)
    with pytest.raises(CacheError, match=r"incomplete: rank\(s\) \[0\]"):
        HiddenStateDataset(cfg.cache_dir, "train")  # readers wait for every rank
    monkeypatch.setenv("RANK", "0")
    run(cfg)
    _check_two_ranks(cfg.cache_dir)
    assert run(cfg)["samples"] == 0  # rank 0 again: nothing to do


@pytest.mark.slow
def test_two_rank_processes_concurrently(world, tmp_path):
    cfg_path = _write_cfg(world, tmp_path)
    procs = [subprocess.Popen([sys.executable, "extract.py", "--config", str(cfg_path)], cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": "2"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    _check_two_ranks(tmp_path / "cache")


@pytest.mark.parametrize("dtype,max_batch", [("float32", 1), ("bfloat16", 1), ("float32", 3), ("bfloat16", 3)])
def test_online_equals_offline(world, tmp_path, dtype, max_batch):
    """Same sample, same states, whichever mode. Bit-exact when both compute one sequence per forward; with
    batching, the trainer's batches differ from the extraction's and CPU GEMMs pick their reduction order by
    shape, so the last bits may differ (same float tolerance as batched-vs-alone)."""
    from eagle3.online import OnlineBatches
    from eagle3.targets.argmax import ArgmaxHead

    cfg = tiny_target_cfg(world["llama"], world["prepared"], tmp_path, shard_samples=4, batch_tokens=80,
                          max_batch_size=max_batch)
    cfg.target.dtype = dtype
    run(cfg)
    cache = HiddenStateDataset(cfg.cache_dir, "train")
    prepared = load_prepared(world["prepared"])
    index_batches = [[7, 0, 3], [9], [1, 2, 4, 5, 6, 8]]  # the trainer's choice, unlike the extraction batches
    seen = 0
    backend = HFTarget(cfg.target, cfg.extract)
    online = OnlineBatches(backend, prepared.train, index_batches, ArgmaxHead.for_backend(backend, cfg.target, cfg.extract.teacher_chunk), prefetch=2)
    where = {cache[i]["sample_id"]: i for i in range(len(cache))}
    for idx, items in zip(index_batches, online, strict=True):
        assert [it["sample_id"] for it in items] == [prepared.train[i]["id"] for i in idx]
        for it in items:
            off = cache[where[it["sample_id"]]]
            assert off.keys() == it.keys()
            for k in ("input_ids", "loss_mask", "aux", "final", "target_argmax"):
                assert it[k].dtype == off[k].dtype and it[k].shape == off[k].shape, (it["sample_id"], k)
                if k == "target_argmax" and max_batch > 1 and dtype == "bfloat16":
                    # bf16 states that differ in their last bits may flip a near-tie of the argmax
                    assert (it[k] == off[k]).float().mean() >= 0.9, it["sample_id"]
                elif max_batch == 1 or k in ("input_ids", "loss_mask", "target_argmax"):
                    assert torch.equal(it[k], off[k]), (it["sample_id"], k)
                else:
                    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 1.6e-2, "atol": 5e-2}
                    torch.testing.assert_close(it[k], off[k], **tol)
            seen += 1
    assert seen == 10


def test_online_propagates_errors_and_stops(world, tmp_path):
    from eagle3.online import OnlineBatches

    class Broken:
        def capture(self, seqs):
            raise ValueError("target fell over")

    prepared = load_prepared(world["prepared"])
    with pytest.raises(RuntimeError, match="online target failed") as e:
        list(OnlineBatches(Broken(), prepared.train, [[0], [1]], argmax=None, prefetch=1))
    assert "target fell over" in str(e.value.__cause__)
