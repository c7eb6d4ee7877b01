"""Damaged files the pipeline reads, through the real entry points: cache shards (bytes flipped in place, cut
short, deleted), prepared data, checkpoints, a config that changed the data since `prepare`, a format-1 cache and
an SGLang URL nobody listens at. Each gives one `error:` block naming the file or key and the fix (exit 1, no
traceback), or repairs itself when the same command runs again; none trains on, or exports, what it read wrong.

    pytest -q -m slow tests/reliability/test_rel_damage.py
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
from rel_world import CLI, EXTRACT, TRAIN, env, error_block, no_traceback, run_cmd, shared_world, tree_bytes, write_cfg
from test_ddp import PORT, run_launcher  # a free port, again on a fresh one if another process takes it

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny world, prepared and extracted once (in process); each test copies what it damages."""
    return shared_world(tmp_path_factory.mktemp("damage"))


def _own(world, tmp_path: Path, *, cache: bool = True, prepared: bool = False, **edits) -> tuple[dict, Path]:
    """A config of the tiny world whose cache (and prepared data) are copies in tmp_path, free to damage."""
    cfgd = json.loads(json.dumps(world["cfgd"]))
    cfgd["output_dir"] = str(tmp_path / "run")
    if cache:
        shutil.copytree(world["cache"], tmp_path / "cache")
        cfgd["extract"]["cache_dir"] = str(tmp_path / "cache")
    if prepared:
        shutil.copytree(world["prepared"], tmp_path / "prepared")
        cfgd["data"]["output_dir"] = str(tmp_path / "prepared")
    for dotted, value in edits.items():
        section, key = dotted.split("__")
        cfgd[section][key] = value
    return cfgd, write_cfg(tmp_path / "cfg.yaml", cfgd)


def _flip(path: Path, at: int, n: int = 65536) -> None:
    """64 KiB of garbage in place, same size (a bad copy, a failing disk)."""
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in old))


def _one_error(r, *needles: str) -> str:
    assert r.returncode == 1 and no_traceback(r.stderr), (r.returncode, r.stderr[-3000:])
    block = error_block(r.stderr)
    for needle in needles:
        assert needle in block, (needle, block)
    return block


# ------------------------------------------------------------------------------------------------ cache shards
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_shard_is_named_by_every_reader_and_re_extracted(world, tmp_path, damage):
    cfgd, cfg = _own(world, tmp_path)
    cache = tmp_path / "cache"
    before = tree_bytes(cache)
    shard = sorted((cache / "train").glob("*.arrow"))[1]
    size = shard.stat().st_size
    if damage == "flip":
        _flip(shard, size // 2, min(65536, size // 4))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: size // 2])
    else:
        shard.unlink()
    name = f"train/{shard.name}"
    fix = "Re-run the same `eagle3 extract --config ...` command: it re-extracts exactly those shards."
    # `cache info` checks sizes for free; `--verify` also every checksum
    r = run_cmd([*CLI, "cache", "info", str(cache)])
    if damage == "flip":
        assert r.returncode == 0 and "present at their recorded sizes" in r.stdout, r.stderr[-2000:]
    else:
        _one_error(r, name, fix)
    _one_error(run_cmd([*CLI, "cache", "info", str(cache), "--verify"]), name, fix)
    # the trainer checks every checksum before it starts: no checkpoint, no head
    _one_error(run_cmd([*TRAIN, "--config", str(cfg)]), name, fix)
    assert not (tmp_path / "run" / "checkpoints").exists()
    # the same extract command re-extracts exactly that shard: the cache is whole again, byte for byte
    r = run_cmd([*EXTRACT, "--config", str(cfg)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{name}:" in r.stderr and "it will be extracted again" in r.stderr
    assert tree_bytes(cache) == before
    assert run_cmd([*CLI, "cache", "info", str(cache), "--verify"]).returncode == 0


def test_a_format_1_cache_is_refused_with_the_command_that_upgrades_it(world, tmp_path):
    cfgd, cfg = _own(world, tmp_path)
    meta_file = tmp_path / "cache" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["fingerprint"]["format"] = 1
    meta_file.write_text(json.dumps(meta))
    for cmd in ([*TRAIN, "--config", str(cfg)], [*EXTRACT, "--config", str(cfg)], [*CLI, "cache", "info",
                                                                                   str(tmp_path / "cache")]):
        _one_error(run_cmd(cmd), "is format 1", f"eagle3 cache upgrade {tmp_path / 'cache'} --config")


# ----------------------------------------------------------------------------------------------- prepared data
def test_a_damaged_prepared_file_is_named_and_prepare_rebuilds_it(world, tmp_path):
    cfgd, cfg = _own(world, tmp_path, prepared=True)
    from eagle3.data.prepared import load_prepared

    prepared = tmp_path / "prepared"
    arrow = sorted((prepared / "train").glob("*.arrow"))[0]
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    for cmd in ([*EXTRACT, "--config", str(cfg)], [*TRAIN, "--config", str(cfg)]):
        _one_error(run_cmd(cmd), f"the prepared data in {prepared} is damaged", f"train/{arrow.name}",
                   "re-run `eagle3 prepare --config ...`")
    r = run_cmd([*CLI, "prepare", "--config", str(cfg)])
    assert r.returncode == 0 and "reusing" not in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "damaged" in r.stderr and "rebuilding" in r.stderr
    again, original = load_prepared(prepared), load_prepared(world["prepared"])
    assert again.train.to_dict() == original.train.to_dict() and again.eval.to_dict() == original.eval.to_dict()
    assert run_cmd([*TRAIN, "--config", str(cfg)]).returncode == 0  # the cache of the same samples stays valid


def test_a_missing_prepared_meta_json_says_to_prepare_not_to_delete_the_cache(world, tmp_path):
    cfgd, cfg = _own(world, tmp_path, prepared=True)
    (tmp_path / "prepared" / "meta.json").unlink()
    for cmd in ([*EXTRACT, "--config", str(cfg)], [*TRAIN, "--config", str(cfg)]):
        block = _one_error(run_cmd(cmd), f"no prepared data in {tmp_path / 'prepared'}", "eagle3 prepare")
        assert "delete" not in block and "extract.cache_dir" not in block


@pytest.mark.parametrize("stage,key,value,label", [
    ("extract", "data__max_length", 64, "data.max_length: prepared with 96, this config has 64"),
    ("train", "data__max_length", 64, "data.max_length: prepared with 96, this config has 64"),
    ("train", "draft__vocab_size", 100, "draft.vocab_size: prepared with 320, this config has 100"),
    ("extract", "data__chat_template", "llama3", "data.chat_template: prepared with"),
])
def test_a_config_that_changed_the_data_since_prepare_is_refused(world, tmp_path, stage, key, value, label):
    cfgd, cfg = _own(world, tmp_path, **{key: value})
    cmd = [*EXTRACT, "--config", str(cfg)] if stage == "extract" else [*TRAIN, "--config", str(cfg)]
    _one_error(run_cmd(cmd), "was made from another config than this one", label,
               f"Re-run `eagle3 prepare --config ...` with this config before `eagle3 {stage}`")


def test_extraction_does_not_care_about_the_draft_vocab(world, tmp_path):
    """The states do not depend on the draft vocab: `extract` with another draft.vocab_size has nothing to do."""
    cfgd, cfg = _own(world, tmp_path, draft__vocab_size=100)
    r = run_cmd([*EXTRACT, "--config", str(cfg)])
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr[-2000:]


# ------------------------------------------------------------------------------------------------- checkpoints
def test_resume_falls_back_to_the_newest_intact_checkpoint(world, tmp_path):
    """The newest step's weights cut short: resume names it, starts from the step before, and writes step 6
    again, intact and byte for byte the uninterrupted run's (the data plan is a function of the step)."""
    from eagle3.checkpoints import checkpoint_problems

    cfgd, cfg = _own(world, tmp_path, cache=False, train__max_steps=6, train__keep_checkpoints=3)
    r = run_cmd([*TRAIN, "--config", str(cfg)])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpts = tmp_path / "run" / "checkpoints"
    uninterrupted = tree_bytes(ckpts / "step_6")  # weights, optimizer, scheduler, RNG, trainer state, draft/
    weights = ckpts / "step_6" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    r = run_cmd([*TRAIN, "--config", str(cfg)])
    assert r.returncode == 0 and no_traceback(r.stderr), r.stderr[-3000:]
    assert f"checkpoint {ckpts / 'step_6'} is damaged (model.safetensors: 1000 bytes where" in r.stderr
    assert f"resumed from {ckpts / 'step_4'}" in r.stderr
    assert checkpoint_problems(ckpts / "step_6") == []
    again = tree_bytes(ckpts / "step_6")
    assert again.keys() == uninterrupted.keys()
    assert [f for f in uninterrupted if again[f] != uninterrupted[f]] == []
    # every checkpoint damaged: one error, nothing overwritten
    for step in (2, 4, 6):
        (ckpts / f"step_{step}" / "trainer_state.json").write_text("{not json")
    _one_error(run_cmd([*TRAIN, "--config", str(cfg)]), f"every checkpoint in {ckpts} is damaged",
               "train.resume=false")


# ----------------------------------------------------------------------------------------------------- engines
def test_an_sglang_url_nobody_listens_at_fails_in_seconds(world, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfgd, cfg = _own(world, tmp_path)
    cfgd["target"] = {**cfgd["target"], "backend": "sglang",
                      "sglang": {"url": f"http://127.0.0.1:{port}", "dump_dir": str(tmp_path / "dump")}}
    cfgd["extract"]["cache_dir"] = str(tmp_path / "new-cache")
    t0 = time.monotonic()
    r = run_cmd([*EXTRACT, "--config", str(write_cfg(tmp_path / "cfg.yaml", cfgd))])
    assert time.monotonic() - t0 < 60
    _one_error(r, f"nothing answers at target.sglang.url=http://127.0.0.1:{port}", "eagle3 sglang serve")


# ------------------------------------------------------------------------------------------ under the launcher
def test_under_accelerate_launch_the_error_is_the_launchers_root_cause(world, tmp_path):
    """Two processes (gloo): every rank exits 1 with its one-line error (never SIGABRT from a process group torn
    down at exit), and the launcher's failure summary, the last thing a user reads, shows that error as the root
    cause instead of a bare exit status."""
    cfgd, cfg = _own(world, tmp_path)
    _flip(sorted((tmp_path / "cache" / "train").glob("*.arrow"))[0], 100, 64)
    launch = [CLI[0], "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
              "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", PORT]
    r = run_launcher([*launch, TRAIN[1], "--config", str(cfg)], env(ACCELERATE_USE_CPU="true"), timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "SIGABRT" not in r.stderr and "terminate called" not in r.stderr, r.stderr[-3000:]
    summary = r.stderr[r.stderr.index("Root Cause"):]
    assert "exitcode  : 1" in summary and "traceback : error: cache" in summary and "SHA-256 differs" in summary
