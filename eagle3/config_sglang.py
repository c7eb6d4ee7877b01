"""The config schema's base (`Section`) and the SGLang backend's settings (`target.sglang`), apart from
eagle3/config.py, which holds the rest of the one schema and re-exports these.

    target:
      backend: sglang
      sglang: {url: [http://10.0.0.1:30000, http://10.0.0.2:30000], transport: mooncake,
               mooncake: {master: 10.0.0.1:50051, clients: 16}}
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Section(BaseModel):
    # Attribute docstrings become field descriptions: `eagle3 config docs` and docs/config.md come from them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class MooncakeSettings(Section):
    """The Mooncake Store that carries hidden states from capture servers to the processes that asked for them, on
    other machines (`target.sglang.transport: mooncake`; eagle3/targets/mooncake.py, docs/scale-out.md "Online
    across machines"). The master has no authentication: keep it and the servers on the cluster's private network.
    Each machine's own address, as the others reach it, is the one that routes to the master, or
    `EAGLE3_MOONCAKE_HOSTNAME` in that machine's environment."""

    master: str = "127.0.0.1:50051"
    """`host:port` of the `mooncake_master` RPC service (`eagle3 mooncake master --config ...` starts it there)."""
    metadata_server: str | None = None
    """The transfer engine's metadata service; None: the master's built-in HTTP one,
    `http://<master host>:8080/metadata` (`etcd://...` for an HA setup)."""
    protocol: Literal["tcp", "rdma"] = "tcp"
    """Transfer protocol: `tcp` works everywhere; `rdma` on InfiniBand/RoCE (with `rdma_devices`)."""
    rdma_devices: str = ""
    """RDMA NICs for `rdma`, comma-separated (e.g. `mlx5_0,mlx5_1`); empty lets Mooncake pick."""
    clients: int = Field(8, ge=1)
    """The most processes that ask the capture servers at once, on every machine together (the trainer's world
    size, or the extraction ranks): sizes each server's share of the store, and a run with more is refused."""
    segment_gb: float | None = Field(None, gt=0)
    """Host memory each capture server lends the store (GB) for states waiting to be read. None: enough for every
    client to have its largest request waiting at this one server (a failover sends them all to one):
    `clients` x tokens of one request x bytes per token x 1.25 (eagle3.targets.mooncake.segment_bytes)."""


class SGLangSettings(Section):
    """How to reach (or start) the SGLang server used as a target backend."""

    url: str | list[str] | None = None
    """Address of a running server (`http://host:port`); None launches one with `launch_args`. With the `shm`
    transport a list gives each process of a node its own server, by LOCAL_RANK (e.g. two TP=4 servers and two
    extraction processes per node; docs/scale-out.md); server i then dumps into `<dump_dir>/<i>` (`eagle3 sglang
    serve --local-rank i`). With `mooncake` every process spreads its requests over all the listed servers, on any
    machines, and fails over when one dies or stops answering."""
    transport: Literal["shm", "mooncake"] = "shm"
    """How a server hands the states to the process that asked: `shm`, files in `dump_dir` (server and client on one
    machine), or `mooncake`, a Mooncake Store (`mooncake`: servers and clients on any machines)."""
    mooncake: MooncakeSettings = Field(default_factory=MooncakeSettings)
    """The Mooncake Store of the `mooncake` transport."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel size when eagle3 launches the server (8 for Kimi-K2.5 on one node)."""
    launch_args: list[str] = Field(default_factory=list)
    """Extra `sglang.launch_server` flags."""
    dump_dir: str = "/dev/shm/eagle3-sglang"
    """RAM-backed folder where the server drops hidden-state files for the client to read."""
    timeout_s: float = Field(600.0, gt=0)
    """Per-request timeout."""
    startup_timeout_s: float = Field(3600.0, gt=0)
    """How long to wait for a launched server to become healthy (Kimi-K2.5 takes 10-30 minutes to load)."""

    @field_validator("url")
    @classmethod
    def _some_urls(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and not v:
            raise ValueError("an empty list: give one URL, one per process of a node, or null")
        return v


