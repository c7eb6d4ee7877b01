"""The `mooncake` transport without SGLang: a real Mooncake master (`eagle3 mooncake master`), real store clients on
both sides, the capture plugin's own put path (`capture_batch`) inside fake /generate servers that compute real
states with a tiny HF model, and the client (`SGLangTarget`) reading them: states equal to the HF backend's, a
dead server failed over, lost states asked for again, a full or too small pool, an absent or dying master, each
said in one line. The same against the real SGLang 0.5.23: tests/test_sglang_real.py, tests/test_sglang_mooncake.py.

    pytest -q tests/test_mooncake.py
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from models import tiny_llama
from store_master import REPO, running_master

from eagle3.config import Config
from eagle3.logs import user_message
from eagle3.targets import sglang_capture
from eagle3.targets.mooncake import StateStore, StoreAddress, StoreError, master_problem
from eagle3.targets.sglang import SGLangTarget
from eagle3.targets.sglang_dump import DumpError, check_states, pack, prompt_states, unpack
from eagle3.targets.sglang_store import LostStates, StoreHandover

IDS = [2, 4, 6]  # eagle3 convention on the 8-layer tiny Llama
H = 64


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with running_master(tmp_path_factory.mktemp("master")) as m:
        yield m


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("t") / "llama")


def _seqs(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (int(k),), generator=g).tolist() for k in torch.randint(5, 40, (n,), generator=g)]


# ------------------------------------------------------------------------------------ one prompt's object
def test_a_prompts_object_is_safetensors_checked_like_a_dump_file():
    """The object a server puts is the safetensors layout (safetensors itself reads it), viewed in place by the
    client; fp8 storage comes back quantised with its scales, as an fp8 cache holds them; what does not match the
    prompt is refused naming the sample, as a dump file is."""
    ids, aux, final = torch.arange(7), torch.randn(7, 3 * H), torch.randn(7, H)
    for storage, scaled in (("exact", set()), ("fp8", {"aux", "final"}), ("fp8-aux", {"aux"})):
        header, parts = pack(*prompt_states(ids, aux, final, IDS, storage))
        blob = bytearray(header + b"".join(p.view(torch.uint8).numpy().tobytes() for p in parts))
        tensors, meta = unpack(memoryview(blob), "x")
        ref = safetensors.torch.load(bytes(blob))
        assert ref.keys() == tensors.keys() and all(torch.equal(ref[k].view(torch.uint8), tensors[k].view(
            torch.uint8)) for k in ref)
        c = check_states(tensors, meta, ids.tolist(), layer_ids=IDS, hidden_size=H, sample="s7", where="w")
        assert {s for s in ("aux", "final") if getattr(c, f"{s}_scale") is not None} == scaled, storage
        if not scaled:
            assert torch.equal(c.aux, aux) and torch.equal(c.final, final)
    header, parts = pack(*prompt_states(ids, aux, final, IDS, "fp8"))
    tensors, meta = unpack(header + b"".join(p.view(torch.uint8).numpy().tobytes() for p in parts), "x")
    with pytest.raises(DumpError, match="sample s7: .*storage 'exact' but holds fp8 states"):
        check_states(tensors, {**meta, "storage": "exact"}, ids.tolist(), layer_ids=IDS, hidden_size=H, sample="s7",
                     where="w")
    with pytest.raises(DumpError, match="sample s7: the server captured layers"):
        check_states(tensors, meta, ids.tolist(), layer_ids=[1, 2, 3], hidden_size=H, sample="s7", where="w")
    with pytest.raises(DumpError, match="sample s7: the server returned states for 7 tokens, the prompt has 6"):
        check_states(tensors, meta, ids.tolist()[:6], layer_ids=IDS, hidden_size=H, sample="s7", where="w")
    with pytest.raises(DumpError, match="not an eagle3 states object"):
        unpack(b"\x10" + bytes(20), "x")


# ---------------------------------------------------------------------------------------------- the master
def test_the_master_starts_health_checked_and_a_second_one_is_refused(master, tmp_path):
    """`eagle3 mooncake master` answered a real put and get before it said ready; a second one at the same address
    is refused in one line; `eagle3 mooncake command` prints what it runs (metrics port beside the RPC port)."""
    assert "a put and a get" in (master.log.parent / "master.out").read_text()
    assert master_problem(StoreAddress.of(master.settings)) is None
    cfg_file = master.log.parent / "master.yaml"
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "mooncake", "master", "--config", str(cfg_file)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"error: a Mooncake master already answers at {master.settings.master}" in r.stderr
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "mooncake", "command", "--config", str(cfg_file)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    port = int(master.settings.master.rsplit(":", 1)[1])
    assert r.returncode == 0 and f"--rpc_port={port}" in r.stdout and f"--metrics_port={port + 1}" in r.stdout
    assert "--default_kv_lease_ttl=600000" in r.stdout


def test_an_absent_master_is_one_line_in_seconds(tmp_path):
    """Mooncake's own client retries an absent master for 90 s; eagle3 says what is wrong at once."""
    from eagle3.targets.sglang_server import free_port

    addr = StoreAddress(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}/metadata")
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"the Mooncake master at 127.0.0.1:\d+ .* does not answer .*eagle3 mooncake "
                                         "master") as e:
        StateStore(addr)
    assert time.monotonic() - t0 < 10 and "\n" not in user_message(e.value)


# ------------------------------------------------------------------------------- the plugin's put, a read
class _Extend:
    def is_extend(self):
        return True

    def is_target_verify(self):
        return False


def _server_put(store: StateStore, seqs: list[list[int]], rids: list[str], storage_states: dict | None = None):
    """What the capture plugin does in a real server's forward: one prefill batch of `seqs`, handed over by rid."""
    ids = torch.tensor([t for s in seqs for t in s])
    g = torch.Generator().manual_seed(len(ids))
    aux, final = torch.randn(len(ids), 3 * H, generator=g), torch.randn(len(ids), H, generator=g)
    meta = SimpleNamespace(forward_mode=_Extend(), extend_seq_lens_cpu=[len(s) for s in seqs], rids=rids)
    assert sglang_capture.capture_batch(ids, final, meta, aux, "/nonexistent", IDS, store) == len(seqs)
    return aux, final


def test_states_cross_the_store_and_leave_nothing_behind(master, tmp_path):
    """The plugin's put (its batch split by rid, each prompt encoded by the storage its rid names) and the client's
    read: exact states bit for bit, fp8 as the cache codec quantises them; every object removed once read, and a
    later run of the same rank removes what a killed one left."""
    from eagle3.cache.codec import quantize

    addr = StoreAddress.of(master.settings)
    server = StateStore(addr, segment=256 << 20, what="a server")
    reader = StoreHandover(addr, tmp_path / "logs", rank=0, storage="exact")
    seqs = _seqs(3)
    rids = reader.keys(3)
    aux, final = _server_put(server, seqs, rids)
    at = 0
    for rid, s in zip(rids, seqs, strict=True):
        c = reader.read(rid, s, layer_ids=IDS, hidden_size=H, sample=rid, dtype=torch.float32, server="fake")
        assert torch.equal(c.aux, aux[at:at + len(s)]) and torch.equal(c.final, final[at:at + len(s)])
        at += len(s)
    reader.discard(rids)
    assert reader.last_meta["segment_bytes"] == str(256 << 20)
    fp8 = StoreHandover(addr, tmp_path / "logs", rank=1, storage="fp8")
    rid = fp8.keys(1)
    aux, final = _server_put(server, seqs[:1], rid)
    c = fp8.read(rid[0], seqs[0], layer_ids=IDS, hidden_size=H, sample="a", dtype=torch.float32, server="fake")
    q, s = quantize(aux, 3)
    assert torch.equal(c.aux.view(torch.uint8), q.view(torch.uint8)) and torch.equal(c.aux_scale, s)
    # A run killed between the server's put and its read leaves the object; the next run of that rank removes it.
    left = fp8.keys(2)
    _server_put(server, seqs[:2], left)
    again = StoreHandover(addr, tmp_path / "logs", rank=1, storage="fp8")
    for key, s in zip(left, seqs, strict=False):
        with pytest.raises(LostStates):
            again.read(key, s, layer_ids=IDS, hidden_size=H, sample="a", dtype=torch.float32, server="fake")
    for h in (reader, fp8, again):
        h.close()
    assert server.remove_prefix("eagle3/") == 0  # nothing of any rank left
    server.close()


def test_a_full_segment_is_reported_by_the_server_and_said_by_the_client(master, tmp_path):
    """Objects are hard-pinned (never evicted): a put that does not fit fails, the plugin leaves `<rid>#error`,
    and the client raises it in one line with what to raise."""
    addr = StoreAddress.of(master.settings)
    server = StateStore(addr, segment=16 << 20, what="a small server")
    reader = StoreHandover(addr, tmp_path / "logs", rank=3, storage="exact")
    seq = [3 + i % 200 for i in range(20000)]  # 20000 x 4 x 64 float32 = 20 MB > the 16 MB segment
    rid = reader.keys(1)
    _server_put(server, [seq], rid)
    with pytest.raises(StoreError, match=r"put of 20\.\d MB failed: the store is full.*segment lends 0\.02 GB.*raise "
                                         "target.sglang.mooncake.segment_gb") as e:
        reader.read(rid[0], seq, layer_ids=IDS, hidden_size=H, sample="long", dtype=torch.float32, server="fake")
    assert "\n" not in user_message(e.value)
    # A full segment never makes room by evicting states still to be read: the next put fails, the first stays.
    first, second = reader.keys(2)
    half = [3 + i % 200 for i in range(10000)]  # 10 MB each, two do not fit in 16 MB
    _server_put(server, [half], [first])
    aux, _ = _server_put(server, [half], [second])
    time.sleep(2)  # the master evicts in the background, when it does
    c = reader.read(first, half, layer_ids=IDS, hidden_size=H, sample="first", dtype=torch.float32, server="fake")
    assert c.aux.shape == (10000, 3 * H)
    with pytest.raises(StoreError, match="the store is full"):
        reader.read(second, half, layer_ids=IDS, hidden_size=H, sample="second", dtype=torch.float32, server="fake")
    reader.close()
    server.close()


class _FakeStore:
    """A store whose reads fail with a given Mooncake code (the traps peers met), for the client's words on each."""

    def __init__(self, code: int, error_record: bytes | None = None):
        self.code, self.error_record, self.removed = code, error_record, []

    def get(self, key):
        from eagle3.targets.mooncake import describe

        raise StoreError(describe(self.code))

    def get_small(self, key):
        return self.error_record

    def remove(self, keys):
        self.removed += keys

    def check_master(self, every_s=0):
        raise StoreError("the Mooncake master at x stopped answering")


@pytest.mark.parametrize(("code", "record", "error", "message"), [
    (-704, None, LostStates, "no states in the store after fake answered"),
    (-712, None, LostStates, "replica is gone"),
    (-704, b"the server's put of 9.0 MB failed: the store is full", StoreError, "sample s: fake: the server's put of "
                                                                            "9.0 MB failed: the store is full"),
    (-707, None, StoreError, "lease expired before the read finished.*eagle3 mooncake master"),
    (-800, None, StoreError, "cannot read them from the segment of fake.*EAGLE3_MOONCAKE_HOSTNAME"),
    (-900, None, StoreError, "master at x stopped answering"),
])
def test_each_failed_read_is_said_as_what_to_do(tmp_path, code, record, error, message):
    h = StoreHandover.__new__(StoreHandover)
    h.store = _FakeStore(code, record)
    with pytest.raises(error, match=message):
        h.read("k", [1, 2], layer_ids=IDS, hidden_size=H, sample="s", dtype=torch.float32, server="fake")


# ------------------------------------------------------------------------ the client against fake servers
class FakeStoreServer:
    """A /generate server handing states over through the store with the plugin's own `capture_batch`, the states
    computed by the tiny HF model (aux = hidden_states[k] for k in ids, final = the last, post-norm entry).

    `mode`: "ok"; "drop_first" (the first request's states are never put: lost); "die_after:N" (after N requests it
    drops the connection and stops listening, as a killed server would)."""

    def __init__(self, model_path: Path, addr: StoreAddress, segment: int = 128 << 20, mode: str = "ok"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.store = StateStore(addr, segment=segment, what="a fake server")
        self.mode, self.requests, self.dead = mode, 0, False
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, obj) -> None:
                raw = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/server_info":
                    self._send(200, {"disable_radix_cache": True, "chunked_prefill_size": -1, "tp_size": 1})
                else:
                    self._send(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests += 1
                if fake.mode.startswith("die_after:") and fake.requests > int(fake.mode.split(":")[1]):
                    fake.die()
                    self.close_connection = True
                    return  # no answer: the client sees the connection drop
                if not (fake.mode == "drop_first" and fake.requests == 1):
                    fake.prefill(body["input_ids"], body["rid"])
                self._send(200, [{"meta_info": {"prompt_tokens": len(ids), "cached_tokens": 0}}
                                 for ids in body["input_ids"]])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @torch.no_grad()
    def prefill(self, seqs: list[list[int]], rids: list[str]) -> None:
        aux, final = [], []
        for s in seqs:
            hs = self.model(torch.tensor([s]), output_hidden_states=True).hidden_states
            aux.append(torch.cat([hs[k][0] for k in IDS], -1))
            final.append(hs[-1][0])
        meta = SimpleNamespace(forward_mode=_Extend(), extend_seq_lens_cpu=[len(s) for s in seqs], rids=rids)
        sglang_capture.capture_batch(torch.tensor([t for s in seqs for t in s]), torch.cat(final), meta, torch.cat(aux),
                                     "/nonexistent", IDS, self.store)

    def die(self) -> None:
        if not self.dead:
            self.dead = True
            threading.Thread(target=self.httpd.shutdown, daemon=True).start()
            self.httpd.socket.close()

    def close(self) -> None:
        self.die()
        self.store.close()


def _cfg(model: Path, tmp_path: Path, master_settings, urls: list[str]) -> Config:
    cfg = Config(output_dir=str(tmp_path / "run"))
    t = cfg.target
    t.path, t.dtype, t.backend, t.aux_layer_ids = str(model), "float32", "sglang", IDS
    t.sglang.url, t.sglang.transport, t.sglang.mooncake = urls, "mooncake", master_settings
    t.sglang.dump_dir = str(tmp_path / "dump")
    return cfg


def _target(cfg: Config, **kw) -> SGLangTarget:
    return SGLangTarget(cfg.target, cfg.extract, cfg.data.max_length, cfg.paths.logs_dir, **kw)


def _hf_states(model: Path, tmp_path: Path, seqs):
    from eagle3.targets.hf import HFTarget

    cfg = Config(output_dir=str(tmp_path / "hf"))
    cfg.target.path, cfg.target.dtype, cfg.target.aux_layer_ids = str(model), "float32", IDS
    return HFTarget(cfg.target, cfg.extract).capture(seqs)


def test_a_dead_server_is_failed_over_and_every_sample_comes_back_once(master, llama, tmp_path, caplog):
    """Two servers in target.sglang.url: requests alternate between them; one dies mid-way (its connection drops,
    then nothing listens) and the rest go to the other, logged and counted. Every batch comes back whole, with the
    states the HF backend computes; nothing is left in the store."""
    addr = StoreAddress.of(master.settings)
    a, b = FakeStoreServer(llama, addr), FakeStoreServer(llama, addr, mode="die_after:4")  # 3 preflight probes, 1 batch
    try:
        t = _target(_cfg(llama, tmp_path, master.settings, [a.url, b.url]))  # preflight: a probe through each
        batches = [_seqs(3)[i:i + 1] + _seqs(5)[i:i + 2] for i in range(6)]
        with caplog.at_level("WARNING", logger="eagle3"):
            got = [t.capture(batch) for batch in batches]
        assert t.pool.failovers == 1 and b.dead and a.requests >= 5
        assert f"SGLang server {b.url} failed a request" in caplog.text and "sent to the other 1 server" in caplog.text
        for batch, caps in zip(batches, got, strict=True):
            for s, c, r in zip(batch, caps, _hf_states(llama, tmp_path, batch), strict=True):
                assert c.aux.shape == (len(s), 3 * H)
                torch.testing.assert_close(c.aux, r.aux, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(c.final, r.final, rtol=1e-5, atol=1e-5)
        t.close()
    finally:
        a.close()
        b.close()
    checker = StateStore(addr, segment=0, what="the test")
    assert checker.remove_prefix("eagle3/") == 0
    checker.close()


def test_lost_states_are_asked_for_again(master, llama, tmp_path, caplog):
    addr = StoreAddress.of(master.settings)
    srv = FakeStoreServer(llama, addr, mode="drop_first")
    try:
        t = _target(_cfg(llama, tmp_path, master.settings, [srv.url]), preflight=False)
        seqs = _seqs(2)
        with caplog.at_level("WARNING", logger="eagle3"):
            got = t.capture(seqs)
        assert t.handover.lost == 1 and srv.requests == 2 and "the request is made again (1 so far)" in caplog.text
        for c, r in zip(got, _hf_states(llama, tmp_path, seqs), strict=True):
            torch.testing.assert_close(c.aux, r.aux, rtol=1e-5, atol=1e-5)
        t.close()
    finally:
        srv.close()


def test_a_pool_too_small_or_too_many_clients_is_refused_before_work(master, llama, tmp_path, monkeypatch):
    """The preflight compares a server's share of the store with what this run's processes can leave waiting at
    once (processes x the largest request x bytes per token); a world bigger than `clients` is refused first."""
    addr = StoreAddress.of(master.settings)
    srv = FakeStoreServer(llama, addr, segment=70 << 20)
    try:
        cfg = _cfg(llama, tmp_path, master.settings, [srv.url])
        with pytest.raises(StoreError, match=r"the store is too small: the server at .* lends 0\.07 GB, and 1 "
                                             r"process\(es\) x 65536 tokens per request x 1032 bytes per token need "
                                             r"0\.\d+ GB .*segment_gb") as e:
            _target(cfg, request=(65536, "exact"))
        assert "\n" not in user_message(e.value)
        _target(cfg, request=(4096, "exact")).close()  # 4096 x 1032 bytes fit
        monkeypatch.setenv("WORLD_SIZE", "9")
        with pytest.raises(StoreError, match="9 processes ask the capture servers, target.sglang.mooncake.clients is "
                                             "8: raise it to 9 and restart the servers"):
            _target(cfg)
    finally:
        srv.close()


def test_a_master_that_dies_mid_run_is_one_line_within_seconds(llama, tmp_path):
    """The master killed while a client reads: its next request fails in one line naming the master, within
    seconds, not a Mooncake error code deep in a traceback."""
    with running_master(tmp_path / "own-master") as m:
        addr = StoreAddress.of(m.settings)
        srv = FakeStoreServer(llama, addr)
        try:
            t = _target(_cfg(llama, tmp_path, m.settings, [srv.url]), preflight=False)
            t.handover.store._checked = 0.0  # noqa: SLF001 - the periodic check is due at once
            assert len(t.capture(_seqs(2))) == 2
            m.kill()
            t0 = time.monotonic()
            with pytest.raises(StoreError, match=f"the Mooncake master at {m.settings.master} .*stopped answering") as e:
                for _ in range(50):
                    t.capture(_seqs(2))
                    time.sleep(0.5)
            assert time.monotonic() - t0 < 30 and "\n" not in user_message(e.value)
            t.close()
        finally:
            srv.close()


def test_the_server_command_joins_the_store_with_its_derived_share(master, llama, tmp_path, capsys, monkeypatch):
    """`eagle3 sglang command` with the mooncake transport: the store's address and the segment the config derives
    (clients x the largest request x bytes per token x 1.25), in the environment the plugin reads."""
    from eagle3.cli import main
    from eagle3.targets.mooncake import SEGMENT_FLOOR

    monkeypatch.setattr("eagle3.cli.setup_logging", lambda: None)
    cfg = _cfg(llama, tmp_path, master.settings, ["http://127.0.0.1:30000"])
    cfg.extract.mode, cfg.extract.storage, cfg.train.batch_tokens = "online", "fp8", 2048
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(cfg.to_yaml())
    assert main(["sglang", "command", "--config", str(cfg_file)]) == 0
    out = capsys.readouterr().out
    per_token = 4 * (H + 4) + 8  # fp8 states and scales, the int64 id
    assert f"EAGLE3_MOONCAKE_MASTER={master.settings.master}" in out
    assert f"EAGLE3_MOONCAKE_SEGMENT={int(8 * 2048 * per_token * 1.25) + SEGMENT_FLOOR}" in out
    assert "--port 30000" in out


def test_online_items_are_what_a_cache_of_that_storage_holds(llama, tmp_path):
    """capture_items in fp8 storage: a backend's exact states quantised by the cache codec (so online training on
    fp8 sees what an fp8 cache holds), the argmax taken on the exact final state; states a server sends encoded
    pass through as they came."""
    from eagle3.cache.codec import quantize
    from eagle3.online import capture_items
    from eagle3.targets.base import Captured
    from eagle3.targets.hf import HFTarget

    cfg = Config(output_dir=str(tmp_path / "hf"))
    cfg.target.path, cfg.target.dtype, cfg.target.aux_layer_ids = str(llama), "float32", IDS
    backend = HFTarget(cfg.target, cfg.extract)
    seqs = _seqs(2)
    data = {"id": ["a", "b"], "input_ids": seqs, "loss_mask": [[1] * len(s) for s in seqs]}

    class Rows:
        def __getitem__(self, idx):
            return {k: [v[i] for i in idx] for k, v in data.items()}

    def argmax(final):
        return final.float().argmax(-1)

    exact = backend.capture(seqs)
    items = capture_items(backend, Rows(), [0, 1], argmax, storage="fp8")
    for it, c in zip(items, exact, strict=True):
        q, s = quantize(c.aux, 3)
        assert torch.equal(it["aux"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(it["aux_scale"], s)
        assert torch.equal(it["target_argmax"], c.final.argmax(-1))
    sent = SimpleNamespace(capture=lambda rows: [Captured(*quantize(c.aux, 3)[:1], *quantize(c.final, 1)[:1],
                                                          quantize(c.aux, 3)[1], quantize(c.final, 1)[1])
                                                 for c in exact], dtype=torch.float32)
    for it, c in zip(capture_items(sent, Rows(), [0, 1], argmax, storage="fp8"), items, strict=True):
        assert all(torch.equal(it[k].view(torch.uint8), c[k].view(torch.uint8)) for k in ("aux", "final"))


def test_a_server_without_mooncake_or_its_master_is_refused_before_it_serves(tmp_path, monkeypatch):
    """The two ways a capture server would hand nothing over, each refused in one line before it serves: its Python
    cannot load Mooncake (here a `mooncake` whose library is missing, as without libibverbs), checked before
    `eagle3 sglang serve` or a launch; the store's master not there when the server loads its model (the plugin's
    load-model hook raises, which stops SGLang's start)."""
    from eagle3.targets.sglang_server import ServerError, check_plugin, free_port

    fake = tmp_path / "site" / "mooncake"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "store.py").write_text("raise ImportError('libibverbs.so.1: cannot open shared object file')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    with pytest.raises(ServerError, match=r"cannot load Mooncake, so the server would hand no states over .*"
                                          r"libibverbs.*apt-get install -y libibverbs1") as e:
        check_plugin(sys.executable, mooncake=True)
    assert "\n" not in user_message(e.value)
    check_plugin(sys.executable)  # the plugin alone is there: fine without the store
    monkeypatch.delenv("PYTHONPATH")
    addr = StoreAddress(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}/metadata")
    for k, v in addr.env().items():
        monkeypatch.setenv(k, v)
    with pytest.raises(StoreError, match="the Mooncake master at .* does not answer"):
        sglang_capture.open_store()
