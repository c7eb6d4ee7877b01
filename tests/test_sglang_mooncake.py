"""Online training across machines through the Mooncake Store, against the real SGLang 0.5.23 on CPU: two capture
servers and two trainer "machines" (`accelerate launch --num_machines 2`, gloo), a real `mooncake_master`, and dump
folders the trainers do not read (so only the store can deliver).

    bash scripts/setup_sglang_cpu.sh && pytest -q -m sglang tests/test_sglang_mooncake.py

The servers run `--max-running-requests 1`, so every prompt is prefilled alone and its states are the same bytes
whichever server, request or batch carried it (SGLang batches several prompts into one forward otherwise, and a
float32 matmul over more rows rounds differently in the last bit): that is what makes "byte for byte" and "the
same losses" checkable. What runs:
- the items the two trainers are handed equal the offline cache's (extracted through the dump folder, the `shm`
  path), byte for byte, and the losses and the checkpoint of 4 steps equal offline training's;
- a trainer machine SIGKILLed after a checkpoint and both started again: the same bytes as the uninterrupted run;
- one of the two servers SIGKILLed mid-epoch: the run finishes on the other, failovers logged, every sample handed
  over as often as in the uninterrupted run, and the same checkpoint;
- nothing left in the store after a run;
- the master killed mid-run: the trainer stops within 30 s with a one-line error naming it, no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from models import checkpoint_differences, kill_after_checkpoint
from safetensors.torch import load_file
from store_master import running_master
from test_multinode import _machines, _run
from test_sglang_real import (  # noqa: F401 - sglang_env: the module's autouse fixture
    DEVICE,
    IDS,
    REPO,
    base_cfg,
    build_target,
    chats,
    sglang_env,
    write_cfg,
)
from test_trainer import read_log

from eagle3.targets.mooncake import StateStore, StoreAddress

pytestmark = pytest.mark.sglang

HOOKS = REPO / "tests" / "killhook"
STEPS = 4


@pytest.fixture(scope="module")
def rig(tmp_path_factory, sglang_env):  # noqa: F811
    """A master, two llama servers handing over through it, prepared data and the offline cache (shm path)."""
    from eagle3.extract import run as extract
    from eagle3.prepare import run as prepare
    from eagle3.targets.sglang import capture_flags, server_env
    from eagle3.targets.sglang_server import SGLangServer

    root = tmp_path_factory.mktemp("mooncake")
    target = build_target("llama", root / "target")
    cfg = base_cfg("llama", 1, root, target, chats(root / "chats.jsonl"))
    cfg.target.sglang.launch_args += ["--max-running-requests", "1"]
    cfg.cpu_threads = 1  # exact comparisons need one summation order
    tr = cfg.train
    tr.max_steps, tr.save_every, tr.eval_every = STEPS, 2, 100
    prepare(cfg)
    with running_master(root / "master") as master:
        cfg.target.sglang.mooncake = master.settings
        cfg.target.sglang.mooncake.clients = 2
        store = (StoreAddress.of(master.settings), 256 << 20)
        servers = []
        try:
            for i in (0, 1):
                if DEVICE == "cpu":
                    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = str(i)  # one core each
                dump = root / f"server{i}-dump"
                servers.append(SGLangServer(capture_flags(cfg.target, cfg.data.max_length, str(target)),
                                            server_env(dump, IDS["llama"], "llama", store), root / f"server{i}.log",
                                            timeout_s=900, what=f"server {i}"))
            offline = cfg.model_copy(deep=True)
            offline.target.sglang.url, offline.target.sglang.dump_dir = servers[0].url, str(root / "server0-dump")
            offline.output_dir = str(root / "offline")
            offline.data.output_dir, offline.extract.cache_dir = str(cfg.prepared_dir), str(root / "cache")
            # One sample a shard: the cache then holds the samples in the prepared split's order, so offline training
            # plans the very batches online training plans (a shard otherwise stores its samples by length).
            offline.extract.shard_samples = 1
            extract(offline)
            online = offline.model_copy(deep=True)
            online.output_dir, online.extract.mode = str(root / "online"), "online"
            s = online.target.sglang
            s.transport, s.url, s.dump_dir = "mooncake", [v.url for v in servers], str(root / "trainer-dump")
            yield {"root": root, "master": master, "servers": servers, "offline": offline, "online": online}
        finally:
            for v in servers:
                v.close()


def _launch(rig, cfg, name: str, machine1: dict[str, str] | None = None, record: bool = True) -> tuple[list[int], Path]:
    """The two trainer machines on `cfg` (written as `name`), each item they are handed recorded under
    `<name>-items`; their exit codes."""
    root = rig["root"]
    items = root / f"{name}-items"
    items.mkdir(exist_ok=True)
    both = {"PYTHONPATH": os.pathsep.join([str(HOOKS), str(REPO)])}
    if record:
        both["EAGLE3_TEST_RECORD_ONLINE"] = str(items)
    return _run(root, write_cfg(cfg, root / f"{name}.yaml"), root / name, machine1=machine1, both=both), items


def _recorded(items: Path) -> dict[str, list[dict[str, torch.Tensor]]]:
    got: dict[str, list] = {}
    for f in sorted(items.glob("*.safetensors")):
        sid = f.stem.split("-", 2)[2]
        got.setdefault(sid, []).append(load_file(str(f)))
    return got


def _left_in_store(rig) -> int:
    checker = StateStore(StoreAddress.of(rig["master"].settings), segment=0, what="the test")
    try:
        return checker.remove_prefix("eagle3/")
    finally:
        checker.close()


def test_two_trainer_machines_get_the_offline_cache_bytes_and_train_the_same(rig):
    from eagle3.cache import HiddenStateDataset

    offline, online = rig["offline"], rig["online"]
    codes, _ = _launch(rig, offline, "offline-run", record=False)
    assert codes == [0, 0]
    codes, items = _launch(rig, online, "online-run")
    assert codes == [0, 0]
    machine0 = (rig["root"] / "online-run.machine0.log").read_text()
    assert "through the Mooncake Store" in machine0 and "2 process(es)" in machine0
    assert not any((rig["root"] / "trainer-dump").glob("*.safetensors"))

    recorded = _recorded(items)
    cache = {}
    for split in ("train", "eval"):
        ds = HiddenStateDataset(offline.cache_dir, split)
        cache.update({ds[i]["sample_id"]: ds[i] for i in range(len(ds))})
    assert recorded and set(recorded) <= set(cache)
    for sid, copies in recorded.items():
        ref = cache[sid]
        for got in copies:
            for key in ("input_ids", "aux", "final", "target_argmax"):
                assert torch.equal(got[key], ref[key].to(got[key].dtype)), (sid, key)
    a, b = read_log(Path(offline.output_dir)), read_log(Path(online.output_dir))
    assert sorted(b) == list(range(1, STEPS + 1))
    assert [b[s]["loss"] for s in sorted(b)] == [a[s]["loss"] for s in sorted(a)]
    assert checkpoint_differences(offline.checkpoint_dir / f"step_{STEPS}", online.checkpoint_dir / f"step_{STEPS}") \
        == []
    assert _left_in_store(rig) == 0


def test_a_killed_trainer_machine_resumes_to_the_same_bytes(rig):
    online = rig["online"]
    if not (online.checkpoint_dir / f"step_{STEPS}").is_dir():
        pytest.skip("needs the uninterrupted online run of the test above")
    crashed = online.model_copy(deep=True)
    crashed.output_dir = str(rig["root"] / "crashed")
    codes, _ = _launch(rig, crashed, "crashed-run", machine1=kill_after_checkpoint(2), record=False)
    assert codes[0] != 0 and codes[1] != 0, codes
    assert sorted(read_log(Path(crashed.output_dir)))[-1] == 2, "the run went past the kill"
    codes, _ = _launch(rig, crashed, "crashed-run", record=False)
    assert codes == [0, 0]
    assert checkpoint_differences(online.checkpoint_dir / f"step_{STEPS}", crashed.checkpoint_dir / f"step_{STEPS}") \
        == []
    assert _left_in_store(rig) == 0  # the killed machine's unread states removed by its restart


def test_a_server_killed_mid_epoch_the_run_finishes_on_the_other(rig):
    online = rig["online"]
    if not (online.checkpoint_dir / f"step_{STEPS}").is_dir():
        pytest.skip("needs the uninterrupted online run of the first test")
    failover = online.model_copy(deep=True)
    failover.output_dir = str(rig["root"] / "failover")
    root = rig["root"]
    items = root / "failover-run-items"
    items.mkdir()
    victim = rig["servers"][1]

    def kill_when_half_done() -> None:
        t0 = time.monotonic()
        while len(list(items.glob("*.safetensors"))) < 6 and time.monotonic() - t0 < 600:
            time.sleep(0.2)
        os.killpg(victim.proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_half_done, daemon=True)
    killer.start()
    procs = _machines(root, write_cfg(failover, root / "failover-run.yaml"), root / "failover-run",
                      both={"PYTHONPATH": os.pathsep.join([str(HOOKS), str(REPO)]),
                            "EAGLE3_TEST_RECORD_ONLINE": str(items)})
    codes = [p.wait(900) for p in procs]
    killer.join(timeout=60)
    logs = "".join((root / f"failover-run.machine{r}.log").read_text() for r in (0, 1))
    assert codes == [0, 0], logs[-4000:]
    assert victim.proc.poll() is not None and f"SGLang server {victim.url} failed a request" in logs
    uninterrupted = Counter(f.stem.split("-", 2)[2] for f in (root / "online-run-items").glob("*.safetensors"))
    assert Counter(f.stem.split("-", 2)[2] for f in items.glob("*.safetensors")) == uninterrupted
    assert checkpoint_differences(online.checkpoint_dir / f"step_{STEPS}", failover.checkpoint_dir / f"step_{STEPS}") \
        == []


def test_a_dead_master_stops_training_in_one_line(rig):
    """Last: the module's master is killed under a running trainer (one process, `eagle3 train`)."""
    alive = [v for v in rig["servers"] if v.proc.poll() is None]
    cfg = rig["online"].model_copy(deep=True)
    cfg.output_dir, cfg.train.max_steps = str(rig["root"] / "no-master"), 10_000
    cfg.target.sglang.url = [v.url for v in alive]
    cfg_file = write_cfg(cfg, rig["root"] / "no-master.yaml")
    items = rig["root"] / "no-master-items"
    items.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOKS), str(REPO)]), "EAGLE3_TEST_RECORD_ONLINE": str(items)}
    proc = subprocess.Popen([sys.executable, "-m", "eagle3.cli", "train", "--config", str(cfg_file)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not any(items.glob("*.safetensors")) and time.monotonic() - t0 < 600:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    rig["master"].kill()
    killed = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and time.monotonic() - killed < 30, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: the Mooncake master at {cfg.target.sglang.mooncake.master}") and \
        "stopped answering" in last, err[-3000:]
