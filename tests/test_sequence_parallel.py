"""One sample across two ranks (`train.sequence_parallel: 2`, Ulysses attention over gloo): each rank's share of the
positions, planned on the host, adds up to the whole sample; two processes give the loss and gradients of one
process on the whole sample; the trainer under FSDP2 with sequence parallelism trains as one process does and
resumes exactly. The 2-process runs are launched as tests/test_ddp.py launches its own."""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eagle3.config import TrainConfig
from eagle3.loss import StepStats, Teacher
from eagle3.model import Eagle3Draft, Eagle3DraftConfig
from eagle3.objective import Objective
from eagle3.sequence_parallel import SequenceParallel
from eagle3.targets.argmax import lm_head_argmax

sys.path.append(str(Path(__file__).parent))  # tests/ helpers (appended: never shadow installed packages)
import test_trainer  # noqa: E402
from models import checkpoint_differences  # noqa: E402
from test_ddp import PORT, launch_two_cpu_processes, run_launcher  # noqa: E402
from test_fsdp import FSDP_YAML, RUNNER  # noqa: E402
from test_trainer import make_cfg, read_log  # noqa: E402

tiny_cache = test_trainer.tiny_cache  # the shared module-scoped fixture

REPO = Path(__file__).resolve().parent.parent
VOCAB, DRAFT_VOCAB, HIDDEN = 200, 50, 48

CASES = {
    # name: (draft config overrides, TTT steps, activation checkpointing, batch rows, positions)
    "llama-gqa": ({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8}, 3, False, 2, 23),
    "llama-heads-padded": ({"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}, 4, True, 1, 30),
    "mla-3.1": ({"arch": "mla", "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": 24,
                 "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "fc_norm": True,
                 "norm_output": True}, 3, False, 2, 17),
    # an M-RoPE target's temporal positions (a picture spans the shares' border: one position, then the text resumes)
    "llama-mrope-positions": ({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8}, 3, False, 2, 23),
}


def small_head(c: Eagle3DraftConfig) -> tuple[Eagle3Draft, Teacher, torch.Tensor]:
    """(head, teacher, target lm_head), seeded: random weights, a draft vocab of every k-th target id."""
    torch.manual_seed(0)
    draft = Eagle3Draft(c, embed_weight=torch.randn(c.vocab_size, c.hidden_size))
    ids = torch.arange(c.draft_vocab_size) * (c.vocab_size // c.draft_vocab_size)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(c.draft_vocab_size), t2d)
    lm_head = torch.randn(c.vocab_size, c.hidden_size)
    return draft, Teacher(lm_head, draft.d2t, t2d), lm_head


def case(name: str) -> tuple[Eagle3Draft, Teacher, dict[str, torch.Tensor], TrainConfig]:
    """The same seeded head, teacher and batch in every process: 2 rows of random states (the second padded),
    a loss mask over part of each, the target's argmax partly outside the draft vocab."""
    dims, steps, ckpt, b, t = CASES[name]
    draft, teacher, lm_head = small_head(Eagle3DraftConfig(**{
        "hidden_size": HIDDEN, "intermediate_size": 96, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": HIDDEN, **dims}))
    final = torch.randn(b, t, HIDDEN)
    mask = (torch.rand(b, t) < 0.7).long()
    lengths = torch.full((b,), t)
    if b > 1:
        lengths[1] = t - 6
        mask[1, t - 6:] = 0
    batch = {"aux": torch.randn(b, t, 3 * HIDDEN), "final": final, "input_ids": torch.randint(0, VOCAB, (b, t)),
             "loss_mask": mask, "lengths": lengths, "target_argmax": lm_head_argmax(lm_head, final, 64)}
    if name.endswith("positions"):
        pos = torch.arange(t)
        pos[6:16] = 6
        pos[16:] -= 9
        batch["position_ids"] = pos.repeat(b, 1)
    return draft, teacher, batch, TrainConfig(ttt_steps=steps, activation_checkpointing=ckpt)


def loss_and_grads(draft: Eagle3Draft, teacher: Teacher, batch: dict, train: TrainConfig,
                   sp: SequenceParallel | None) -> tuple[torch.Tensor, list[torch.Tensor], StepStats]:
    """This process's share of the loss, its gradients and its metric sums, normalised by the whole sample's scored
    positions (summed over the group, as the trainer's denominators are)."""
    objective = Objective(teacher, train, sp)
    planned = objective.plan(batch)
    denominators = planned.scored()
    if sp is not None:
        torch.distributed.all_reduce(denominators, group=sp.group)
    loss, stats = objective.loss(draft, planned, denominators)
    grads = torch.autograd.grad(loss, [p for p in draft.parameters() if p.requires_grad])
    return loss.detach(), list(grads), stats


def child(out: str) -> None:
    """Run in each of two processes: every case with sequence_parallel 2 (summed over the ranks) and on the whole
    sample in this one process; rank 0 saves both."""
    from accelerate import PartialState

    from eagle3.process import this_process

    torch.set_num_threads(1)
    PartialState(cpu=True)  # the gloo process group accelerate launch set up
    place = this_process()
    sp = SequenceParallel.join(2, place)
    saved = {}
    for name in CASES:
        draft, teacher, batch, train = case(name)
        loss, grads, stats = loss_and_grads(draft, teacher, batch, train, sp)
        for x in (loss, *grads):
            torch.distributed.all_reduce(x, group=sp.group)
        packed = stats.packed()
        torch.distributed.all_reduce(packed, group=sp.group)
        ref_loss, ref_grads, ref_stats = loss_and_grads(draft, teacher, batch, train, None)
        saved[name] = {"sp": (loss, grads, packed), "one": (ref_loss, ref_grads, ref_stats.packed())}
    if place.rank == 0:
        torch.save(saved, out)


def test_shares_of_the_batch_plan_the_whole_batch():
    """Each rank's share (its positions, the window past them) plans exactly the whole batch's rows: every scored
    position on one rank, at its global position, with the same teacher position, and the metric counts add up."""
    _, teacher, batch, _ = case("llama-gqa")
    whole = Objective(teacher, TrainConfig(ttt_steps=3)).plan(batch).rows
    t = whole.shape[1]
    parts = [Objective(teacher, TrainConfig(ttt_steps=3), SequenceParallel(2, r, None)).plan(batch) for r in (0, 1)]
    assert [p.rows.start for p in parts] == [0, 12] and parts[0].batch["input_ids"].shape[1] == 12 + 4
    for j in range(3):
        got = []
        for rows in (p.rows for p in parts):
            own, w = rows.shape[1], rows.window
            pos = rows.keep[j][rows.score[j]]
            tp = rows.teacher_pos[rows.teacher_row[j]]
            got += zip(((pos // own) * t + pos % own + rows.start).tolist(),
                       ((tp // w) * t + tp % w + rows.start).tolist(), strict=True)
        want = zip(whole.keep[j][whole.score[j]].tolist(), whole.teacher_pos[whole.teacher_row[j]].tolist(),
                   strict=True)
        assert sorted(got) == sorted(want), j
        assert sum(float(p.rows.counted[j]) for p in parts) == float(whole.counted[j]), j
    assert sum(int(p.batch["lengths"].sum()) for p in parts) == int(batch["lengths"].sum())


def test_two_ranks_give_the_loss_and_gradients_of_one_process(tmp_path):
    """Llama layer with GQA, 3 query heads over 2 ranks (padded to 4, the key head repeated), the MLA layer with the
    EAGLE-3.1 options; a padded row, pruned rows, odd lengths, activation checkpointing in one case."""
    script = tmp_path / "runner.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_sequence_parallel
        test_sequence_parallel.child(sys.argv[1])
    """))
    out = tmp_path / "results.pt"
    r = launch_two_cpu_processes(script, out, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    saved = torch.load(out)
    assert sorted(saved) == sorted(CASES)
    for name, res in saved.items():
        (loss, grads, packed), (ref_loss, ref_grads, ref_packed) = res["sp"], res["one"]
        if name == "llama-mrope-positions":  # the positions change the loss (same head and batch as llama-gqa)
            assert abs(float(ref_loss) - float(saved["llama-gqa"]["one"][0])) > 1e-6
        assert float(ref_loss) > 0, name
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5, msg=name)
        for g, ref in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(packed, ref_packed, atol=1e-5, rtol=1e-5, msg=name)  # the metric sums


def _launch_fsdp(tmp_path: Path, config: Path):
    import yaml

    settings = yaml.safe_load(FSDP_YAML.read_text())
    settings["num_processes"] = 2
    launcher = tmp_path / "fsdp-2proc.yaml"
    launcher.write_text(yaml.safe_dump(settings))
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)  # test_fsdp's: the FSDP plugin set on CPU
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "CRASH_AFTER_CHECKPOINT": "0"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launcher),
           "--main_process_port", PORT, str(script), str(config)]
    return run_launcher(cmd, env)


@pytest.mark.slow
def test_fsdp2_with_sequence_parallel_trains_as_one_process_and_resumes_exactly(tiny_cache, tmp_path):  # noqa: F811
    """world = 1 data-parallel group x 2 sequence-parallel ranks, FSDP2 sharding the head over both, activation
    checkpointing on: the losses of one process running the same micro-batches (batch_tokens x 2, since a
    micro-batch of the group holds both ranks' budgets), then a resume from the step-2 checkpoint that ends on the
    same bytes as the run it continues."""
    kw = dict(max_steps=4, save_every=2, eval_every=2, activation_checkpointing=True)
    cfg = make_cfg(tiny_cache, tmp_path / "sp", sequence_parallel=2, **kw)
    config = tmp_path / "sp.yaml"
    config.write_text(cfg.to_yaml())
    r = _launch_fsdp(tmp_path, config)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "sequence parallel 2: 1 data-parallel group(s) of 2 ranks" in r.stderr and "DTensor" not in r.stderr
    sp_log = read_log(Path(cfg.output_dir))
    assert sorted(sp_log) == [1, 2, 3, 4]

    from eagle3 import trainer
    from eagle3.formats import load_draft

    one = make_cfg(tiny_cache, tmp_path / "one", batch_tokens=2 * cfg.train.batch_tokens, **kw)
    trainer.run(one)
    one_log = read_log(tmp_path / "one")
    for step in range(1, 5):
        assert sp_log[step]["loss"] == pytest.approx(one_log[step]["loss"], rel=1e-5), step
        assert sp_log[step]["tokens_per_s"] > 0
    assert sp_log[4]["loss"] < sp_log[1]["loss"]  # it learns
    wa = load_draft(cfg.checkpoint_dir / "step_4" / "draft").state_dict()
    w1 = load_draft(one.checkpoint_dir / "step_4" / "draft").state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], w1[k], atol=2e-5, rtol=1e-4, msg=k)

    # Resume: the run as a kill right after its step-2 checkpoint leaves it, launched again.
    resumed = tmp_path / "resumed"
    shutil.copytree(cfg.output_dir, resumed, ignore=shutil.ignore_patterns("step_4", "best", "export"))
    lines = (resumed / "train_log.jsonl").read_text().splitlines()
    (resumed / "train_log.jsonl").write_text("".join(f"{x}\n" for x in lines if json.loads(x).get("step", 0) <= 2))
    cfg_r = make_cfg(tiny_cache, resumed, sequence_parallel=2, **kw)
    config_r = tmp_path / "resumed.yaml"
    config_r.write_text(cfg_r.to_yaml())
    r = _launch_fsdp(tmp_path, config_r)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "resumed from" in r.stderr
    again = read_log(resumed)
    for step in (3, 4):
        assert again[step]["loss"] == sp_log[step]["loss"], step  # exact
    differ = checkpoint_differences(cfg.checkpoint_dir / "step_4", cfg_r.checkpoint_dir / "step_4")
    assert differ == ["optimizer_0/.metadata", "pytorch_model_fsdp_0/.metadata"], differ

    # Another sequence-parallel size would re-plan the data under the checkpoint's batch index: refused.
    from eagle3.logs import UserError

    other = make_cfg(tiny_cache, resumed, sequence_parallel=1, **{**kw, "max_steps": 6})
    with pytest.raises(UserError, match=r"written with train.sequence_parallel=2 and this run has 1"):
        trainer.run(other)
