"""Which process this is among a launch: the one place eagle3 asks.

The trainer runs under an accelerate process group, and its answer comes from accelerate's state. Extraction runs
without one on purpose: its ranks never talk to each other, so a rank that dies leaves the others' shards intact,
and one rank's part can be redone alone (`RANK=3 WORLD_SIZE=8 eagle3 extract ...`) with no rendezvous to wait on.
It reads the launcher's environment the way accelerate does (torchrun/accelerate's RANK, and the MPI spellings),
so both stages agree on every launcher accelerate supports.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

T = TypeVar("T")

_RANK = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
_WORLD = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_LOCAL_RANK = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")
_LOCAL_WORLD = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


@dataclass(frozen=True)
class Place:
    """This process's rank among `world`, and among the `local_world` processes of its machine."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1


def _env_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.strip():
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None
    return default


def this_process() -> Place:
    """accelerate's answer where a process group is up (the trainer), else the launcher's environment; (0, 1) when
    run alone."""
    from accelerate.state import PartialState

    if PartialState._shared_state:  # an Accelerator/PartialState exists: ask it, never guess past it
        s = PartialState()
        return Place(s.process_index, s.num_processes, s.local_process_index, local_world())
    rank, world = _env_int(_RANK, 0), _env_int(_WORLD, 1)
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return Place(rank, world, _env_int(_LOCAL_RANK, rank), local_world())


def local_world() -> int:
    """How many of the launch's processes share this machine (its cores and GPUs); 1 when run alone."""
    return max(1, _env_int(_LOCAL_WORLD, 1))


def gather_after(work: Callable[[], T], timeout: timedelta, what: str) -> list[T]:
    """Every rank's `work()`, in rank order, for work the ranks finish far apart (each hashing its share of a cache).

    They meet over a gloo group of their own that waits up to `timeout`, not over the training's process group: there
    NCCL's watchdog aborts a collective left waiting 10 minutes (torch's default, which accelerate keeps), and the
    process with it. The group is made before the work, while the ranks are still together; what is gathered are
    Python objects, which travel through the CPU anyway. A rank left waiting past `timeout` raises TimeoutError.
    Without a process group: [work()]."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [work()]
    group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        mine = work()
        out: list = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(out, mine, group=group)
        except RuntimeError as e:  # gloo: "Timed out waiting 7200000ms for recv operation to complete"
            if "timed out" not in str(e).lower():
                raise
            raise TimeoutError(f"rank {dist.get_rank()} waited {timeout} for the other ranks to finish {what}") from e
        return out
    finally:
        dist.destroy_process_group(group)
