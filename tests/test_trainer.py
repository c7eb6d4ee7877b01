"""Batching, the training loop end to end on a tiny target's real cache, exact resume, cache refusal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from eagle3 import induction, trainer
from eagle3.batching import collate, plan_epoch, plan_eval
from eagle3.formats import load_draft
from eagle3.induction import fit_readouts
from eagle3.logs import UserError
from eagle3.objective import Objective

sys.path.append(str(Path(__file__).parent))  # tests/models.py (appended: never shadow installed packages)
from models import checkpoint_differences, make_prepared, run_then_crash_after_checkpoint, tiny_llama, tiny_target_cfg  # noqa: E402


# ------------------------------------------------------------------------------------------------ batching
def test_plan_is_deterministic_within_budget_and_covers_everything():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 200, (500,), generator=g).tolist()
    a = plan_epoch(lengths, 1024, seed=3, epoch=0)
    assert a.batches == plan_epoch(lengths, 1024, seed=3, epoch=0).batches
    assert a.batches != plan_epoch(lengths, 1024, seed=3, epoch=1).batches
    assert sorted(i for b in a.batches for i in b) == list(range(500))
    assert all(max(lengths[i] for i in b) * len(b) <= 1024 for b in a.batches)
    slots = sum(max(lengths[i] for i in b) * len(b) for b in a.batches)
    assert a.padding_share == pytest.approx(1 - sum(lengths) / slots)
    assert a.padding_share < 0.1  # bucketing keeps padding low
    # Data parallel: disjoint, equal counts per rank.
    r0, r1 = (plan_epoch(lengths, 1024, 3, 0, rank=r, world_size=2).batches for r in (0, 1))
    assert len(r0) == len(r1) == len(a.batches) // 2
    assert not {i for b in r0 for i in b} & {i for b in r1 for i in b}
    # Evaluation: every batch counted on exactly one rank, the odd one out too (one eval batch on two ranks was
    # evaluated by neither, and a 2-process run's eval said acceptance 1.0), and every rank runs as many forwards
    # (FSDP gathers the weights in each: a rank that stopped early would hang the others).
    one = plan_epoch(lengths[:3], 1024, 3, 0, shuffle=False).batches
    assert len(one) == 1
    assert [plan_eval(lengths[:3], 1024, 3, r, 2) for r in (0, 1)] == [(one, 1), (one, 0)]
    parts = [plan_eval(lengths, 1024, 3, r, 3) for r in range(3)]
    assert len({len(batches) for batches, _ in parts}) == 1
    assert sorted(i for batches, n in parts for b in batches[:n] for i in b) == list(range(500))


def test_plan_keeps_an_overlong_sample_alone():
    plan = plan_epoch([10, 5000, 10], 100, seed=0, epoch=0)
    assert [1] in plan.batches and sorted(i for b in plan.batches for i in b) == [0, 1, 2]


def test_collate_pads_right_with_zeros():
    items = [{"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1], dtype=torch.int8),
              "aux": torch.ones(3, 6, dtype=torch.bfloat16), "final": torch.ones(3, 2, dtype=torch.bfloat16)},
             {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([1], dtype=torch.int8),
              "aux": torch.ones(1, 6, dtype=torch.bfloat16), "final": torch.ones(1, 2, dtype=torch.bfloat16)}]
    b = collate(items)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert b["aux"].dtype == torch.bfloat16 and b["aux"][1, 1:].abs().sum() == 0
    assert b["lengths"].tolist() == [3, 1]


# ----------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama target, a prepared folder and its real extracted cache, shared by the tests below."""
    from eagle3.extract import run as extract

    root = tmp_path_factory.mktemp("h3cache")
    target = tiny_llama(root / "target", vocab=256, hidden=64, layers=8)
    prepared = make_prepared(root / "prepared", n=24, n_eval=4, vocab=256, draft_vocab=64, max_len=40)
    cfg = tiny_target_cfg(target, prepared, root / "x")
    cfg.extract.cache_dir = str(root / "cache")
    extract(cfg)
    return {"target": target, "prepared": prepared, "cache": root / "cache"}


def make_cfg(paths: dict[str, Path], out: Path, draft: dict | None = None, **train):
    cfg = tiny_target_cfg(paths["target"], paths["prepared"], out)
    cfg.extract.cache_dir = str(paths["cache"])
    cfg.draft.vocab_size = 64
    for k, v in (draft or {}).items():
        setattr(cfg.draft, k, v)
    t = cfg.train
    t.batch_tokens, t.ttt_steps, t.lr, t.warmup_ratio, t.log_every = 160, 3, 3e-3, 0.2, 1
    for k, v in train.items():
        setattr(t, k, v)
    return cfg


def read_log(out: Path) -> dict[int, dict]:
    """Last entry per step (a resumed run re-logs steps after its checkpoint)."""
    rows: dict[int, dict] = {}
    for line in (out / "train_log.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            rows[r["step"]] = r
    return rows


def test_train_end_to_end_checkpoints_best_and_metrics(tiny_cache, tmp_path):
    cfg = make_cfg(tiny_cache, tmp_path / "run", max_steps=8, save_every=3, keep_checkpoints=2, eval_every=4)
    metrics = trainer.run(cfg)
    ck = cfg.checkpoint_dir
    assert sorted(p.name for p in ck.iterdir()) == ["best", "step_6", "step_8"]  # step_3 rotated out, no tmp left
    state = json.loads((ck / "step_8" / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["best_step"] in (4, 8)
    for f in ("model.safetensors", "optimizer.bin", "vocab.safetensors", "draft/config.json"):
        assert (ck / "step_8" / f).exists(), f
    best = load_draft(ck / "best")
    assert best.config.draft_vocab_size == 64 and best.config.aux_layer_ids == cfg.target.layer_ids(8)
    assert torch.equal(best.t2d[:64], torch.ones(64, dtype=torch.bool))
    log = read_log(tmp_path / "run")
    assert sorted(log) == list(range(1, 9))
    for k in ("loss", "loss_0", "acc_2", "sim_accept_len", "lr", "grad_norm", "tokens_per_s", "padding_share",
              "data_wait_share"):
        assert k in log[8], k
    assert log[8]["loss"] < log[1]["loss"]  # it learns
    assert 1.0 <= metrics["eval"]["sim_accept_len"] <= 1 + cfg.train.ttt_steps


@pytest.mark.parametrize("draft", [{}, {"arch": "mla", "fc_norm": True, "norm_output": True}],
                         ids=["llama", "mla-3.1"])
def test_exact_resume_after_a_crash(tiny_cache, tmp_path, monkeypatch, draft):
    kw = dict(max_steps=6, save_every=2, eval_every=100)
    straight = make_cfg(tiny_cache, tmp_path / "straight", draft, **kw)
    trainer.run(straight)

    crashed = make_cfg(tiny_cache, tmp_path / "crashed", draft, **kw)
    run_then_crash_after_checkpoint(monkeypatch, crashed, 4)
    assert sorted(read_log(tmp_path / "crashed")) == [1, 2, 3, 4]
    trainer.run(crashed)  # the same command again: resumes from step_4

    resumed_at = json.loads((crashed.checkpoint_dir / "step_4" / "trainer_state.json").read_text())
    assert resumed_at["batch_index"] > 0, "the crash must fall mid-epoch, where resuming has a data position to keep"
    a, b = read_log(tmp_path / "straight"), read_log(tmp_path / "crashed")
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert (b[step]["loss"], b[step]["lr"]) == (a[step]["loss"], a[step]["lr"]), step  # exact, not close
    wa = load_draft(straight.checkpoint_dir / "step_6" / "draft").state_dict()
    assert ("fc_norm.0.weight" in wa) is bool(draft)
    # Weights, optimizer and scheduler state, RNG, trainer state: every file of the last checkpoint, byte for byte.
    assert checkpoint_differences(straight.checkpoint_dir / "step_6", crashed.checkpoint_dir / "step_6") == []


def test_nan_states_stop_training_before_they_reach_the_weights(tiny_cache, tmp_path, monkeypatch):
    """NaN hidden states in one sample (a damaged shard) make a NaN loss: training stops at that step with one
    clear error naming it and the samples, and no checkpoint, best head or export holds a NaN."""
    from eagle3.logs import UserError

    cfg = make_cfg(tiny_cache, tmp_path / "nan", max_steps=8, save_every=2, eval_every=2)
    real_plan = Objective.plan
    seen: list[int] = []

    def plan_with_a_damaged_sample(self, batch):
        seen.append(1)
        if len(seen) == 5:  # a micro-batch after the step-2 checkpoint and eval
            batch = {**batch, "aux": batch["aux"].clone()}
            batch["aux"][0, 1] = float("nan")
        return real_plan(self, batch)

    monkeypatch.setattr(Objective, "plan", plan_with_a_damaged_sample)
    with pytest.raises(UserError, match=r"step \d: the loss \(nan\) or gradient norm .* not finite.*train samples \[\[") as e:
        trainer.run(cfg)
    step = int(str(e.value).split(":")[0].removeprefix("step "))
    assert step > 2 and sorted(read_log(tmp_path / "nan")) == list(range(1, step))  # stopped at that step
    for folder in (cfg.checkpoint_dir / "step_2" / "draft", cfg.checkpoint_dir / "best"):
        for name, t in load_draft(folder).state_dict().items():
            assert not t.is_floating_point() or torch.isfinite(t).all(), (folder, name)


def test_refuses_a_cache_from_other_layers(tiny_cache, tmp_path):
    from eagle3.cache import CacheError

    cfg = make_cfg(tiny_cache, tmp_path / "bad", max_steps=1)
    cfg.target.aux_layer_ids = [1, 3, 6]
    with pytest.raises(CacheError, match="layer"):
        trainer.run(cfg)
    assert not cfg.checkpoint_dir.exists()


def test_init_from_a_draft_folder_fine_tunes(tiny_cache, tmp_path):
    first = make_cfg(tiny_cache, tmp_path / "a", max_steps=2, eval_every=100)
    trainer.run(first)
    cfg = make_cfg(tiny_cache, tmp_path / "b", max_steps=1, eval_every=100, lr=1e-9, warmup_ratio=0.0)
    cfg.draft.init_from = str(first.checkpoint_dir / "best")
    trainer.run(cfg)
    a = load_draft(first.checkpoint_dir / "best").state_dict()
    b = load_draft(cfg.checkpoint_dir / "step_1" / "draft").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)  # started from it (lr ~ 0)


def test_stored_argmax_is_the_targets_and_a_format_1_cache_is_upgraded_to_the_same_bytes(tiny_cache, tmp_path):
    """Extraction stores the target's full-vocab argmax (exactly lm_head_argmax of the stored final states). A
    format-1 cache (no argmax column, no checksums) is refused with the command that upgrades it; the upgrade
    computes the argmax once and leaves shards byte-identical to the ones extraction writes today."""
    import shutil

    import pyarrow as pa

    from eagle3.cache import CacheError, HiddenStateDataset, Manifest, read_meta
    from eagle3.cli import main
    from eagle3.fsutil import sha256_file, write_json_atomic
    from eagle3.targets.argmax import lm_head_argmax
    from eagle3.targets.weights import load_target_head

    cfg = make_cfg(tiny_cache, tmp_path / "new", max_steps=1)
    ds = HiddenStateDataset(tiny_cache["cache"], "train")
    _, lm_head, _ = load_target_head(cfg.target.path)
    for i in range(len(ds)):
        assert torch.equal(ds[i]["target_argmax"], lm_head_argmax(lm_head, ds[i]["final"], cfg.extract.teacher_chunk))

    old = tmp_path / "v1-cache"
    shutil.copytree(tiny_cache["cache"], old)
    meta = read_meta(old)
    fp1 = {k: v for k, v in meta["fingerprint"].items() if k != "storage"} | {"format": 1}
    for manifest in sorted(old.glob("*/rank-*.json")):
        m = Manifest.load(manifest)
        for e in m.shards:  # the same record batches without the argmax column, as format 1 wrote them
            path = manifest.parent / e.file
            batches = [rb.drop_columns(["target_argmax"]) for rb in pa.ipc.open_stream(path.read_bytes())]
            with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, batches[0].schema) as w:
                for rb in batches:
                    w.write_batch(rb)
            e.bytes, e.sha256 = path.stat().st_size, ""
        m.fingerprint = fp1
        m.save(old)
    write_json_atomic(old / "meta.json", {**meta, "fingerprint": fp1})

    cfg.extract.cache_dir = str(old)
    with pytest.raises(CacheError, match=f"format 1.*eagle3 cache upgrade {old} --config"):
        trainer.run(cfg)
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(cfg.to_yaml())
    assert main(["cache", "upgrade", str(old), "--config", str(cfg_file)]) == 0
    for shard in sorted(tiny_cache["cache"].glob("*/*.arrow")):
        assert sha256_file(old / shard.parent.name / shard.name) == sha256_file(shard), shard.name
    assert read_meta(old)["fingerprint"] == read_meta(tiny_cache["cache"])["fingerprint"]
    assert main(["cache", "upgrade", str(old), "--config", str(cfg_file)]) == 0  # nothing left to do


def test_online_mode_matches_offline(tiny_cache, tmp_path):
    """extract.mode=online: the target computes each batch's states; same losses as training from the cache.

    The cache stores samples in its own order (sorted for extraction), so index-based plans differ between the
    two modes; one batch holding the whole split makes every step see the same samples."""
    kw = dict(max_steps=2, eval_every=100, batch_tokens=4000)
    offline = make_cfg(tiny_cache, tmp_path / "off", **kw)
    trainer.run(offline)
    online = make_cfg(tiny_cache, tmp_path / "on", **kw)
    online.extract.mode = "online"
    online.extract.cache_dir = str(tmp_path / "no-cache")
    trainer.run(online)
    a, b = read_log(tmp_path / "off"), read_log(tmp_path / "on")
    for step in (1, 2):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
        assert b[step]["acc_0"] == pytest.approx(a[step]["acc_0"], abs=1e-6)
    assert not (tmp_path / "no-cache").exists()


def test_online_mode_computes_only_the_batches_it_trains(tiny_cache, tmp_path, monkeypatch):
    """max_steps ending mid-epoch: the prefetcher must not ask the target for batches past the last step (each is
    a target forward, and through the Mooncake Store states nobody reads). A slow step lets it run ahead."""
    import time

    from eagle3 import online

    cfg = make_cfg(tiny_cache, tmp_path / "on", max_steps=2, eval_every=100)
    cfg.extract.mode, cfg.extract.cache_dir, cfg.extract.prefetch = "online", str(tmp_path / "no-cache"), 2
    asked: list[list[int]] = []
    capture, step = online.capture_items, trainer.after_step

    def counted(backend, dataset, indices, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        if len(dataset) == len(prepared_train):
            asked.append(list(indices))
        return capture(backend, dataset, indices, *a, **k)

    def slow_step(s, metrics):  # noqa: ANN001, ANN202
        time.sleep(0.5)
        step(s, metrics)

    from eagle3.data.prepared import load_prepared

    prepared_train = load_prepared(cfg.prepared_dir).train
    monkeypatch.setattr(online, "capture_items", counted)
    monkeypatch.setattr(trainer, "after_step", slow_step)
    trainer.run(cfg)
    plan = plan_epoch([len(x) for x in prepared_train["input_ids"]], cfg.train.batch_tokens, cfg.train.seed, 0, 0, 1)
    assert len(plan.batches) > 4  # the epoch goes on past step 2
    assert asked == [list(b) for b in plan.batches[:2]]


def test_copy_init_trains_from_the_circuit_and_online_mode_is_refused(tiny_cache, tmp_path, monkeypatch):
    """draft.copy_init: the first kv head of the first layer starts as eagle3.induction's circuit (keys only on the
    lowest-frequency RoPE dims), then trains; online mode has no cache to fit the circuit's readouts on."""
    cfg = make_cfg(tiny_cache, tmp_path / "copy", draft={"copy_init": 1}, max_steps=2, eval_every=100)
    s = trainer.set_up(cfg)
    k = s.model.midlayer.self_attn.k_proj.weight.detach()
    head_dim = s.model.config.head_dim
    inv_freq = s.model.midlayer.self_attn.rotary_emb.inv_freq
    slowest = torch.argsort(inv_freq)[:3].tolist()  # 3 of the 8 pairs (dims i and i + 8), those that turn least
    matching = sorted(slowest + [i + head_dim // 2 for i in slowest])
    assert (k[:head_dim].abs().sum(-1) != 0).nonzero().flatten().tolist() == matching
    assert int((k[head_dim:].abs().sum(-1) == 0).sum()) == 0  # the other kv head keeps its random init
    trainer.run(cfg)
    assert sorted(read_log(tmp_path / "copy")) == [1, 2]
    # a resumed run loads its checkpoint over the init: the readouts are not fitted again
    fits = []
    monkeypatch.setattr(induction, "fit_readouts", lambda *a, **k: fits.append(1) or fit_readouts(*a, **k))
    more = make_cfg(tiny_cache, tmp_path / "copy", draft={"copy_init": 1}, max_steps=3, eval_every=100)
    trainer.run(more)
    assert fits == [] and sorted(read_log(tmp_path / "copy")) == [1, 2, 3]
    online = make_cfg(tiny_cache, tmp_path / "on", draft={"copy_init": 1}, max_steps=2)
    online.extract.mode = "online"
    with pytest.raises(UserError, match="draft.copy_init"):
        trainer.run(online)


@pytest.mark.slow
def test_wandb_offline_tracking(tiny_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = make_cfg(tiny_cache, tmp_path / "wb", max_steps=2, eval_every=2)
    cfg.tracking.backend, cfg.tracking.run_name = "wandb", "h3-test"
    trainer.run(cfg)
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_tensorboard_tracking_holds_the_training_loss(tiny_cache, tmp_path):
    """tracking.backend=tensorboard through accelerate's tracker: the event files under <output_dir>/tracking hold
    every logged step's training loss, equal to train_log.jsonl's, and the config as flat hparams."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(tiny_cache, tmp_path / "tb", max_steps=4, eval_every=2, log_every=1)
    cfg.tracking.backend, cfg.tracking.project = "tensorboard", "tb-test"
    trainer.run(cfg)
    events = EventAccumulator(str(tmp_path / "tb" / "tracking" / "tb-test")).Reload()
    loss = {e.step: e.value for e in events.Scalars("train/loss")}
    logged = read_log(tmp_path / "tb")
    assert sorted(loss) == [1, 2, 3, 4]
    assert all(loss[s] == pytest.approx(logged[s]["loss"], rel=1e-6) for s in loss)
    assert "eval/sim_accept_len" in events.Tags()["scalars"]
    hparams = (tmp_path / "tb" / "tracking" / "tb-test").glob("*/hparams.yml")
    assert "train.max_steps: 4" in next(hparams).read_text()


def test_a_tracker_whose_package_is_missing_is_refused_before_training(tiny_cache, tmp_path, monkeypatch):
    import importlib.util

    from eagle3.logs import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = make_cfg(tiny_cache, tmp_path / "ml", max_steps=2)
    cfg.tracking.backend = "mlflow"
    with pytest.raises(UserError, match="tracking.backend=mlflow: this environment has no mlflow package; pip install"):
        trainer.run(cfg)
    assert not (tmp_path / "ml" / "checkpoints").exists()


@pytest.fixture(scope="module")
def one_checkpoint(tiny_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    trainer.run(make_cfg(tiny_cache, out, max_steps=2, save_every=2, eval_every=100))
    return out / "checkpoints" / "step_2"


@pytest.mark.parametrize("how", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("which", ["model.safetensors", "optimizer.bin", "trainer_state.json", "draft/config.json"])
def test_every_damaged_checkpoint_file_is_named(one_checkpoint, tmp_path, how, which):
    """checksums.json records every file of a step folder: a file cut short, flipped in place or deleted is named
    (resume then falls back to the step before: tests/reliability/test_rel_damage.py)."""
    import shutil

    from test_prepare import _damage

    from eagle3.checkpoints import checkpoint_problems

    step = tmp_path / "step_2"
    shutil.copytree(one_checkpoint, step)
    assert checkpoint_problems(step) == []
    _damage(step / which, how)
    want = {"truncate": "bytes where", "flip": "SHA-256 differs", "delete": "missing"}[how]
    problems = checkpoint_problems(step)
    assert len(problems) == 1 and problems[0].startswith(f"{which}: ") and want in problems[0], problems
