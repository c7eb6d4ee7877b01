"""Tracking down or misconfigured never stops training: wandb online with an unreachable server, or with a
server that answers but is not wandb (and a bogus API key), through the real `train.py`. Training completes,
wandb falls back to offline (a run to `wandb sync` later) and the log says so.

    pytest -q -m slow tests/reliability/test_rel_tracking.py

WANDB_INIT_TIMEOUT=8 bounds the online attempt against the server that is not wandb (wandb's default is 90 s;
the trainer skips the online attempt when the server does not even accept a connection).
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from rel_world import REPO, TRAIN, env, extracted_world, write_cfg

pytestmark = pytest.mark.slow

CASES = {
    "unreachable": {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "0123456789abcdef" * 2 + "01234567"},
    "not-wandb-bogus-key": {"WANDB_BASE_URL": "<fake server>", "WANDB_API_KEY": "bogus"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both cases launched at once (they mostly wait on wandb), each with its own output folder."""
    def for_tracking(cfgd: dict) -> None:
        cfgd["train"].update(max_steps=3, eval_every=3)
        cfgd["tracking"] = {"backend": "wandb", "project": "eagle3-reliability"}

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tracking")
    _, cfgd = extracted_world(root, "x", edit=for_tracking)
    from fake_openai_server import FakeOpenAIServer

    server = FakeOpenAIServer().__enter__()  # answers HTTP, but 404 to everything wandb asks
    procs = {}
    for name, extra in CASES.items():
        extra = {k: (server.url.removesuffix("/v1") if v == "<fake server>" else v) for k, v in extra.items()}
        out = root / name
        path = write_cfg(root / f"{name}.yaml", {**cfgd, "output_dir": str(out)})
        procs[name] = (out, subprocess.Popen([*TRAIN, "--config", str(path)], cwd=REPO, text=True,
                                             env=env(WANDB_MODE="online", WANDB_INIT_TIMEOUT=8, WANDB_SILENT="true",
                                                     **extra),
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    results = {}
    try:
        for name, (out, p) in procs.items():
            text, _ = p.communicate(timeout=400)
            results[name] = {"out": out, "rc": p.returncode, "log": text}
    finally:
        server.__exit__(None, None, None)
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_training_completes_and_says_tracking_failed(runs, case):
    r = runs[case]
    assert r["rc"] == 0, r["log"][-3000:]
    steps = [json.loads(x)["step"] for x in (r["out"] / "train_log.jsonl").read_text().splitlines()
             if "loss" in json.loads(x)]
    assert steps == [1, 2, 3]
    assert (r["out"] / "checkpoints" / "step_3" / "trainer_state.json").is_file()
    assert "WARNING wandb" in r["log"], r["log"][-3000:]




BOGUS_KEY_OFFLINE = pytest.mark.xfail(strict=True, reason=(
    "eagle3/tracking.py init_tracking now drops the malformed WANDB_API_KEY and tears wandb down before the offline "
    "attempt, so the offline run logs (a .wandb file is written); but wandb leaves a second, empty offline-run "
    "folder behind after the failed online attempt, so `wandb sync` would see two runs. Not yet understood which "
    "init creates which folder."))


@pytest.mark.parametrize("case", [pytest.param(c, marks=BOGUS_KEY_OFFLINE) if "bogus" in c else c for c in CASES])
def test_training_falls_back_to_offline_wandb(runs, case):
    r = runs[case]
    assert "logging offline" in r["log"]
    offline = list((r["out"] / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and any(offline[0].glob("*.wandb"))
