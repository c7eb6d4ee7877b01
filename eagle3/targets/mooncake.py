"""The Mooncake Store that carries hidden states from capture servers to the processes that asked for them, on any
machines (`target.sglang.transport: mooncake`), and the master it needs.

    eagle3 mooncake master --config configs/kimi-k2.5.yaml    # on the master's machine: started, then health-checked
    eagle3 mooncake check --config configs/kimi-k2.5.yaml     # from a trainer node: one probe through every server

Who holds what (docs/scale-out.md "Online across machines" has the arithmetic):
- Each capture server's TP rank 0 mounts `segment_bytes` of its host memory into the store and puts each request's
  states there under the key the client chose (the request's SGLang rid): a memcpy on its own machine, so the
  server's forward loop never waits on the network. The client, a trainer rank on another machine, reads them
  over TCP or RDMA into one registered buffer of its own (`get_into`, no copy in between) and removes them.
- Objects are hard-pinned, so the store never evicts states that are still to be read; a full segment is a failed
  put instead, reported to the client under `<key>#error`. The segment must hold every client's largest request at
  once: a failover can send all of them to one server (`segment_bytes`).
- A read takes a lease on the object (10 s by default), and a lease blocks a plain remove: the reader removes with
  `force`, and `eagle3 mooncake master` gives leases 10 minutes so that a slow read of a 2 GB object never
  outlives its lease (-707).
- A client that dies takes its segment's objects with it; what a dead *reader* left in a server's segment is
  removed by its next run (every key starts with its run and rank: `remove_prefix`).

The traps peers met (../shared/MOONCAKE.md) each fail here in one line that says what to do: no Mooncake or no
libibverbs in this Python, a master that is not there (Mooncake's own client retries for 90 s first), a wrong
address for a server's segment, a full pool, a lease that ran out, a master that died mid-run.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np
import torch

from eagle3.logs import UserError

if TYPE_CHECKING:
    from eagle3.config import MooncakeSettings

log = logging.getLogger("eagle3")

TESTED_VERSION = "0.3.13.post1"
INSTALL_HINT = (f"pip install mooncake-transfer-engine-non-cuda=={TESTED_VERSION} (on a CUDA machine "
                f"mooncake-transfer-engine=={TESTED_VERSION} works too; never both: they overwrite each other), and "
                "the system's libibverbs (Debian/Ubuntu: apt-get install -y libibverbs1); bash scripts/setup_mooncake.sh "
                "does both")
NEEDED_CALLS = ("setup", "register_buffer", "unregister_buffer", "batch_put_from", "get_into", "get_size", "remove",
                "remove_by_regex", "get_hostname", "close")
ENV_HOSTNAME = "EAGLE3_MOONCAKE_HOSTNAME"
"""This machine's address as the others reach it (default: the address that routes to the master)."""
ENV_LOG = "EAGLE3_MOONCAKE_LOG"
"""Set to 1 to keep Mooncake's own INFO/ERROR lines on stderr (eagle3 mutes them: they repeat what it says)."""
LEASE_S = 600
"""The read lease `eagle3 mooncake master` sets: longer than any read of one request's states."""
SEGMENT_MARGIN = 1.25
SEGMENT_FLOOR = 64 << 20
"""Room for the error records and preflight probes beside the states."""
MASTER_CHECK_S = 5.0
"""How often a client checks that the master still answers: a dead master is an error within seconds."""

# Mooncake's ErrorCode values (mooncake-store/include/types.h) a client meets, with what each means here.
CODES = {
    -1: "internal error",
    -10: "buffer overflow",
    -101: "no segment to put into (no capture server's segment is mounted)",
    -200: "the store is full: no segment has room (hard-pinned states are never evicted)",
    -600: "invalid parameters (a buffer smaller than the object?)",
    -704: "object not found",
    -705: "object already exists",
    -706: "a read lease holds the object",
    -707: "the read lease expired before the read finished (a read slower than the master's "
          "--default_kv_lease_ttl: start the master with `eagle3 mooncake master`, which sets 10 minutes)",
    -712: "the object's replica is gone (its segment was unmounted: the server holding it died)",
    -800: "the transfer failed (the segment's address cannot be reached from this machine?)",
    -900: "the master did not answer (RPC failed)",
    -901: "the master did not answer in time (RPC timeout)",
}


class StoreError(UserError, RuntimeError):
    """The store cannot be used as configured; phrased for the user, one line."""


def describe(code: int) -> str:
    return f"{CODES.get(code, 'Mooncake error')} ({code})"


# ----------------------------------------------------------------------------------------------- the module
_MODULE: Any = None
_MODULE_LOCK = threading.Lock()


def store_module() -> Any:
    """`mooncake.store`, checked for every call eagle3 makes (an older wheel lacks some: fail in one line naming
    them, not with an AttributeError mid-run), with Mooncake's own log lines muted unless EAGLE3_MOONCAKE_LOG=1."""
    global _MODULE
    with _MODULE_LOCK:
        if _MODULE is not None:
            return _MODULE
        try:
            import mooncake.store as store
        except ImportError as e:
            if "libibverbs" in str(e) or "libnuma" in str(e) or "libcurl" in str(e):
                raise StoreError(f"Mooncake is installed but cannot load a system library it links ({e}): "
                                 f"{INSTALL_HINT}") from None
            raise StoreError(f"no Mooncake in this Python ({e}): {INSTALL_HINT}") from None
        missing = [c for c in NEEDED_CALLS if not hasattr(store.MooncakeDistributedStore, c)]
        if missing:
            raise StoreError(f"this Mooncake ({installed_version()}) lacks {', '.join(missing)}: {INSTALL_HINT}")
        if os.environ.get(ENV_LOG) != "1":
            _mute_glog(store.__file__)
        _MODULE = store
        return store


def installed_version() -> str:
    """Which Mooncake distribution provides the `mooncake` package here, and its version."""
    for dist in importlib.metadata.packages_distributions().get("mooncake", []):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown version"


def _mute_glog(store_file: str) -> None:
    """Mooncake logs through its own bundled glog, which reads no environment variable: set glog's minimum level
    to FATAL in the loaded library, so a failed call prints eagle3's one line and not a page of C++ log."""
    libs = Path(store_file).resolve().parent.parent
    for lib in glob.glob(str(libs / "mooncake_transfer_engine*.libs" / "libglog-*.so*")):
        try:
            ctypes.c_int32.in_dll(ctypes.CDLL(lib), "_ZN3fLI17FLAGS_minloglevelE").value = 3
        except (OSError, ValueError):
            pass


# ---------------------------------------------------------------------------------------------- addresses
@dataclass(frozen=True)
class StoreAddress:
    """Where the store's master and metadata service are, and how segments are reached."""

    master: str
    metadata: str
    protocol: str = "tcp"
    rdma_devices: str = ""

    @classmethod
    def of(cls, s: MooncakeSettings) -> StoreAddress:
        host, _ = split_host_port(s.master, "target.sglang.mooncake.master")
        return cls(s.master, s.metadata_server or f"http://{host}:8080/metadata", s.protocol, s.rdma_devices)

    def env(self) -> dict[str, str]:
        """For the server's environment (its plugin reads it back with `from_env`)."""
        return {"EAGLE3_MOONCAKE_MASTER": self.master, "EAGLE3_MOONCAKE_METADATA": self.metadata,
                "EAGLE3_MOONCAKE_PROTOCOL": self.protocol, "EAGLE3_MOONCAKE_RDMA_DEVICES": self.rdma_devices}

    @classmethod
    def from_env(cls) -> StoreAddress | None:
        master = os.environ.get("EAGLE3_MOONCAKE_MASTER")
        if not master:
            return None
        return cls(master, os.environ["EAGLE3_MOONCAKE_METADATA"], os.environ.get("EAGLE3_MOONCAKE_PROTOCOL", "tcp"),
                   os.environ.get("EAGLE3_MOONCAKE_RDMA_DEVICES", ""))


def split_host_port(addr: str, where: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise StoreError(f"{where}={addr!r}: expected host:port")
    return host.strip("[]"), int(port)


def local_hostname(master: str) -> str:
    """This machine's address as other machines reach it: $EAGLE3_MOONCAKE_HOSTNAME, else the address of the
    interface that routes to the master (127.0.0.1 when the master is on this machine's loopback)."""
    given = os.environ.get(ENV_HOSTNAME)
    if given:
        return given
    host, port = split_host_port(master, "target.sglang.mooncake.master")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # no packet is sent: this only asks the kernel for the route
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def master_problem(addr: StoreAddress, timeout_s: float = 3.0) -> str | None:
    """Why the master cannot be used, or None: its RPC port and its metadata service both answer. Mooncake's own
    client retries an absent master for 90 s before it fails; this says so in seconds."""
    host, port = split_host_port(addr.master, "target.sglang.mooncake.master")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return (f"the Mooncake master at {addr.master} (target.sglang.mooncake.master) does not answer ({e}): start "
                f"it with `eagle3 mooncake master --config ...` on that machine, or fix the address")
    if addr.metadata.startswith("http"):
        try:
            urllib.request.urlopen(f"{addr.metadata}?key=eagle3-probe", timeout=timeout_s).close()  # noqa: S310
        except urllib.error.HTTPError:
            pass  # it answered (404: no such key): the service is up
        except (OSError, urllib.error.URLError) as e:
            return (f"the Mooncake metadata service at {addr.metadata} does not answer ({getattr(e, 'reason', e)}): "
                    "the master must run with its HTTP metadata server (`eagle3 mooncake master` starts it so), "
                    "or set target.sglang.mooncake.metadata_server")
    return None


def segment_bytes(clients: int, request_tokens: int, bytes_per_token: int, segment_gb: float | None = None,
                  margin: float = SEGMENT_MARGIN) -> int:
    """Memory one capture server lends the store: `segment_gb` when given, else room for every client's largest
    request at once (x `margin`, plus SEGMENT_FLOOR for probes and error records); margin 1 is the least that
    works (the preflight's check)."""
    if segment_gb is not None:
        return int(segment_gb * 1e9)
    return int(clients * request_tokens * bytes_per_token * margin) + SEGMENT_FLOOR


# -------------------------------------------------------------------------------------------------- the client
class _Buffer:
    """A host buffer registered with the transfer engine (zero-copy puts and gets), grown on demand."""

    def __init__(self, store: Any):
        self.store = store
        self.array = np.empty(0, dtype=np.uint8)

    def ensure(self, n: int) -> np.ndarray:
        if n > self.array.size:
            self.release()
            self.array = np.empty(max(n, int(self.array.size * 1.5)), dtype=np.uint8)
            rc = self.store.register_buffer(self.array.ctypes.data, self.array.size)
            if rc != 0:
                raise StoreError(f"Mooncake could not register a {self.array.size / 1e9:.2f} GB buffer: "
                                 f"{describe(rc)}")
        return self.array

    def release(self) -> None:
        if self.array.size:
            self.store.unregister_buffer(self.array.ctypes.data)
            self.array = np.empty(0, dtype=np.uint8)


class StateStore:
    """One process's connection to the store: a server's (`segment` > 0: it lends memory and puts) or a reader's
    (segment 0: it gets and removes)."""

    def __init__(self, addr: StoreAddress, segment: int = 0, what: str = "this process"):
        problem = master_problem(addr)
        if problem:
            raise StoreError(problem)
        store = store_module()
        self.addr, self.segment = addr, segment
        self.hostname = local_hostname(addr.master)
        self._store = store.MooncakeDistributedStore()
        rc = self._store.setup(self.hostname, addr.metadata, segment, 16 << 20, addr.protocol, addr.rdma_devices,
                               addr.master)
        if rc != 0:
            raise StoreError(f"{what} could not join the Mooncake Store at {addr.master} as {self.hostname} "
                             f"({describe(rc)}; {segment / 1e9:.2f} GB lent): check the address ({ENV_HOSTNAME} "
                             "overrides it) and that the master is eagle3's (`eagle3 mooncake master`)")
        self.segment_name = str(self._store.get_hostname())
        self._config = store.ReplicateConfig()
        self._config.replica_num = 1
        self._config.with_hard_pin = True  # never evicted: states wait for their reader, a full pool fails the put
        self._config.preferred_segment = self.segment_name
        self._out, self._in = _Buffer(self._store), _Buffer(self._store)
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self._closed = False

    # -- puts (the server)
    def put(self, objects: dict[str, tuple[bytes, list[torch.Tensor]]]) -> dict[str, int]:
        """Put each key's header and tensor parts as one object; the code of each put (0: stored). The parts are
        copied straight into the registered buffer (from a GPU: the device-to-host copy itself)."""
        if not objects:
            return {}
        sizes = {k: len(h) + sum(p.numel() * p.element_size() for p in parts) for k, (h, parts) in objects.items()}
        with self._lock:
            buf = torch.from_numpy(self._out.ensure(sum(sizes.values())))
            ptrs, offset = [], 0
            for header, parts in objects.values():
                ptrs.append(self._out.array.ctypes.data + offset)
                buf[offset:offset + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
                at = offset + len(header)
                for p in parts:
                    n = p.numel() * p.element_size()
                    buf[at:at + n].view(p.dtype).view(p.shape).copy_(p)
                    at += n
                offset = at
            codes = self._store.batch_put_from(list(objects), ptrs, list(sizes.values()), self._config)
        return dict(zip(objects, (int(c) for c in codes), strict=True))

    def put_small(self, key: str, data: bytes) -> int:
        """A small object (an error record, a probe) through the copying call."""
        with self._lock:
            return int(self._store.put(key, data, self._config))

    # -- gets (the client)
    def get(self, key: str) -> memoryview:
        """The object's bytes, in this store's receive buffer (valid until the next get); StoreError when it is
        not there or cannot be read, with why."""
        with self._lock:
            size = int(self._store.get_size(key))
            if size < 0:
                raise StoreError(describe(size))
            arr = self._in.ensure(size)
            got = int(self._store.get_into(key, arr.ctypes.data, size))
            if got != size:
                raise StoreError(describe(got) if got < 0 else f"read {got} of {size} bytes")
            return memoryview(arr)[:size]

    def get_small(self, key: str) -> bytes | None:
        with self._lock:
            data = self._store.get(key)
        return bytes(data) if data else None

    def remove(self, keys: list[str]) -> None:
        """Remove objects, leased or not (a read's lease would block a plain remove for its TTL)."""
        with self._lock:
            for k in keys:
                self._store.remove(k, True)

    def remove_prefix(self, prefix: str) -> int:
        """Remove every object whose key starts with `prefix`; how many there were."""
        import re

        with self._lock:
            n = int(self._store.remove_by_regex("^" + re.escape(prefix), True))
        return max(n, 0)

    # -- health
    def check_master(self, every_s: float = MASTER_CHECK_S) -> None:
        """Raise StoreError when the master stopped answering (checked at most every `every_s`)."""
        now = time.monotonic()
        if every_s and now - self._checked < every_s:
            return
        self._checked = now
        problem = master_problem(self.addr, timeout_s=2.0)
        if problem:
            raise StoreError(problem.replace("does not answer", "stopped answering", 1))

    def master_gone(self) -> bool:
        return master_problem(self.addr, timeout_s=1.0) is not None

    def close(self) -> None:
        """Leave the store (a server's segment and whatever is still in it go with it)."""
        if self._closed:
            return
        self._closed = True
        if self.master_gone():
            return  # each teardown call would wait out the master's RPC timeout; the process is leaving anyway
        with self._lock:
            self._out.release()
            self._in.release()
            self._store.close()


# -------------------------------------------------------------------------------------------------- the master
def master_command(addr: StoreAddress, lease_s: int = LEASE_S) -> list[str]:
    """`mooncake_master` serving `addr`: its RPC service and its built-in HTTP metadata server, read leases of
    `lease_s` (module docstring). It binds the addresses it is given: the cluster's private network, never a public
    one (the master has no authentication)."""
    host, port = split_host_port(addr.master, "target.sglang.mooncake.master")
    meta = urlparse(addr.metadata)
    if meta.scheme != "http" or not meta.hostname or not meta.port:
        raise StoreError(f"target.sglang.mooncake.metadata_server={addr.metadata!r}: `eagle3 mooncake master` starts "
                         "the master's own HTTP metadata server (http://host:port/metadata); with etcd, start the "
                         "master yourself")
    binary = Path(store_module().__file__).resolve().parent / "mooncake_master"
    # Its admin/metrics server would take port 9003 on every interface: beside the RPC port instead, on its host,
    # so that two masters on one machine (two jobs, the tests) do not collide.
    return [str(binary), f"--rpc_address={host}", f"--rpc_port={port}", "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={meta.hostname}", f"--http_metadata_server_port={meta.port}",
            f"--default_kv_lease_ttl={lease_s * 1000}", f"--metrics_host={host}", f"--metrics_port={port + 1}"]


def health_check(addr: StoreAddress) -> float:
    """One object put, read back and removed through a client lending a small segment; seconds it took."""
    t0 = time.monotonic()
    store = StateStore(addr, segment=SEGMENT_FLOOR, what="the health check")
    try:
        key, data = f"eagle3-health/{os.getpid()}", os.urandom(4096)
        rc = store.put_small(key, data)
        if rc != 0:
            raise StoreError(f"the health check could not put into the store at {addr.master}: {describe(rc)}")
        if store.get_small(key) != data:
            raise StoreError(f"the health check read back other bytes than it put at {addr.master}")
        store.remove([key])
    finally:
        store.close()
    return time.monotonic() - t0


def run_master(addr: StoreAddress, dry_run: bool = False, log_file: Path | None = None,
               ready_timeout_s: float = 60.0) -> int:
    """`eagle3 mooncake master`: print the command, start the master, wait until it answers, health-check it with
    a real put and get, then stay in the foreground until it exits (SIGTERM/SIGINT stop it)."""
    import shlex
    import signal
    import subprocess

    cmd = master_command(addr)
    print(shlex.join(cmd), flush=True)
    if dry_run:
        return 0
    if master_problem(addr, timeout_s=1.0) is None:
        raise StoreError(f"a Mooncake master already answers at {addr.master}: use it, or stop it first")
    out = open(log_file, "ab") if log_file else None  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None)
    stop = {"sig": 0}

    def forward(signum: int, frame: Any) -> None:
        stop["sig"] = signum
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        t0 = time.monotonic()
        while (problem := master_problem(addr, timeout_s=1.0)) is not None:
            if proc.poll() is not None:
                raise StoreError(f"mooncake_master exited with code {proc.returncode} before it answered ({problem})"
                                 + (f"; its log: {log_file}" if log_file else ""))
            if time.monotonic() - t0 > ready_timeout_s:
                raise StoreError(f"mooncake_master did not answer within {ready_timeout_s:.0f} s: {problem}")
            time.sleep(0.2)
        took = health_check(addr)
        print(f"Mooncake master ready at {addr.master} (metadata {addr.metadata}; pid {proc.pid}; a put and a get "
              f"in {took:.2f} s). Trusted networks only: it has no authentication. Stop it with Ctrl-C or "
              f"`kill {proc.pid}`.", flush=True)
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for s, h in old.items():
            signal.signal(s, h)
        if out:
            out.close()
