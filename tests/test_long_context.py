"""Long samples: the training-time test never builds a T x T tensor, its memory for the backward grows linearly
with T, activation checkpointing computes the same loss and gradients from less, and a sample longer than one
rank holds is refused before training starts (benchmarks/bench_long_context.py measures the memory and speed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3.batching import check_fits
from eagle3.config import TrainConfig
from eagle3.logs import UserError
from eagle3.loss import Teacher
from eagle3.model import Eagle3Draft, Eagle3DraftConfig
from eagle3.objective import Objective
from eagle3.targets.argmax import lm_head_argmax

sys.path.append(str(Path(__file__).parent))  # tests/ helpers (appended: never shadow installed packages)
import test_trainer  # noqa: E402
from test_sequence_parallel import small_head  # noqa: E402
from test_trainer import make_cfg  # noqa: E402

tiny_cache = test_trainer.tiny_cache  # the shared module-scoped fixture

VOCAB, DRAFT_VOCAB, HIDDEN = 300, 64, 32


def head(arch: str = "llama") -> tuple[Eagle3Draft, Teacher, torch.Tensor]:
    dims = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    if arch == "llama-2-layers":  # a deeper head: the stacked layer's keys at every position, its checkpointed steps
        dims["num_layers"] = 2
    if arch == "mla":
        dims = {"arch": "mla", "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "q_lora_rank": 16,
                "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
    return small_head(Eagle3DraftConfig(hidden_size=HIDDEN, intermediate_size=64, vocab_size=VOCAB,
                                        draft_vocab_size=DRAFT_VOCAB, target_hidden_size=HIDDEN,
                                        max_position_embeddings=65536, **dims))


def long_batch(lm_head: torch.Tensor, t: int) -> dict[str, torch.Tensor]:
    """One sample of t positions: a prompt, then assistant tokens (73%, ShareGPT's share), random states."""
    g = torch.Generator().manual_seed(t)
    final = torch.randn(1, t, HIDDEN, generator=g)
    mask = torch.zeros(1, t, dtype=torch.long)
    mask[:, int(0.27 * t):] = 1
    return {"aux": torch.randn(1, t, 3 * HIDDEN, generator=g), "final": final, "loss_mask": mask,
            "input_ids": torch.randint(0, VOCAB, (1, t), generator=g), "lengths": torch.tensor([t]),
            "target_argmax": lm_head_argmax(lm_head, final, 128)}


def step(draft: Eagle3Draft, teacher: Teacher, batch: dict, **train) -> tuple[torch.Tensor, list[torch.Tensor]]:
    objective = Objective(teacher, TrainConfig(ttt_steps=3, **train))
    loss, _ = objective.loss(draft, objective.plan(batch))
    return loss.detach(), list(torch.autograd.grad(loss, [p for p in draft.parameters() if p.requires_grad]))


class LargestTensor(TorchDispatchMode):
    """The most elements any operator's output had, forward and backward (CPU SDPA's math kernel, or any explicit
    [queries, keys] mask, would show as one of T x T)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("arch", ["llama", "mla", "llama-2-layers"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_training_time_test_never_builds_a_t_by_t_tensor(arch, checkpointing):
    """2048 positions, pruned rows (the prompt is not scored), the real objective's forward and backward: no
    tensor of T x T / 4 elements or more; the dense reference attention builds one (the check's control)."""
    draft, teacher, lm_head = head(arch)
    t = 2048
    batch = long_batch(lm_head, t)
    with LargestTensor() as seen:
        step(draft, teacher, batch, activation_checkpointing=checkpointing)
    assert seen.largest < t * t // 4, seen.largest
    objective = Objective(teacher, TrainConfig(ttt_steps=3))
    planned = objective.plan(long_batch(lm_head, 256))
    with LargestTensor() as dense, torch.no_grad():
        draft(planned.batch["aux"], planned.batch["input_ids"], planned.rows, attention="dense")
    assert dense.largest >= 256 * 256, dense.largest


def saved_bytes(draft: Eagle3Draft, teacher: Teacher, batch: dict, checkpointing: bool) -> int:
    """Bytes autograd keeps for the backward of one step (each storage once, the parameters' too)."""
    storages: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        s = x.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return x

    objective = Objective(teacher, TrainConfig(ttt_steps=3, activation_checkpointing=checkpointing))
    planned = objective.plan(batch)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss, _ = objective.loss(draft, planned)
    del loss
    return sum(storages.values())


def test_memory_kept_for_the_backward_is_linear_in_length_and_checkpointing_keeps_less():
    """What autograd saves per token is the same at 1K and 4K positions (nothing grows like T x T), and activation
    checkpointing keeps under half of it."""
    draft, teacher, lm_head = head()
    short, long = long_batch(lm_head, 1024), long_batch(lm_head, 4096)
    plain = [saved_bytes(draft, teacher, b, False) for b in (short, long)]
    ckpt = [saved_bytes(draft, teacher, b, True) for b in (short, long)]
    assert plain[1] < 4.2 * plain[0], plain
    assert ckpt[1] < 4.2 * ckpt[0], ckpt
    assert ckpt[1] < 0.5 * plain[1], (ckpt, plain)


@pytest.mark.parametrize("arch", ["llama", "mla", "llama-2-layers"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(arch):
    draft, teacher, lm_head = head(arch)
    batch = long_batch(lm_head, 300)
    loss, grads = step(draft, teacher, batch)
    loss_c, grads_c = step(draft, teacher, batch, activation_checkpointing=True)
    torch.testing.assert_close(loss_c, loss, atol=0, rtol=1e-6)
    for a, b in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def test_a_sample_longer_than_one_rank_holds_is_refused_with_what_to_set():
    check_fits([100, 4096, 50], 4096, 1, "train")
    check_fits([9000], 4096, 3, "train")  # 3000 positions per rank
    with pytest.raises(UserError) as e:
        check_fits([100, 9000, 50], 4096, 1, "train")
    msg = str(e.value)
    for key in ("train sample 1 has 9000 tokens", "train.batch_tokens=9000", "train.sequence_parallel=3",
                "data.max_length=4096", "train.activation_checkpointing"):
        assert key in msg, (key, msg)
    with pytest.raises(UserError, match=r"a 1/2 share .* train.batch_tokens=4500"):
        check_fits([9000], 4000, 2, "eval")


def test_the_trainer_refuses_it_before_the_first_step(tiny_cache, tmp_path):  # noqa: F811
    from eagle3 import trainer

    cfg = make_cfg(tiny_cache, tmp_path / "run", max_steps=2, batch_tokens=20)  # the cache's samples: 5-40 tokens
    with pytest.raises(UserError, match=r"sample \d+ has \d+ tokens, more than one rank holds: "
                                        r"train.batch_tokens=20 per rank"):
        trainer.run(cfg)
    assert not (tmp_path / "run" / "train_log.jsonl").exists()
    assert not cfg.checkpoint_dir.exists() or not any(cfg.checkpoint_dir.iterdir())
