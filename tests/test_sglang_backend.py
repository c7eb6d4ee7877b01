"""SGLang backend on CPU, without sglang: the dump protocol, the capture plugin's half of the contract (both
aux-state layouts of SGLang 0.5.23, ids from the forward batch), the client against a fake /generate server on
127.0.0.1 that computes real states with a tiny HF model, token-count checks, cleanup, id translation, the
command line, and the real cache writer. The same paths against the real SGLang: tests/test_sglang_real.py.

    pytest -q tests/test_sglang_backend.py
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from models import make_prepared, tiny_llama, tiny_target_cfg

from eagle3.config import Config, load_config
from eagle3.layer_ids import LAYER_ID_CONVENTION, to_engine_ids
from eagle3.targets import sglang_capture
from eagle3.targets.info import read_target_info
from eagle3.targets.sglang import SGLangTarget, capture_flags, check_launch_args, server_env
from eagle3.targets.sglang_dump import (
    ENV_DUMP_DIR,
    ENV_FAMILY,
    ENV_LAYER_IDS,
    MARKER,
    DumpError,
    clean_dump_dir,
    dump_path,
    ensure_dump_dir,
    read_dump,
    remove_dump_dir,
    sequence_key,
    write_dump,
)

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
IDS = [2, 4, 6]  # eagle3 convention on the 8-layer tiny Llama


# ------------------------------------------------------------------------------------------ the fake server
class FakeSGLang:
    """Stands in for eagle3's patched SGLang server: /health, /server_info, /generate. /generate computes the
    states with HF transformers (aux = hidden_states[k] for k in ids = input of layer k; final = the last,
    post-norm entry) and writes them with the same `write_dump` the real patch uses.

    `mode` injects faults: "ok", "cached" (reports a radix hit), "chunk" (dumps only the tail of the prompt,
    as a chunked prefill would), "short" (a buggy dump one token short under the prompt's name), "nodump",
    "radix_on" (server_info says the radix cache is on), "unhealthy" (/health answers 503: still loading)."""

    def __init__(self, model_path: Path, dump_dir: Path, layer_ids: list[int], mode: str = "ok"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.dump_dir, self.layer_ids, self.mode = Path(dump_dir), layer_ids, mode
        self.requests: list[dict] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
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
                    self._send(503 if fake.mode == "unhealthy" else 200, {})
                elif self.path == "/server_info":
                    self._send(200, {"disable_radix_cache": fake.mode != "radix_on", "chunked_prefill_size": -1,
                                     "enable_dp_attention": False, "tp_size": 1,
                                     "attn_dp_size": 2 if fake.mode == "attn_dp" else 1,
                                     "flashinfer_allreduce_fusion_backend": "auto" if fake.mode == "fusion" else None})
                else:
                    self._send(404, {"error": "no route"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                self._send(200, [fake.generate(ids) for ids in body["input_ids"]])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @torch.no_grad()
    def generate(self, ids: list[int]) -> dict:
        hs = self.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[k][0] for k in self.layer_ids], dim=-1)
        final = hs[-1][0]
        t = torch.tensor(ids)
        if self.mode == "chunk":
            write_dump(self.dump_dir, t[3:], aux[3:], final[3:], self.layer_ids)
        elif self.mode == "short":
            from safetensors.torch import save_file

            save_file({"input_ids": t[:-1], "aux": aux[:-1], "final": final[:-1]},
                      str(dump_path(self.dump_dir, sequence_key(ids))),
                      metadata={"format": "eagle3-sglang-dump/1", "layer_ids": json.dumps(self.layer_ids),
                                "convention": LAYER_ID_CONVENTION})
        elif self.mode == "tp_split":
            from eagle3.targets.sglang_dump import write_error

            write_error(self.dump_dir, t, "the TP ranks hold different hidden states (partial sums)")
        elif self.mode != "nodump":
            write_dump(self.dump_dir, t, aux, final, self.layer_ids)
        cached = 3 if self.mode == "cached" else 0
        return {"text": "", "output_ids": [0], "meta_info": {"prompt_tokens": len(ids), "cached_tokens": cached}}

    def __enter__(self) -> FakeSGLang:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch):
    monkeypatch.setattr(SGLangTarget, "dump_grace_s", 0.3)  # fakes answer after writing, as the real patch does


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("t") / "llama")


def sglang_target(cfg: Config, **kw) -> SGLangTarget:
    """The SGLang backend of a config, as eagle3.targets.make_backend builds it."""
    return SGLangTarget(cfg.target, cfg.extract, cfg.data.max_length, cfg.paths.logs_dir, **kw)


def _cfg(model: Path, tmp_path: Path, url: str | None = None, **sglang) -> Config:
    cfg = Config(output_dir=str(tmp_path / "run"))
    cfg.target.path = str(model)
    cfg.target.dtype = "float32"
    cfg.target.backend = "sglang"
    cfg.target.aux_layer_ids = IDS
    cfg.target.sglang.url = url
    cfg.target.sglang.dump_dir = str(tmp_path / "dump")
    for k, v in sglang.items():
        setattr(cfg.target.sglang, k, v)
    return cfg


def _seqs() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 1, 23, 9)]


# ------------------------------------------------------------------------------------------- dump protocol
def test_key_is_the_same_for_a_device_tensor_and_the_clients_list():
    ids = [5, 1, 163839, 7]
    assert sequence_key(ids) == sequence_key(torch.tensor(ids, dtype=torch.int32)) == sequence_key(torch.tensor(ids))
    assert sequence_key(ids) != sequence_key(ids[:-1])


def test_dump_roundtrip_and_every_mismatch_is_refused_naming_the_sample(tmp_path):
    H, ids = 8, [4, 5, 6, 7, 8]
    aux, final = torch.randn(5, 3 * H), torch.randn(5, H)
    p = write_dump(tmp_path, torch.tensor(ids), aux, final, IDS)
    assert p == dump_path(tmp_path, sequence_key(ids)) and not list(tmp_path.glob(".*tmp*"))
    c = read_dump(p, ids, layer_ids=IDS, hidden_size=H, sample="s-1")
    assert torch.equal(c.aux, aux) and torch.equal(c.final, final)

    with pytest.raises(DumpError, match=r"sample s-1: the server returned states for 5 tokens, the prompt has 6"):
        read_dump(p, ids + [9], layer_ids=IDS, hidden_size=H, sample="s-1")
    with pytest.raises(DumpError, match=r"sample s-2: the server captured layers \[2, 4, 6\].*\[1, 4, 6\]"):
        read_dump(p, ids, layer_ids=[1, 4, 6], hidden_size=H, sample="s-2")
    with pytest.raises(DumpError, match=r"sample s-3: aux states have shape \(5, 24\), expected \(5, 48\)"):
        read_dump(p, ids, layer_ids=IDS, hidden_size=16, sample="s-3")
    with pytest.raises(DumpError, match=r"sample s-4: the dump's token ids differ"):
        read_dump(p, [4, 5, 6, 7, 9], layer_ids=IDS, hidden_size=H, sample="s-4")
    with pytest.raises(DumpError, match=r"sample s-5: no hidden-state dump"):
        read_dump(tmp_path / "nope.safetensors", ids, layer_ids=IDS, hidden_size=H, sample="s-5")
    bad = aux.clone()
    bad[2, 1] = float("nan")
    q = write_dump(tmp_path, torch.tensor([1, 2, 3, 4, 5]), bad, final, IDS)
    with pytest.raises(DumpError, match="NaN"):
        read_dump(q, [1, 2, 3, 4, 5], layer_ids=IDS, hidden_size=H, sample="s-6")


def test_cleanup_removes_only_eagle3_files(tmp_path):
    d = ensure_dump_dir(tmp_path / "dump")
    write_dump(d, torch.tensor([1, 2]), torch.zeros(2, 6), torch.zeros(2, 2), IDS)
    (d / f".{'a' * 64}.tmp-123").write_bytes(b"half")
    (d / "notes.txt").write_text("not ours")
    assert clean_dump_dir(d) == 2
    assert sorted(p.name for p in d.iterdir()) == sorted([MARKER, "notes.txt"])
    remove_dump_dir(d)
    assert d.is_dir() and (d / "notes.txt").exists()  # a foreign file keeps the folder
    (d / "notes.txt").unlink()
    remove_dump_dir(d)
    assert not d.exists()


# ------------------------------------------------------------------------------ layer ids and the patch side
def test_kimi_and_smollm2_layer_id_spellings():
    kimi = [2, 30, 58]
    assert to_engine_ids(kimi, "sglang", "deepseek") == [1, 29, 57]  # read as [2, 30, 58] before and after 0.5.23
    assert to_engine_ids(kimi, "vllm", "deepseek") == [2, 30, 58]
    assert to_engine_ids([2, 15, 27], "sglang", "llama") == [1, 14, 26]
    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    assert cfg.target.aux_layer_ids == kimi and cfg.target.layer_ids(61) == kimi
    assert cfg.target.backend == "sglang" and cfg.target.sglang.tp_size == 8


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers_to_capture: list[int] = []


class _FakeModel(torch.nn.Module):
    """Mimics SGLang 0.5.23's `set_eagle3_layers_to_capture` (REFERENCE.md section 2); layers_to_capture holds
    the decoder layers whose *input* the model's loop appends."""

    def __init__(self, family: str, n: int = 61, always_shift: bool = False):
        super().__init__()
        self.model, self.family, self.n, self.always_shift = _Inner(), family, n, always_shift

    def set_eagle3_layers_to_capture(self, ids=None):
        if ids is None:
            got = [2, self.n // 2, self.n - 3]
        elif self.family == "llama" or self.always_shift or ids[0] == 1:
            got = [v + 1 for v in ids]
        else:
            got = list(ids)
        self.model.layers_to_capture = got


def test_enable_capture_translates_and_verifies_ids():
    m = _FakeModel("deepseek")
    sglang_capture.enable_capture(m, [2, 30, 58], "deepseek")
    assert m.model.layers_to_capture == [2, 30, 58]
    m = _FakeModel("llama", n=30)
    sglang_capture.enable_capture(m, [2, 15, 27], "llama")
    assert m.model.layers_to_capture == [2, 15, 27]
    # Releases that shifted every DeepSeek id read Kimi's spelling ([1, 29, 57]) as the same layers...
    m = _FakeModel("deepseek", always_shift=True)
    sglang_capture.enable_capture(m, [2, 30, 58], "deepseek")
    assert m.model.layers_to_capture == [2, 30, 58]
    # ...but ids with only 0.5.23's spelling would be captured one layer off there: refused, not silently used.
    with pytest.raises(RuntimeError, match=r"layers_to_capture .*\[4, 31, 59\].*expected \[3, 30, 58\]"):
        sglang_capture.enable_capture(_FakeModel("deepseek", always_shift=True), [3, 30, 58], "deepseek")


class _Mode:
    def __init__(self, extend: bool):
        self.extend = extend

    def is_extend(self):
        return self.extend

    def is_target_verify(self):
        return False


def test_capture_batch_writes_one_dump_per_prompt_and_skips_decode(tmp_path):
    H, lens = 4, [3, 5]
    ids = torch.arange(10, 18)
    aux = [torch.randn(8, H) for _ in range(3)]
    hidden = torch.randn(8, H)
    meta = SimpleNamespace(forward_mode=_Mode(extend=False), extend_seq_lens_cpu=lens)
    assert sglang_capture.capture_batch(ids, hidden, meta, aux, str(tmp_path), IDS) == 0
    meta.forward_mode = _Mode(extend=True)
    assert sglang_capture.capture_batch(ids, hidden, meta, aux, str(tmp_path), IDS) == 2
    c = read_dump(dump_path(tmp_path, sequence_key([13, 14, 15, 16, 17])), [13, 14, 15, 16, 17], layer_ids=IDS,
                  hidden_size=H, sample="b")
    torch.testing.assert_close(c.aux, torch.cat(aux, -1)[3:])
    torch.testing.assert_close(c.final, hidden[3:])


def test_an_image_batch_hands_over_its_merged_embeddings_at_the_clients_image_positions(tmp_path):
    """SGLang's ids at image positions are hash pads, clamped to vocab - 1 by the model (or left unclamped: the plugin
    clamps them too); the dump is named by the client's served ids, carries the merged input embeddings at those rows,
    and the client reads its own image positions' embeddings in order. A text prompt of the batch gets none; a prompt
    whose image rows the server did not hand over is an error naming it."""
    from eagle3.targets.sglang_dump import DumpError, served_ids

    H, V, pad = 4, 50, 7  # pad: the client's image token id
    client = [[1, pad, pad, pad, 2, 3], [4, 5]]
    hashes = [1, 1_000_003, 1_000_004, 1_000_005, 2, 3, 4, 5]  # as the scheduler fills them: never clamped here
    embeds, hidden, aux = torch.randn(8, H), torch.randn(8, H), torch.randn(8, 3 * H)
    meta = SimpleNamespace(forward_mode=_Mode(extend=True), extend_seq_lens_cpu=[6, 2], mm_input_embeds=embeds)
    assert sglang_capture.capture_batch(torch.tensor(hashes), hidden, meta, aux, str(tmp_path), IDS,
                                        vocab_size=V) == 2
    first = served_ids(client[0], pad, V)
    assert first == [1, V - 1, V - 1, V - 1, 2, 3]
    c = read_dump(dump_path(tmp_path, sequence_key(first)), first, layer_ids=IDS, hidden_size=H, sample="a",
                  image_positions=[1, 2, 3])
    assert torch.equal(c.image_embeds, embeds[1:4]) and torch.equal(c.final, hidden[:6])
    text = read_dump(dump_path(tmp_path, sequence_key(client[1])), client[1], layer_ids=IDS, hidden_size=H,
                     sample="b", image_positions=[])
    assert text.image_embeds is not None and text.image_embeds.shape == (0, H)
    meta.mm_input_embeds = None  # the pictures never reached the model
    (tmp_path / "x").mkdir()
    sglang_capture.capture_batch(torch.tensor(first + [4, 5]), hidden, meta, aux, str(tmp_path / "x"), IDS,
                                 vocab_size=V)
    with pytest.raises(DumpError, match="sample a: .* holds no image embeddings, but the prompt has 3 image tokens"):
        read_dump(dump_path(tmp_path / "x", sequence_key(first)), first, layer_ids=IDS, hidden_size=H, sample="a",
                  image_positions=[1, 2, 3])


def test_capture_batch_takes_packed_aux_states_and_the_batch_ids(tmp_path):
    """SGLang 0.5.23's DeepSeek/Kimi models pack the aux states into one [T, 3H] tensor, and the Kimi-K2.5
    wrapper calls its language model with input_ids=None (the ids are on the forward batch)."""
    H = 4
    packed = torch.randn(8, 3 * H)
    hidden = torch.randn(8, H)
    meta = SimpleNamespace(forward_mode=_Mode(extend=True), extend_seq_lens_cpu=[3, 5], input_ids=torch.arange(20, 28))
    assert sglang_capture.capture_batch(None, hidden, meta, packed, str(tmp_path), IDS) == 2
    c = read_dump(dump_path(tmp_path, sequence_key([20, 21, 22])), [20, 21, 22], layer_ids=IDS, hidden_size=H,
                  sample="kimi")
    assert torch.equal(c.aux, packed[:3]) and torch.equal(c.final, hidden[:3])
    # states that do not cover the batch's tokens (sharded, padded) or have another width are never written
    assert sglang_capture.capture_batch(None, hidden[:6], meta, packed[:6], str(tmp_path / "x"), IDS) == 0
    assert sglang_capture.capture_batch(None, hidden, meta, packed[:, :8], str(tmp_path / "x"), IDS) == 0
    assert sglang_capture.capture_batch(None, hidden, meta, None, str(tmp_path / "x"), IDS) == 0
    assert not (tmp_path / "x").exists()


def test_the_plugin_is_declared_and_inert_without_its_environment(monkeypatch):
    """SGLang finds eagle3's plugin through the `sglang.srt.plugins` entry points; without EAGLE3_SGLANG_DUMP_DIR
    it returns before importing anything of SGLang (a plain server in the same environment is untouched)."""
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
    assert eps.get(sglang_capture.ENTRY_POINT) == "eagle3.targets.sglang_capture:plugin"
    monkeypatch.delenv(ENV_DUMP_DIR, raising=False)
    monkeypatch.setitem(sys.modules, "sglang", None)  # any `import sglang...` would raise
    assert sglang_capture.plugin() is None


# ------------------------------------------------------------------------------------- command line, config
def test_server_command_and_env(llama, tmp_path):
    cfg = _cfg(llama, tmp_path, tp_size=8, launch_args=["--mem-fraction-static", "0.85"])
    cfg.target.trust_remote_code = True
    cmd = capture_flags(cfg.target, cfg.data.max_length, "/models/Kimi-K2.5")
    joined = " ".join(cmd)
    for part in ("--model-path /models/Kimi-K2.5", "--tp-size 8", "--disable-radix-cache",
                 "--chunked-prefill-size -1", "--trust-remote-code", "--dtype float32", "--skip-server-warmup",
                 "--enforce-disable-flashinfer-allreduce-fusion"):
        assert part in joined
    assert cmd[-2:] == ["--mem-fraction-static", "0.85"]
    env = server_env(tmp_path / "d", [2, 30, 58], "deepseek")
    assert json.loads(env[ENV_LAYER_IDS]) == [2, 30, 58] and env[ENV_FAMILY] == "deepseek"
    assert Path(env[ENV_DUMP_DIR]).is_absolute()
    for bad in (["--chunked-prefill-size", "8192"], ["--tp", "4"], ["--enable-dp-attention"], ["--attn-dp-size", "2"],
                ["--speculative-algorithm=EAGLE3"]):
        with pytest.raises(ValueError, match="target.sglang.launch_args"):
            check_launch_args(bad)


def test_command_cli_prints_env_and_command(llama, tmp_path, capsys, monkeypatch):
    from eagle3.cli import main

    monkeypatch.setattr("eagle3.cli.setup_logging", lambda: None)  # keep the logger off pytest's captured stream
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"target:\n  path: {llama}\n  backend: sglang\n  aux_layer_ids: {IDS}\n")
    assert main(["sglang", "command", "--config", str(cfg_file), "target.sglang.tp_size=2"]) == 0
    out = capsys.readouterr().out
    assert f"{ENV_LAYER_IDS}='[2, 4, 6]'" in out and f"{ENV_FAMILY}=llama" in out
    assert "-m sglang.launch_server" in out and "--tp-size 2" in out and "--port 30000" in out


def test_target_info_reads_kimi_text_config(tmp_path):
    from models import kimi_wrapped

    k = kimi_wrapped(tmp_path / "kimi")
    cfg = Config()
    cfg.target.path = str(k)
    info = read_target_info(cfg.target.path)
    assert (info.num_layers, info.hidden_size, info.vocab_size, info.family) == (4, 64, 256, "deepseek")


# ---------------------------------------------------------------------------------------- client end to end
def test_capture_through_fake_server_equals_hf_backend(llama, tmp_path):
    from eagle3.targets.hf import HFTarget

    dump = tmp_path / "dump"
    ensure_dump_dir(dump)
    stale = write_dump(dump, torch.tensor([1, 2, 3]), torch.zeros(3, 192), torch.zeros(3, 64), IDS)
    with FakeSGLang(llama, dump, IDS) as fake:
        t = sglang_target(_cfg(llama, tmp_path, fake.url))  # preflight runs (extract.preflight defaults on)
        assert not stale.exists()  # cleaned on start
        assert (t.num_layers, t.hidden_size, t.vocab_size, t.family, t.layer_ids) == (8, 64, 256, "llama", IDS)
        seqs = _seqs() + [_seqs()[0]]
        got = t.capture(seqs)
        assert len(fake.requests[-1]["input_ids"]) == 4  # the duplicate prompt is sent once
        assert fake.requests[-1]["sampling_params"]["max_new_tokens"] == 1
        t.close()
    hf_cfg = _cfg(llama, tmp_path)
    hf_cfg.target.backend = "hf"
    ref = HFTarget(hf_cfg.target, hf_cfg.extract).capture(seqs)
    for s, g, r in zip(seqs, got, ref, strict=True):
        assert g.aux.shape == (len(s), 3 * 64) and g.final.shape == (len(s), 64)
        torch.testing.assert_close(g.aux, r.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g.final, r.final, rtol=1e-5, atol=1e-5)
    assert [p.name for p in dump.iterdir()] == [MARKER]  # every dump read and deleted


@pytest.mark.parametrize(("mode", "message"), [
    ("tp_split", r"sample #0 of this batch \(9 tokens.*did not hand its states over: the TP ranks hold different"),
    ("cached", r"sample #0 of this batch \(9 tokens.*reused 3 cached prefix tokens.*--disable-radix-cache"),
    ("chunk", r"sample #0 of this batch \(9 tokens.*no hidden-state dump.*--chunked-prefill-size -1"),
    ("short", r"sample #0 of this batch \(9 tokens.*returned states for 8 tokens, the prompt has 9"),
])
def test_dropped_tokens_are_refused_naming_the_sample(llama, tmp_path, mode, message):
    with FakeSGLang(llama, tmp_path / "dump", IDS, mode=mode) as fake:
        t = sglang_target(_cfg(llama, tmp_path, fake.url), preflight=False)
        with pytest.raises(DumpError, match=message):
            t.capture(_seqs()[:1])
        t.close()
    assert not list((tmp_path / "dump").glob("*.safetensors"))  # nothing left behind even on failure


@pytest.mark.parametrize(("mode", "message"), [
    ("radix_on", "radix cache is on"),
    ("attn_dp", "DP attention is on.*--attn-dp-size"),
    ("fusion", "all-reduce fusion is on.*--enforce-disable-flashinfer-allreduce-fusion"),
])
def test_preflight_refuses_a_server_that_would_split_or_sum_states_wrongly(llama, tmp_path, mode, message):
    with FakeSGLang(llama, tmp_path / "dump", IDS, mode=mode) as fake:
        with pytest.raises(RuntimeError, match=message):
            sglang_target(_cfg(llama, tmp_path, fake.url))


def test_one_server_per_process_of_a_node(llama, tmp_path, monkeypatch, capsys):
    """A list in target.sglang.url gives each process of a node its own server and dump folder (two clients of one
    folder would delete each other's dumps); `eagle3 sglang serve --local-rank i` starts server i of the list."""
    from eagle3.cli import main
    from eagle3.targets.sglang import server_address

    cfg = _cfg(llama, tmp_path, ["http://127.0.0.1:30000", "http://127.0.0.1:30001"])
    s = cfg.target.sglang
    assert server_address(s, 1) == ("http://127.0.0.1:30001", (tmp_path / "dump" / "1").absolute())
    assert server_address(_cfg(llama, tmp_path, "http://h:1").target.sglang, 5) == ("http://h:1",
                                                                                     (tmp_path / "dump").absolute())
    with pytest.raises(ValueError, match="lists 2 server.*process 2 of its node"):
        server_address(s, 2)
    dumps = []
    for rank in (0, 1):
        with FakeSGLang(llama, tmp_path / "dump" / str(rank), IDS) as fake:
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            cfg.target.sglang.url = [fake.url if i == rank else "http://127.0.0.1:9" for i in (0, 1)]
            t = sglang_target(cfg)
            dumps.append(t.dump_dir)
            assert len(t.capture(_seqs()[:1])) == 1
            t.close()
    assert dumps == [(tmp_path / "dump" / "0").absolute(), (tmp_path / "dump" / "1").absolute()]
    monkeypatch.setattr("eagle3.cli.setup_logging", lambda: None)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"target:\n  path: {llama}\n  backend: sglang\n  aux_layer_ids: {IDS}\n  sglang:\n"
                        f"    dump_dir: {tmp_path / 'dump'}\n    url: [http://127.0.0.1:30000, http://127.0.0.1:30001]\n")
    assert main(["sglang", "command", "--config", str(cfg_file), "--local-rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "--port 30001" in out and f"{ENV_DUMP_DIR}={tmp_path / 'dump' / '1'}" in out


def test_preflight_catches_a_server_that_writes_nothing(llama, tmp_path):
    with FakeSGLang(llama, tmp_path / "dump", IDS, mode="nodump") as fake:
        with pytest.raises(DumpError, match="preflight probe.*does not run eagle3's capture plugin"):
            sglang_target(_cfg(llama, tmp_path, fake.url))


def test_a_url_nobody_listens_at_fails_in_seconds_naming_the_key(llama, tmp_path):
    """A refused connection at target.sglang.url is a wrong URL or a server not started: one clear error after a
    short grace, never the whole startup timeout (an hour by default) nor a TimeoutError traceback."""
    import socket
    import time

    from eagle3.logs import UserError, user_message

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(UserError, match=rf"nothing answers at target.sglang.url=http://127.0.0.1:{port} "
                                        r"\(connection refused for 10 s\): start the server first") as e:
        sglang_target(_cfg(llama, tmp_path, f"http://127.0.0.1:{port}"))
    assert 9 < time.monotonic() - t0 < 30 and user_message(e.value) is not None  # one line, no traceback


def test_startup_timeout_is_the_configured_one(llama, tmp_path):
    """A server that listens but never gets healthy: target.sglang.startup_timeout_s is the wait, and the error
    names the key."""
    import time

    from eagle3.logs import UserError

    with FakeSGLang(llama, tmp_path / "dump", IDS, mode="unhealthy") as fake:
        t0 = time.monotonic()
        with pytest.raises(UserError, match=r"not healthy after 3 s \(target.sglang.startup_timeout_s\)"):
            sglang_target(_cfg(llama, tmp_path, fake.url, startup_timeout_s=3.0))
        assert time.monotonic() - t0 < 15


_FAKE_SERVER_MAIN = """
import sys
sys.path.append({tests!r})  # appended: tests/ must not shadow installed packages
import json, os, time
from pathlib import Path
from test_sglang_backend import FakeSGLang
port = int(sys.argv[sys.argv.index("--port") + 1])
fake = FakeSGLang(Path({model!r}), Path(os.environ["EAGLE3_SGLANG_DUMP_DIR"]),
                  json.loads(os.environ["EAGLE3_SGLANG_LAYER_IDS"]))
fake.httpd.server_close()
import http.server
fake.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), fake.httpd.RequestHandlerClass)
fake.httpd.serve_forever()
"""


def test_extract_run_writes_the_same_cache_as_the_hf_backend_and_resumes(llama, tmp_path):
    """SGLangTarget (fake server) -> eagle3.extract.run -> the real Arrow cache, compared row by row with the HF
    backend; a re-run finds every shard done and never touches the backend."""
    from eagle3.cache import HiddenStateDataset
    from eagle3.extract import run
    from eagle3.targets.hf import HFTarget

    prepared = make_prepared(tmp_path / "prepared", n=6, n_eval=2)
    cfg = tiny_target_cfg(llama, prepared, tmp_path / "run", batch_tokens=64, max_batch_size=4, shard_samples=4)
    cfg.target.backend, cfg.target.aux_layer_ids = "sglang", IDS
    cfg.target.sglang.dump_dir = str(tmp_path / "dump")
    with FakeSGLang(llama, tmp_path / "dump", IDS) as fake:
        cfg.target.sglang.url = fake.url
        with sglang_target(cfg) as t:
            assert run(cfg, backend=t)["samples"] == 8
    hf_cfg = tiny_target_cfg(llama, prepared, tmp_path / "hf")
    hf_cfg.target.aux_layer_ids = IDS
    hf = HFTarget(hf_cfg.target, hf_cfg.extract)
    for split in ("train", "eval"):
        ds = HiddenStateDataset(cfg.cache_dir, split)
        for i in range(len(ds)):
            row = ds[i]
            ref = hf.capture([[int(x) for x in row["input_ids"]]])[0]
            torch.testing.assert_close(row["aux"].float(), ref.aux, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(row["final"].float(), ref.final, rtol=1e-5, atol=1e-5)
    assert run(cfg, backend=SimpleNamespace())["samples"] == 0  # resume: all shards there, backend unused


def _fake_sglang_package(root: Path, main: str) -> Path:
    """A folder with a stand-in `sglang.launch_server` module (what `python -m sglang.launch_server` runs)."""
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "launch_server.py").write_text(main)
    return root


@pytest.mark.slow
def test_launched_server_lifecycle(llama, tmp_path, monkeypatch):
    """The launch path (`python -m sglang.launch_server` in its own session, EAGLE3_SGLANG_* env, /health wait,
    log file, stop on close) with a fake server in place of SGLang's."""
    fake = _fake_sglang_package(tmp_path / "fake", _FAKE_SERVER_MAIN.format(tests=str(TESTS), model=str(llama)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), str(REPO)]))
    cfg = _cfg(llama, tmp_path)
    t = sglang_target(cfg, startup_timeout_s=120)  # launches, waits for /health, runs the preflight probe
    proc = t.server.proc
    assert t.log_file is not None and t.log_file.parent == tmp_path / "run" / "logs"
    assert t.server.cmd[1:3] == ["-m", "sglang.launch_server"]
    (c,) = t.capture([[5, 6, 7, 8]])
    assert c.aux.shape == (4, 192)
    t.close()
    assert proc.poll() is not None  # the server's process group is gone
    assert not (tmp_path / "dump").exists()  # our own server: the dump folder is removed on exit


def test_a_server_that_dies_at_startup_is_reported_with_its_log(llama, tmp_path, monkeypatch):
    """The error quotes the cause above the log's tail of noise, and a death other than a lost port is not
    launched again."""
    launches = tmp_path / "launches.txt"
    fake = _fake_sglang_package(tmp_path / "fake", f"import pathlib, sys\np = pathlib.Path({str(launches)!r})\n"
                                "p.write_text((p.read_text() if p.exists() else '') + 'x')\n"
                                "print('torch.OutOfMemoryError: CUDA out of memory')\n"
                                "print('\\n'.join(f'shutdown noise {i}' for i in range(60)))\nsys.exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), str(REPO)]))
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 before it was healthy\n--- its first error lines "
                                           r"---\ntorch.OutOfMemoryError: CUDA out of memory\n--- last 40 lines.*"
                                           r"shutdown noise 59$"):  # the cause, above a tail of noise
        sglang_target(_cfg(llama, tmp_path), startup_timeout_s=60)
    assert launches.read_text() == "x"  # not launched again
    assert not (tmp_path / "dump").exists()


_PORT_THIEF = """
import http.server, pathlib, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
ports = pathlib.Path({ports!r})
ports.write_text(ports.read_text() + f"{{port}}\\n" if ports.exists() else f"{{port}}\\n")
if len(ports.read_text().split()) == 1:  # the first launch: someone bound the port while the weights loaded
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {{port}}): address already "
          "in use", flush=True)
    sys.exit(3)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

http.server.ThreadingHTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_server_that_loses_its_port_is_launched_again_on_another(tmp_path, monkeypatch):
    """SGLang binds its HTTP port only after loading the weights; a launch whose port another process took in
    between (uvicorn: "address already in use", exit code 3) is started again on a fresh port, and the ports
    eagle3 draws lie below the kernel's ephemeral range, which bind(0) draws from."""
    from eagle3.targets.sglang_server import PORT_BAND, SGLangServer, _ephemeral_low, free_port

    ports = tmp_path / "ports.txt"
    fake = _fake_sglang_package(tmp_path / "fake", _PORT_THIEF.format(ports=str(ports)))
    monkeypatch.setenv("PYTHONPATH", str(fake))
    log_file = tmp_path / "logs" / "server.log"
    with SGLangServer([], {}, log_file, timeout_s=60) as server:
        first, second = (int(p) for p in ports.read_text().split())
        assert server.port == second != first and server.proc.poll() is None
        assert "address already in use" in log_file.read_text()  # the first launch's output is kept
    assert server.proc.poll() is not None
    drawn = {free_port() for _ in range(20)}
    assert all(PORT_BAND[0] <= p < min(PORT_BAND[1] + 1, _ephemeral_low()) for p in drawn), drawn
    assert len(drawn) > 1  # drawn at random: two eagle3 processes do not race for one port


_IMPOSTER = """
import http.server, json, subprocess, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])

def serve(who, seconds):
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"who": who}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
    srv.timeout = 0.1
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        srv.handle_request()
    srv.server_close()

if sys.argv[1:2] == ["imposter"]:
    serve("imposter", 3.0)
    sys.exit(0)
# another process (its own session) holds the port for a moment while the server loads, answering everything
other = subprocess.Popen([sys.executable, __file__, "imposter", "--port", str(port)], start_new_session=True)
other.wait()
serve("sglang", 3600)
"""


def test_a_health_answer_from_another_process_is_not_the_server(tmp_path, monkeypatch):
    """A process that holds the server's port for a moment while it loads (CI: /health answered 200 half a minute
    before SGLang's uvicorn started, and the next stage found nothing there) is not taken for the server: it is
    healthy only when its own processes answer."""
    from eagle3.targets.sglang_server import SGLangServer, http_json

    fake = _fake_sglang_package(tmp_path / "fake", _IMPOSTER)
    monkeypatch.setenv("PYTHONPATH", str(fake))
    with SGLangServer([], {}, tmp_path / "server.log", timeout_s=60) as server:
        assert http_json("GET", f"{server.url}/server_info") == {"who": "sglang"}


def test_a_python_without_the_plugin_is_refused_before_launch(llama, tmp_path, monkeypatch):
    """SGLang in a Python where eagle3 is not installed would serve without capturing: refused up front."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    monkeypatch.setenv("EAGLE3_SGLANG_PYTHON", str(bare / "bin" / "python"))
    with pytest.raises(RuntimeError, match="does not have eagle3's capture plugin"):
        sglang_target(_cfg(llama, tmp_path), startup_timeout_s=60)


def test_stopping_a_server_waits_for_every_process_of_its_group(tmp_path):
    """The launcher exits at once on SIGTERM, but its TP workers may take their time (or ignore it): the server is
    stopped only when no process of its group is left, SIGKILLed after the grace period, since a worker still
    tearing down holds the GPU memory the next stage's server needs."""
    import signal
    import time

    from eagle3.targets.sglang_server import stop_process_group

    worker = tmp_path / "worker.py"
    worker.write_text("import signal, sys, time\n"
                      "mode = sys.argv[1]\n"
                      "if mode == 'slow':\n"
                      "    signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), sys.exit(0)))\n"
                      "else:\n"
                      "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "open(sys.argv[2], 'w').write('up')\n"
                      "time.sleep(120)\n")
    for mode, grace, took in (("slow", 10.0, (1.0, 8.0)), ("deaf", 2.0, (1.9, 9.0))):
        ready = tmp_path / f"{mode}.ready"
        launcher = subprocess.Popen(
            [sys.executable, "-c", "import subprocess, sys, time\n"
             f"w = subprocess.Popen([sys.executable, {str(worker)!r}, {mode!r}, {str(ready)!r}])\n"
             f"open({str(tmp_path / (mode + '.pid'))!r}, 'w').write(str(w.pid))\n"
             "time.sleep(120)\n"], start_new_session=True)
        t0 = time.monotonic()
        while not ready.exists():
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)
        child = int((tmp_path / f"{mode}.pid").read_text())
        t0 = time.monotonic()
        stop_process_group(launcher, grace_s=grace)
        elapsed = time.monotonic() - t0
        assert launcher.poll() == -signal.SIGTERM  # the launcher went at once
        assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2], mode
        assert took[0] <= elapsed < took[1], (mode, elapsed)


def _tp_rank(rank: int, init: str, differ: bool, out: str) -> None:
    """One of two gloo ranks running the plugin's TP check, SGLang's `get_tp_group` stood in by the world group."""
    import sys as _sys
    import types

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    fake = types.ModuleType("sglang.srt.distributed")
    fake.get_tp_group = lambda: SimpleNamespace(world_size=2, device_group=dist.group.WORLD)
    for name in ("sglang", "sglang.srt"):
        _sys.modules.setdefault(name, types.ModuleType(name))
    _sys.modules["sglang.srt.distributed"] = fake
    aux = [torch.ones(5, 4) * (k + 1) for k in range(3)]
    final = torch.full((5, 4), 0.5)
    if differ and rank == 1:
        aux[1] = aux[1] * 0.5  # this rank's share of a sum the fused all-reduce has not summed yet
    Path(out).with_suffix(f".{rank}").write_text(repr(sglang_capture.tp_disagreement(aux, final)))
    dist.destroy_process_group()


@pytest.mark.parametrize("differ", [False, True])
def test_the_plugin_refuses_states_the_tp_ranks_do_not_share(tmp_path, differ):
    """Plain TP replicates the residual stream on every rank and rank 0 writes it; with all-reduce fusion each rank
    holds a partial sum. Two gloo ranks compare a checksum of the batch's states: equal states pass, a rank's
    partial sum is named (and the batch is answered with that reason instead of states)."""
    import torch.multiprocessing as mp

    from eagle3.targets.sglang_server import free_port

    out = tmp_path / "verdict"
    mp.spawn(_tp_rank, args=(f"tcp://127.0.0.1:{free_port()}", differ, str(out)), nprocs=2, join=True)
    verdicts = [out.with_suffix(f".{r}").read_text() for r in (0, 1)]
    assert verdicts[0] == verdicts[1]
    if differ:
        assert "the TP ranks hold different hidden states" in verdicts[0] and "allreduce-fusion" in verdicts[0]
    else:
        assert verdicts[0] == "None"


def test_a_batch_the_tp_ranks_disagree_on_is_answered_with_the_reason(tmp_path, monkeypatch):
    """No dump is written for such a batch: each prompt gets an `.error` file in its dump's place, which the client
    raises naming the sample (tests above), so no partial sum is ever trained on."""
    from eagle3.targets.sglang_dump import error_path

    monkeypatch.setattr(sglang_capture, "tp_disagreement", lambda aux, final: "partial sums, look")
    H = 4
    meta = SimpleNamespace(forward_mode=_Mode(extend=True), extend_seq_lens_cpu=[3, 5])
    ids = torch.arange(10, 18)
    assert sglang_capture.capture_batch(ids, torch.randn(8, H), meta, torch.randn(8, 3 * H), str(tmp_path), IDS) == 0
    assert not list(tmp_path.glob("*.safetensors"))
    for part in ([10, 11, 12], [13, 14, 15, 16, 17]):
        assert error_path(tmp_path, sequence_key(part)).read_text() == "partial sums, look"
    assert clean_dump_dir(tmp_path) == 2  # cleaned like dumps
