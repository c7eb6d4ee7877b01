"""Disk full during extraction and checkpointing, on a real size-limited filesystem (a tmpfs mounted here).

    pytest -q -m slow tests/reliability/test_rel_diskfull.py      # needs root (mount -t tmpfs); skipped otherwise

What must hold: the entry point exits with status 1 and one `error: disk full ...` line (no traceback from deep
inside pyarrow/safetensors/torch), the cache / the last checkpoint stay valid, no temporary file is left, and
re-running the same command after space is freed completes with the same result as a run that never failed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from rel_world import (
    CLI,
    TRAIN,
    extracted_world,
    no_traceback,
    run_cmd,
    temp_leftovers,
    tree_bytes,
    write_cfg,
)

from eagle3.config import load_config

pytestmark = pytest.mark.slow


class Tmpfs:
    """A tmpfs of a given size at `path`; `resize` grows it in place (frees space without touching files)."""

    def __init__(self, path: Path, size: str):
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); run as root to test a full disk")
        self.path = path

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    disks: list[Tmpfs] = []

    def make(size: str) -> Tmpfs:
        disks.append(Tmpfs(tmp_path / f"disk{len(disks)}", size))
        return disks[-1]

    yield make
    for d in disks:
        d.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny world, prepared, with a reference cache extracted on a normal disk."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("diskfull")
    w, cfgd = extracted_world(root, "ref", shared_cache=False)
    return {**w, "cfgd": cfgd, "ref_cache": root / "ref" / "cache"}


def _error_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("error:")]


def test_extract_disk_full_clear_error_valid_cache_then_resume(world, tmp_path, small_disk):
    disk = small_disk("3m")  # the cache needs ~5.7 MB
    cfgd = json.loads(json.dumps(world["cfgd"]))
    cache = disk.path / "cache"
    cfgd["extract"]["cache_dir"] = str(cache)
    cfg_path = write_cfg(tmp_path / "cfg.yaml", cfgd)

    # 1. The preflight sees it coming: one line, before loading the target or writing any shard.
    r = run_cmd([*CLI, "extract", "--config", str(cfg_path)])
    assert r.returncode == 1 and no_traceback(r.stderr), r.stderr[-3000:]
    (line,) = _error_lines(r.stderr)
    assert "not enough disk" in line and str(cache) in line and "GB needed" in line
    assert not list(cache.rglob("*.arrow"))

    # 2. Without the preflight (or when the estimate is wrong) the disk fills mid-shard.
    cmd = [*CLI, "extract", "--config", str(cfg_path), "extract.preflight=false"]
    r = run_cmd(cmd)
    assert r.returncode == 1 and no_traceback(r.stderr), r.stderr[-3000:]
    (line,) = _error_lines(r.stderr)
    assert "disk full while writing" in line and str(cache / "train") in line and "GB is still needed" in line
    assert temp_leftovers(cache) == [], "the half-written shard must be removed"
    committed = tree_bytes(cache, skip=lambda p: p.suffix != ".arrow")
    assert committed, "some shards should have been committed before the disk filled"
    ref = tree_bytes(world["ref_cache"])
    for name, data in committed.items():  # every committed shard is whole and exactly the reference bytes
        assert data == ref[name], name
    from eagle3.cache import HiddenStateDataset

    part = HiddenStateDataset(cache, "train", allow_incomplete=True)
    assert 0 < len(part) < 54 and all(torch.isfinite(part[i]["aux"]).all() for i in range(len(part)))

    # 3. Space is freed: the same command resumes and the cache equals the one that never failed.
    disk.resize("20m")
    r = run_cmd(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert tree_bytes(cache) == ref


def _losses(out: Path) -> dict[int, float]:
    rows = {}
    for line in (out / "train_log.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            rows[r["step"]] = r["loss"]
    return rows


@pytest.fixture(scope="module")
def full_checkpoint_run(world, tmp_path_factory):
    """A training run whose output folder fills up while writing a checkpoint (each is ~1.2 MB), next to a
    reference run of the same config on a normal disk."""
    from eagle3.trainer import run as train

    tmp_path = tmp_path_factory.mktemp("ckpt-full")
    ref = json.loads(json.dumps(world["cfgd"]))
    ref["extract"]["cache_dir"] = str(world["ref_cache"])
    ref["output_dir"] = str(tmp_path / "ref")
    train(load_config(write_cfg(tmp_path / "ref.yaml", ref)))

    disk = Tmpfs(tmp_path / "disk", "2500k")
    cfgd = {**ref, "output_dir": str(disk.path / "run")}
    cfg_path = write_cfg(tmp_path / "cfg.yaml", cfgd)
    r = run_cmd([*TRAIN, "--config", str(cfg_path)])
    yield {"disk": disk, "cfg_path": cfg_path, "run": disk.path / "run", "ref": tmp_path / "ref", "first": r}
    disk.close()


def test_checkpoint_disk_full_keeps_the_last_checkpoint_and_resumes(full_checkpoint_run):
    from eagle3.checkpoints import STATE_FILE, list_checkpoints
    from eagle3.formats import load_draft

    f = full_checkpoint_run
    assert f["first"].returncode == 1, f["first"].stderr[-3000:]
    ckpts = list_checkpoints(f["run"] / "checkpoints")
    assert ckpts, "at least one checkpoint should have fit"
    step, last = ckpts[-1]
    assert json.loads((last / STATE_FILE).read_text())["step"] == step
    load_draft(last / "draft")  # loads: the last checkpoint is whole

    f["disk"].resize("30m")
    r = run_cmd([*TRAIN, "--config", str(f["cfg_path"])])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {last}" in r.stderr
    want, got = _losses(f["ref"]), _losses(f["run"])
    assert sorted(got) == sorted(want)
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-6), s
    assert temp_leftovers(f["run"]) == []


def test_checkpoint_disk_full_is_one_line_naming_the_checkpoint_and_the_space_needed(full_checkpoint_run):
    r = full_checkpoint_run["first"]
    assert r.returncode == 1 and no_traceback(r.stderr)
    (line,) = _error_lines(r.stderr)
    assert "checkpoints/" in line and "MB needed" in line
