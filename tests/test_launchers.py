"""Every accelerate launcher config in recipes/accelerate/ loads in accelerate's own config class and opens with
the command that uses it; the multi-node ones describe a launch accelerate can carry out.

    pytest -q tests/test_launchers.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig

REPO = Path(__file__).resolve().parent.parent
LAUNCHERS = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))


def test_there_are_single_and_multi_node_launchers():
    names = {p.name for p in LAUNCHERS}
    assert {"ddp.yaml", "fsdp-8gpu.yaml", "cpu-2proc.yaml", "ddp-2x8gpu.yaml", "fsdp-2x8gpu.yaml"} <= names


@pytest.mark.parametrize("path", LAUNCHERS, ids=[p.name for p in LAUNCHERS])
def test_launcher_loads_and_opens_with_its_command(path):
    config = ClusterConfig.from_yaml_file(str(path))  # accelerate's own parser: unknown keys are errors there
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and "accelerate launch" in first, first
    assert f"--config_file recipes/accelerate/{path.name}" in first, first
    assert config.num_processes >= 1 and config.num_machines >= 1
    assert config.num_processes % config.num_machines == 0, "processes must split evenly over the machines"
    raw = yaml.safe_load(path.read_text())
    if config.num_machines > 1:  # every node runs the same command with its own --machine_rank
        assert "--machine_rank" in first and "--main_process_ip" in first, first
        assert raw["main_process_port"] and raw["rdzv_backend"] == "static" and raw["same_network"] is True
    else:
        assert config.machine_rank == 0
