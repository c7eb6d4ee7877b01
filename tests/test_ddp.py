"""Two data-parallel processes on CPU (gloo), launched exactly as train.py's docstring says; ranks must agree."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).parent))  # tests/ helpers (appended: never shadow installed packages)
import test_trainer  # noqa: E402
from test_trainer import make_cfg, read_log  # noqa: E402

tiny_cache = test_trainer.tiny_cache  # the shared module-scoped fixture

REPO = Path(__file__).resolve().parent.parent

# Runs the real trainer; additionally every rank dumps its own copy of the weights at each checkpoint.
RUNNER = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from eagle3 import trainer
    from eagle3.config import load_config
    from eagle3.logs import setup_logging

    real_save = trainer.save_checkpoint
    def save_and_dump(accelerator, model, state, d2t, t2d, ckpt_dir, keep):
        path = real_save(accelerator, model, state, d2t, t2d, ckpt_dir, keep)
        sd = accelerator.unwrap_model(model).state_dict()
        torch.save(sd, f"{ckpt_dir.parent}/rank{accelerator.process_index}-of-{accelerator.num_processes}"
                       f"-step{state.step}.pt")
        return path
    trainer.save_checkpoint = save_and_dump
    setup_logging()
    trainer.run(load_config(sys.argv[1]))
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = "{port}"
PORT_TAKEN = ("Address already in use", "EADDRINUSE")


def run_launcher(cmd: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    """`cmd` with PORT replaced by a free port, run again on a fresh one when another process bound the probed
    port first: a port cannot be held from the probe to the launcher's own bind, so a busy machine can take it in
    between (a launch that fails this way has not trained a step)."""
    for _ in range(3):
        port = str(free_port())
        r = subprocess.run([port if a == PORT else a for a in cmd], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=timeout)
        if r.returncode == 0 or not any(m in r.stderr for m in PORT_TAKEN):
            return r
    return r


def launch_two_cpu_processes(script: Path, config: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", PORT, str(script), str(config)]
    return run_launcher(cmd, env, timeout)


def test_two_process_ddp_ranks_agree(tiny_cache, tmp_path):  # noqa: F811
    out = tmp_path / "ddp"
    cfg = make_cfg(tiny_cache, out, max_steps=3, save_every=3, eval_every=3)
    config = tmp_path / "ddp.yaml"
    config.write_text(cfg.to_yaml())
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    r = launch_two_cpu_processes(script, config)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "2 process(es)" in r.stderr, r.stderr[-3000:]  # really two processes, not one
    w0 = torch.load(out / "rank0-of-2-step3.pt")
    w1 = torch.load(out / "rank1-of-2-step3.pt")
    assert set(w0) == set(w1)
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k  # DDP keeps the replicas bit-identical
    # ...and they trained: weights moved away from the initial draft's.
    log = read_log(out)
    assert sorted(log) == [1, 2, 3]
    state = json.loads((cfg.checkpoint_dir / "step_3" / "trainer_state.json").read_text())
    assert state["step"] == 3
    assert (cfg.checkpoint_dir / "best" / "model.safetensors").is_file()

    # Rank r runs micro-batches r, r+2, ...; one process accumulating 2 micro-batches per step runs the same
    # pairs, under the same objective (a mean over the scored positions of the whole group, on all ranks:
    # test_loss.test_group_normalised_micro_batches_add_up_to_one_batch), so it reaches the same weights.
    from safetensors.torch import load_file

    from eagle3 import trainer

    one = make_cfg(tiny_cache, tmp_path / "accum", max_steps=3, save_every=3, eval_every=3, grad_accum=2)
    trainer.run(one)
    w = load_file(one.checkpoint_dir / "step_3" / "model.safetensors")
    for k in w:
        torch.testing.assert_close(w[k], w0[k], atol=2e-5, rtol=1e-4, msg=k)
    single, two = read_log(tmp_path / "accum"), read_log(out)
    for step in (1, 2, 3):
        assert single[step]["loss"] == pytest.approx(two[step]["loss"], rel=1e-5), step


# The cache check before training (trainer.verify_before_training) with rank 1 hashing its share DELAY seconds
# longer than rank 0, while the training group times out after a quarter of that (on GPUs: NCCL's 10-minute watchdog,
# which aborts the process). Then the same with VERIFY_TIMEOUT a quarter of the delay: a message, not a hang.
VERIFY_RUNNER = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    from accelerate import PartialState
    import eagle3.cache
    from eagle3 import trainer
    from eagle3.logs import UserError

    cache, delay = Path(sys.argv[1]), float(sys.argv[2])
    state = PartialState(cpu=os.environ.get("ACCELERATE_USE_CPU") == "true")
    state.wait_for_everyone()
    say = lambda line: sys.stdout.write(f"rank {state.process_index}: {line}\\n")  # one write: lines never mix
    real_verify = eagle3.cache.verify_cache
    def slow_verify(cache_dir, part):
        problems = real_verify(cache_dir, part=part)
        time.sleep(delay if part[0] == 1 else 0)
        return problems
    eagle3.cache.verify_cache = slow_verify
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=delay / 4))  # the training group's
    trainer.verify_before_training(cache)
    state.wait_for_everyone()  # the training group still works
    say("verified")

    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=60))
    trainer.VERIFY_TIMEOUT = timedelta(seconds=delay / 4)
    try:
        trainer.verify_before_training(cache)
    except Exception as e:
        say(f"{type(e).__name__}: {e}")
""")


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs 2 GPUs")])])
def test_ranks_hashing_their_cache_shares_far_apart_still_meet(tiny_cache, tmp_path, backend):  # noqa: F811
    """A rank that finishes its share of the checksums long after another is waited for over a gloo group of the
    check's own (eagle3.process.gather_after), not over the training's group, whose timeout the delay exceeds 4x;
    past the check's own timeout (2 h) the waiting rank ends the run with what to do."""
    delay = 4
    script = tmp_path / "verify.py"
    script.write_text(VERIFY_RUNNER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if backend == "gloo":
        env["ACCELERATE_USE_CPU"] = "true"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", PORT, str(script), str(tiny_cache["cache"]), str(delay)]
    r = run_launcher(cmd, env, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "rank 0: verified" in r.stdout and "rank 1: verified" in r.stdout, r.stdout + r.stderr[-3000:]
    assert (f"rank 0: UserError: rank 0 waited 0:00:01 for the other ranks to finish checking their share of the "
            f"cache's checksums (train.verify_cache). Check the cache once outside training (`eagle3 cache info "
            f"{tiny_cache['cache']} --verify`), then train with train.verify_cache=false") in r.stdout, r.stdout


@pytest.mark.slow
def test_train_py_with_the_cpu_recipe(tiny_cache, tmp_path):  # noqa: F811
    """train.py itself through recipes/accelerate/cpu-2proc.yaml."""
    out = tmp_path / "recipe"
    cfg = make_cfg(tiny_cache, out, max_steps=2, save_every=2, eval_every=2)
    config = tmp_path / "c.yaml"
    config.write_text(cfg.to_yaml())
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "recipes/accelerate/cpu-2proc.yaml"), "--main_process_port", PORT,
           str(REPO / "train.py"), "--config", str(config)]
    r = run_launcher(cmd, env)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "2 process(es)" in r.stderr
    from eagle3.formats import load_draft

    log = read_log(out)
    assert sorted(log) == [1, 2] and all(math.isfinite(log[s]["loss"]) for s in log)
    trained = load_draft(cfg.checkpoint_dir / "step_2" / "draft")  # a head that loads, on the cache's layers
    cache_meta = json.loads((Path(tiny_cache["cache"]) / "meta.json").read_text())
    assert trained.config.aux_layer_ids == cache_meta["fingerprint"]["layer_ids"]
