"""eagle3.process: the one answer to "which process is this", under every launcher accelerate supports."""

import pytest

from eagle3.process import Place, local_world, this_process

_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
         "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)
    from accelerate.state import PartialState

    PartialState._reset_state()
    yield
    PartialState._reset_state()


def test_alone_is_rank_0_of_1():
    assert this_process() == Place(0, 1, 0, 1) and local_world() == 1


def test_torchrun_and_mpi_spellings(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert this_process() == Place(5, 16, 1, 8)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert this_process() == Place(3, 4, 1, 2)


def test_an_impossible_or_garbled_rank_is_an_error(monkeypatch):
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="RANK=4 is outside WORLD_SIZE=4"):
        this_process()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK='one' is not an integer"):
        this_process()


def test_accelerate_answers_once_its_state_exists(monkeypatch):
    """The trainer's process group is the authority: a stray RANK in the environment of a single-process
    Accelerator is not believed over it."""
    from accelerate.state import PartialState

    PartialState(cpu=True)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert (this_process().rank, this_process().world) == (0, 1)
