"""The training objective of one micro-batch: the positions each TTT step scores, the draft's unrolled forward on
them, and the loss and metrics. The trainer calls `plan` when a batch arrives and `loss` once per micro-batch; it
never learns whether the features came from a cache or from a live target (both hand over the same batch dicts,
with the target's full-vocab argmax: eagle3.cache, eagle3.online).

    objective = Objective(teacher, cfg.train)
    planned = objective.plan(batch)                            # host only: no device sync inside a step
    loss, stats = objective.loss(model, planned, denominators)

Planning needs only the loss mask and the target's argmax (eagle3.rows), so an accumulation group knows the loss's
denominators (the scored positions of the whole group on all ranks) before its first backward. Under sequence
parallelism (eagle3.sequence_parallel) each rank plans and computes its share of the batch's positions.

`train.copy_weight` weighs the positions where copying from the context is right (`copy_positions`): prompt lookup
beats a head on answers that re-emit their prompt (BENCHMARKS.md "Code and edits"), and this is the loss's lever
toward copying. The weight scales the teacher's distribution at those positions, which scales the soft
cross-entropy and its gradient there exactly (sum_v w p_v (lse - z_v) = w CE), so the fused loss is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from eagle3.cache.codec import dense
from eagle3.config import TrainConfig
from eagle3.loss import SoftCE, StepStats, Teacher, ttt_loss
from eagle3.rows import TTTPlan, plan_rows
from eagle3.sequence_parallel import SequenceParallel


@dataclass
class PlannedBatch:
    """A collated batch on the host and the positions its TTT steps compute and score."""

    batch: dict[str, Tensor]
    """This rank's part of it (all of it without sequence parallelism)."""
    rows: TTTPlan

    def scored(self) -> Tensor:
        """[steps] positions scored at each step (a share of the loss's denominators)."""
        return self.rows.scored()


class Objective:
    """EAGLE-3's training-time test against the target's distribution over the draft vocab (eagle3.loss)."""

    def __init__(self, teacher: Teacher, train: TrainConfig, sp: SequenceParallel | None = None,
                 image_inputs: str | None = None):
        """`image_inputs`: draft.image_inputs, what the head reads at image tokens (a cache of image samples)."""
        self.teacher, self.train, self.sp, self.image_inputs = teacher, train, sp, image_inputs
        self.device = teacher.device

    def plan(self, batch: dict[str, Tensor]) -> PlannedBatch:
        if self.train.copy_weight != 1.0:  # before sharding: a lookup needs the whole context before a position
            copy = copy_positions(batch["input_ids"], batch["target_argmax"])
            batch = {**batch, "position_weight": 1.0 + (self.train.copy_weight - 1.0) * copy.float()}
        batch, extra = self._image_inputs(batch)
        own, start = None, 0
        if self.sp is not None:
            batch, own, start = self.sp.shard(batch, self.train.ttt_steps)
        if extra is not None:
            batch["image_embeds"] = extra
        draft_argmax = self.teacher.to_draft_host[batch["target_argmax"]]
        return PlannedBatch(batch, plan_rows(batch["loss_mask"], draft_argmax, self.train.ttt_steps,
                                             self.train.mask_out_of_vocab, own, start))

    def loss(self, model: torch.nn.Module, planned: PlannedBatch, denominators: Tensor | None = None,
             ) -> tuple[Tensor, StepStats]:
        """The micro-batch's share of the loss (each step's scored positions weigh 1 / denominators[j]; None: this
        batch's own counts) and its per-step sums for the metrics."""
        batch = self.to_device(planned.batch)
        rows = planned.rows.to(self.device)
        argmax = batch["target_argmax"]
        probs = self.teacher.probs(batch["final"].flatten(0, 1)[rows.teacher_pos])
        if "position_weight" in batch:
            probs.mul_(batch["position_weight"].flatten()[rows.teacher_pos, None])
        head = SoftCE(probs, rows, self.train.step_decay, denominators, self.train.loss_chunk_rows)
        out = model(batch["aux"], batch.get("draft_ids", batch["input_ids"]), rows, head=head, over=self.sp,
                    checkpoint=self.train.activation_checkpointing, extra=batch.get("image_embeds"),
                    positions=batch.get("position_ids"))
        draft_target = self.teacher.to_draft[argmax].flatten()[rows.teacher_pos]
        return ttt_loss(out, draft_target, rows, (batch["input_ids"], argmax, batch["loss_mask"]))

    def _image_inputs(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor | None]:
        """A batch of image samples: under `target-embeddings` (SGLang's inputs) `draft_ids`, the ids with each image
        token as `vocab + k`, k its row in `image_embeds`, which the head embeds as that row (the target's merged
        input there; eagle3.model.Eagle3Draft.embed), shifting through the TTT steps like the ids; under
        `placeholder` (vLLM's) the image tokens' own embeddings, so the pictures are dropped, and an M-RoPE target's
        temporal positions (`position_ids`, where the cache has them), which vLLM gives its draft. -> (the batch, the
        embeddings kept aside: they are rows, not positions, and are never sharded)."""
        if "image_rank" not in batch:
            return batch, None
        batch = dict(batch)
        if self.image_inputs != "placeholder":  # SGLang gives its draft the token index as positions
            batch.pop("position_ids", None)
        rank, extra = batch.pop("image_rank"), batch.pop("image_embeds")
        if self.image_inputs != "target-embeddings":
            return batch, None
        vocab = self.teacher.to_draft_host.shape[0]
        batch["draft_ids"] = torch.where(rank >= 0, vocab + rank, batch["input_ids"])
        return batch, extra

    def to_device(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The batch on the device, fp8 states (eagle3.cache.codec) dequantised there to the target's dtype: a GPU
        copies half the bytes and the host never holds a dequantised copy."""
        return dense({k: v.to(self.device, non_blocking=True) for k, v in batch.items()}, self.teacher.dtype)


def copy_positions(input_ids: Tensor, target_argmax: Tensor, min_n: int = 2, max_n: int = 4) -> Tensor:
    """[B, T] bool: the positions p where prompt lookup on the tokens up to p proposes the target's argmax at p, by
    vLLM's rule (eagle3.specdec.ngram_proposal: the longest n-gram ending at p that occurred earlier, its earliest
    occurrence, the token that followed it), for every position of every row at once."""
    b, t = input_ids.shape
    decided = torch.zeros(b, t, dtype=torch.bool)
    hit = torch.zeros(b, t, dtype=torch.bool)
    for n in range(max_n, min_n - 1, -1):
        if t <= n:
            continue
        ends = torch.arange(n - 1, t)  # n-gram i of a row ends at position n - 1 + i
        grams = torch.cat([torch.arange(b)[:, None, None].expand(b, t - n + 1, 1), input_ids.unfold(1, n, 1)], -1)
        _, same = torch.unique(grams.reshape(-1, n + 1), dim=0, return_inverse=True)  # the row is part of the key
        first = torch.full((int(same.max()) + 1,), t).scatter_reduce(0, same, ends.repeat(b), "amin")
        earliest = first[same].view(b, -1)  # where this n-gram first ended in its row
        match = earliest < ends  # it occurred before p
        proposed = input_ids.gather(1, (earliest + 1).clamp(max=t - 1))
        new = match & ~decided[:, n - 1:]  # a longer n-gram decides first
        hit[:, n - 1:] |= new & (proposed == target_argmax[:, n - 1:])
        decided[:, n - 1:] |= match
    return hit
