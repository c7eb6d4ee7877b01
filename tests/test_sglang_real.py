"""The flagship path against the real SGLang 0.5.23, on CPU: extraction, online training and evaluation for tiny
Llama, DeepseekV3 (MLA + MoE) and Kimi-K2.5-shaped targets, at TP=1 and TP=2.

    bash scripts/setup_sglang_cpu.sh && pytest -m sglang            # .venv-sglang, or $EAGLE3_SGLANG_PYTHON
    EAGLE3_SGLANG_DEVICE=cuda pytest -m sglang ...                   # the same on GPUs (scripts/gpu_check_sglang.sh)

SGLang runs in its own virtualenv with its own torch; eagle3's side runs here. The servers are SGLang's own
(`python -m sglang.launch_server`, model code, scheduler, TP and EAGLE-3 worker unmodified) with eagle3's capture
plugin; tests/sglang_cpu/ only stands in for the GPU kernels and the CPU backend glue (its README). Nothing of
eagle3 is faked: the capture plugin, the dump protocol, the cache writer, verify-extraction, the trainer's online
mode and `eagle3 eval --engine sglang` all run as a user runs them. One capture server per (family, TP) is
reused by that case's tests, and hands states over through the dump folder or a Mooncake Store (`mooncake`
transport) by the request; the evaluation tests start their own EAGLE-3 servers through eagle3.
"""

from __future__ import annotations

import filecmp
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import kill_after_batches, kimi_wrapped, tiny_llama
from sglang_cpu.tiny_models import kimi_sglang_wrapper, sglang_tiny_deepseek_v3, target_shape
from tokenizer_builders import kimi_test_tokenizer, llama_test_tokenizer

from eagle3.config import Config

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parent.parent
STANDINS = REPO / "tests" / "sglang_cpu"
DEVICE = os.environ.get("EAGLE3_SGLANG_DEVICE", "cpu")
"""`cpu` (the stand-ins of tests/sglang_cpu, float32) or `cuda` (SGLang's real kernels, bf16; no stand-ins)."""
CPU_FLAGS = (["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "8192"]
             if DEVICE == "cpu" else ["--mem-fraction-static", "0.3"])
DTYPE = "float32" if DEVICE == "cpu" else "bfloat16"


def _gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return out.count("GPU ")


TPS = [1, 2] if DEVICE == "cpu" else [tp for tp in (1, 2, 8) if tp <= _gpus()]
IDS = {"llama": [2, 4, 6], "deepseek": [2, 3, 4], "kimi": [2, 3, 4]}
"""eagle3 ids (input of layer k). SGLang spells them [1, 3, 5] for the 8-layer Llama, as-is for the others."""
CASES = [(family, tp) for family in ("llama", "deepseek", "kimi") for tp in TPS]
KIMI_VISION = target_shape("kimi", DEVICE)["vision"]
"""Kimi-K2.5's MoonViT tower in miniature: SGLang builds it (random, never run: extraction is text only)."""


# ------------------------------------------------------------------------------------------- environment
@functools.cache
def _sglang_python() -> str | None:
    for py in (os.environ.get("EAGLE3_SGLANG_PYTHON"), str(REPO / ".venv-sglang" / "bin" / "python"), sys.executable):
        if py and Path(py).exists():
            ok = subprocess.run([py, "-c", "import sglang"], capture_output=True, timeout=600).returncode == 0
            if ok:
                return py
    return None


@pytest.fixture(scope="module", autouse=True)
def sglang_env():
    """The SGLang interpreter and the CPU environment every server process inherits."""
    py = _sglang_python()
    if py is None:
        pytest.skip("no SGLang: run `bash scripts/setup_sglang_cpu.sh` (or set EAGLE3_SGLANG_PYTHON)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_SGLANG_PYTHON", py)
        mp.setenv("HF_HUB_OFFLINE", "1")
        if DEVICE != "cpu":
            yield py
            return
        mp.setenv("SGLANG_USE_CPU_ENGINE", "1")
        mp.setenv("PYTHONPATH", os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        # TP on one NUMA node: one core per rank, and gloo instead of the PyNccl that the CUDA torch offers.
        mp.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
        mp.setenv("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so")
        yield py


ONE_RANK_CORE = os.environ.get("EAGLE3_TEST_SGLANG_CORE", "0")
"""The core a one-rank server binds to: .ci/run runs a second SGLang suite on core 1 beside the one on core 0."""


def _omp_bind(tp: int) -> None:
    if DEVICE == "cpu":
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1" if tp == 2 else ONE_RANK_CORE


# ---------------------------------------------------------------------------------------------- targets
def build_target(family: str, path: Path, device: str = DEVICE) -> Path:
    """A tiny random target of `family` with its tokenizer, as a folder both HF and SGLang load, in the shape SGLang
    on `device` takes (tests/sglang_cpu/tiny_models.py `target_shape`: on CUDA, heads that split 8 ways and Kimi's
    MLA dims; tests/test_sglang_gpu_fixtures.py checks them against SGLang's rules at TP 1/2/8)."""
    shape = target_shape(family, device)
    if family == "llama":
        tiny_llama(path, **shape["model"])
        llama_test_tokenizer(path, vocab_size=shape["model"]["vocab"])
        return path
    if family == "deepseek":
        sglang_tiny_deepseek_v3(path, **shape["model"])
        llama_test_tokenizer(path, vocab_size=shape["model"]["vocab"])
        return path
    kimi_wrapped(path, **shape["model"])
    kimi_test_tokenizer(path)
    conf = path / "config.json"
    conf.write_text(json.dumps(kimi_sglang_wrapper(json.loads(conf.read_text()), shape["vision"]), indent=2))
    return path


def chats(path: Path, n: int = 14) -> Path:
    path.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} plus {i}? Explain it twice."},
        {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. Again: {i} + {i} = {2 * i}."},
        {"role": "user", "content": "Thanks, and times three?"},
        {"role": "assistant", "content": f"{i} times three is {3 * i}."}]}) for i in range(n)) + "\n")
    return path


def base_cfg(family: str, tp: int, root: Path, target: Path, data: Path) -> Config:
    cfg = Config(output_dir=str(root / "run"))
    t = cfg.target
    t.path, t.dtype, t.backend, t.aux_layer_ids = str(target), DTYPE, "sglang", IDS[family]
    t.device = "cpu" if DEVICE == "cpu" else "cuda"
    t.sglang.tp_size, t.sglang.launch_args = tp, list(CPU_FLAGS)
    t.sglang.dump_dir = str(root / "dump")
    t.sglang.startup_timeout_s = 900
    cfg.data.sources[0].path = str(data)
    cfg.data.chat_template = "kimi-k2.5" if family == "kimi" else "auto"
    cfg.data.eval_size = 3
    cfg.draft.vocab_size = 96
    cfg.extract.batch_tokens, cfg.extract.max_batch_size, cfg.extract.shard_samples = 256, 4, 4
    tr = cfg.train
    tr.max_steps, tr.batch_tokens, tr.ttt_steps, tr.lr, tr.log_every, tr.eval_every = 3, 256, 2, 3e-3, 1, 3
    return cfg


def eagle3_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def write_cfg(cfg: Config, path: Path) -> Path:
    path.write_text(cfg.to_yaml())
    return path


# --------------------------------------------------------------------------------------- capture servers
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A Mooncake master (`eagle3 mooncake master`) every capture server of the module joins: each serves its own
    machine's clients through the dump folder and any others through the store, by the request."""
    from store_master import running_master

    with running_master(tmp_path_factory.mktemp("store")) as master:
        yield master


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-tp{tp}" for f, tp in CASES])
def case(request, tmp_path_factory, store):
    """One (family, TP): target, prepared data, and a running capture server reused by the case's tests."""
    from eagle3.prepare import run as prepare
    from eagle3.targets.mooncake import StoreAddress
    from eagle3.targets.sglang import capture_flags, server_env
    from eagle3.targets.sglang_server import SGLangServer

    family, tp = request.param
    root = tmp_path_factory.mktemp(f"{family}-tp{tp}")
    target = build_target(family, root / "target")
    cfg = base_cfg(family, tp, root, target, chats(root / "chats.jsonl"))
    prepare(cfg)
    _omp_bind(tp)
    env = server_env(cfg.target.sglang.dump_dir, IDS[family], "llama" if family == "llama" else "deepseek",
                     (StoreAddress.of(store.settings), 128 << 20))
    with SGLangServer(capture_flags(cfg.target, cfg.data.max_length, str(target)), env, root / "capture-server.log",
                      timeout_s=cfg.target.sglang.startup_timeout_s, what=f"{family} TP={tp}") as server:
        cfg.target.sglang.url = server.url
        yield {"family": family, "tp": tp, "root": root, "cfg": cfg, "server": server, "store": store}


def test_extract_then_verify_against_hf(case):
    """`eagle3 extract` through the real server, then `eagle3 verify-extraction` of the cache against HF's own
    output_hidden_states: every layer and the final state match, token counts equal. The same states labelled one
    layer lower fail, and the report names the bug."""
    cfg, root = case["cfg"], case["root"]
    cfg_file = write_cfg(cfg, root / "extract.yaml")
    r = eagle3_cli("extract", "--config", str(cfg_file))
    assert r.returncode == 0, r.stderr[-5000:]
    assert "preflight ok" in r.stderr and "extracted" in r.stderr
    r = eagle3_cli("cache", "info", str(cfg.cache_dir))
    assert r.returncode == 0 and str(IDS[case["family"]]) in r.stdout, r.stdout + r.stderr

    r = eagle3_cli("verify-extraction", "--config", str(cfg_file), "--source", str(cfg.cache_dir),
                   "--num-samples", "4")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert ("PASS: 4 sample(s), every layer's cosine >= 0.99 on average and its worst token's above the dtype's "
            "bar, token counts equal") in r.stdout

    shifted = root / "cache-labelled-one-lower"
    shutil.copytree(cfg.cache_dir, shifted)
    # Labelled one lower everywhere the cache records its ids (meta.json and every manifest), as a cache from an
    # engine that captured other layers than it said would be: only the states themselves can tell.
    for record in [shifted / "meta.json", *shifted.glob("*/rank-*.json")]:
        meta = json.loads(record.read_text())
        meta["fingerprint"]["layer_ids"] = [k - 1 for k in meta["fingerprint"]["layer_ids"]]
        record.write_text(json.dumps(meta))
    r = eagle3_cli("verify-extraction", "--config", str(cfg_file), "--source", str(shifted), "--num-samples", "2")
    assert r.returncode == 1, r.stdout[-3000:]
    assert "FAIL: aux layers off by one (id +1)" in r.stdout, r.stdout[-3000:]


def test_killed_extraction_resumes_to_the_same_bytes(case):
    """SIGKILL mid-extraction (a real kill, from inside the process), the same command again: the cache is
    byte-identical to the uninterrupted one of the test above, and no dump file is left behind."""
    cfg, root = case["cfg"], case["root"]
    if not (cfg.cache_dir / "meta.json").is_file():
        pytest.skip("needs the uninterrupted cache of test_extract_then_verify_against_hf")
    killed = cfg.model_copy(deep=True)
    killed.extract.cache_dir = str(root / "cache-killed")
    killed_file = write_cfg(killed, root / "killed.yaml")
    r = eagle3_cli("extract", "--config", str(killed_file), env=kill_after_batches(2))
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    r = eagle3_cli("extract", "--config", str(killed_file))
    assert r.returncode == 0, r.stderr[-4000:]
    for split in ("train", "eval"):
        a, b = cfg.cache_dir / split, Path(killed.extract.cache_dir) / split
        names = sorted(p.name for p in a.iterdir())
        assert names == sorted(p.name for p in b.iterdir())
        _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
        assert not mismatch and not errors, (split, mismatch, errors)
    dump = Path(cfg.target.sglang.dump_dir)
    assert not list(dump.glob("*.safetensors")) and not list(dump.glob(".*.tmp-*"))


def test_fp8_extraction_through_sglang(case):
    """extract.storage=fp8 through the real server: the same bytes as converting the exact cache of the first test
    (the quantiser sees SGLang's states, nothing else changes), and verify-extraction still passes against HF."""
    from eagle3.cache import convert

    cfg, root = case["cfg"], case["root"]
    if not (cfg.cache_dir / "meta.json").is_file():
        pytest.skip("needs the uninterrupted cache of test_extract_then_verify_against_hf")
    fp8 = cfg.model_copy(deep=True)
    fp8.extract.cache_dir, fp8.extract.storage = str(root / "cache-fp8"), "fp8"
    fp8_file = write_cfg(fp8, root / "fp8.yaml")
    r = eagle3_cli("extract", "--config", str(fp8_file))
    assert r.returncode == 0, r.stderr[-4000:]
    convert(cfg.cache_dir, root / "cache-converted", "fp8")
    a, b = root / "cache-converted", Path(fp8.extract.cache_dir)
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    _, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
    r = eagle3_cli("verify-extraction", "--config", str(fp8_file), "--source", str(b), "--num-samples", "4")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert "fp8 storage" in r.stdout and "PASS: 4 sample(s)" in r.stdout


def test_online_training_through_sglang(case):
    """extract.mode: online: the trainer asks the server for every batch's states while the head trains, and
    trains what the same steps on the server's offline cache train (a finite loss alone would pass a trainer fed
    states of the wrong layer or sample)."""
    from eagle3 import trainer
    from eagle3.extract import run as extract

    offline = case["cfg"].model_copy(deep=True)
    offline.output_dir = str(case["root"] / "offline")
    offline.data.output_dir = str(case["cfg"].prepared_dir)
    offline.extract.cache_dir = str(case["cfg"].cache_dir)
    extract(offline)  # the cache of test_extract_then_verify_against_hf, or made here when run alone
    trainer.run(offline)
    cfg = offline.model_copy(deep=True)
    cfg.output_dir = str(case["root"] / "online")
    cfg.extract.mode = "online"
    metrics = trainer.run(cfg)
    assert metrics["step"] == 3 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert (cfg.checkpoint_dir / "step_3" / "draft" / "model.safetensors").is_file()
    assert not list(Path(cfg.target.sglang.dump_dir).glob("*.safetensors"))
    # What the trainer is handed, batch by batch, online and from the cache: the same samples in the same order,
    # and the same states up to the server batching them otherwise (a losses comparison cannot tell: an untrained
    # head's loss is ~log(vocab) whatever it is fed).
    from contextlib import closing

    from eagle3.batching import plan_epoch
    from eagle3.data.prepared import load_prepared
    from eagle3.trainer import open_datasets

    def train_split(c):
        return open_datasets(c.target, c.extract, c.paths, c.data.max_length, c.train.verify_cache)[0]

    cached, live = train_split(offline), train_split(cfg)
    where = {sid: j for j, sid in enumerate(load_prepared(cfg.prepared_dir).train["id"])}  # the cache keeps its
    to_live = [where[cached[i]["sample_id"]] for i in range(len(cached))]                  # own order of samples
    assert [live.lengths[j] for j in to_live] == list(cached.lengths)
    batches = plan_epoch(cached.lengths, 256, seed=1, epoch=0).batches
    live_batches = [[to_live[i] for i in b] for b in batches]
    with closing(cached.iter_collated(batches)) as a, closing(live.iter_collated(live_batches)) as b:
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
            for key in ("aux", "final"):
                torch.testing.assert_close(y[key].float(), x[key].float(), rtol=1e-3, atol=1e-3, msg=key)
            assert (x["target_argmax"] == y["target_argmax"]).float().mean() > 0.98


def test_the_server_reports_what_the_preflight_reads(case):
    """The preflight's guards read real fields of SGLang 0.5.23's /server_info, and eagle3's command sets them:
    prefill CUDA graphs off, all-reduce fusion off (at TP 2 the plugin also compares the ranks' states on every
    prefill: the extraction tests above pass through it), the radix cache off."""
    from eagle3.targets.sglang import prefill_graphs
    from eagle3.targets.sglang_server import server_info

    info = server_info(case["server"].url)
    assert info["cuda_graph_config"]["prefill"]["backend"] == "disabled" and prefill_graphs(info) is None
    assert "flashinfer_allreduce_fusion_backend" in info and info["flashinfer_allreduce_fusion_backend"] is None
    assert info["enforce_disable_flashinfer_allreduce_fusion"] is True and info["disable_radix_cache"] is True
    assert prefill_graphs({**info, "cuda_graph_config": {"prefill": {"backend": "breakable"}}}) is not None


def test_the_store_hands_over_what_the_dump_folder_does(case):
    """target.sglang.transport mooncake through the same server (dump folders apart: only the store can deliver):
    every prompt's states are the bytes the dump folder gives for the same requests, the Kimi wrapper's and TP=2's
    included; in fp8 the bytes the cache codec makes of them; nothing is left in the store."""
    from eagle3.cache.codec import quantize
    from eagle3.data.prepared import load_prepared
    from eagle3.targets.mooncake import StateStore, StoreAddress
    from eagle3.targets.sglang import SGLangTarget

    cfg = case["cfg"]
    ids = [list(x) for x in load_prepared(cfg.prepared_dir).train["input_ids"]]
    batches = [ids[i:i + 4] for i in range(0, len(ids), 4)]
    with SGLangTarget(cfg.target, cfg.extract, cfg.data.max_length, cfg.paths.logs_dir, preflight=False) as shm:
        ref = [c for b in batches for c in shm.capture(b)]
    mc = cfg.model_copy(deep=True)
    s = mc.target.sglang
    s.transport, s.mooncake, s.dump_dir = "mooncake", case["store"].settings, str(case["root"] / "elsewhere")
    for storage in ("exact", "fp8"):
        with SGLangTarget(mc.target, mc.extract, mc.data.max_length, mc.paths.logs_dir, request=(256, storage)) as t:
            got = [c for b in batches for c in t.capture(b)]  # the preflight: a probe through the store, twice
        for r, g in zip(ref, got, strict=True):
            if storage == "exact":
                assert torch.equal(g.aux, r.aux) and torch.equal(g.final, r.final)
                continue
            for name, parts in (("aux", 3), ("final", 1)):
                q, scale = quantize(getattr(r, name), parts)
                assert torch.equal(getattr(g, name).view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(getattr(g, f"{name}_scale"), scale)
    assert not list((case["root"] / "elsewhere").glob("*.safetensors"))
    checker = StateStore(StoreAddress.of(case["store"].settings), what="the test")
    assert checker.remove_prefix("eagle3/") == 0
    checker.close()


def test_a_launched_capture_server_dies_with_a_killed_client(tmp_path, sglang_env):
    """With no target.sglang.url the backend starts its own server; a SIGKILLed extraction takes it along
    (PR_SET_PDEATHSIG), so its re-run finds no orphan holding the memory; the re-run launches a new one."""
    root = tmp_path
    target = build_target("llama", root / "target")
    cfg = base_cfg("llama", 1, root, target, chats(root / "chats.jsonl"))
    from eagle3.prepare import run as prepare

    prepare(cfg)
    _omp_bind(1)
    cfg_file = write_cfg(cfg, root / "c.yaml")
    r = eagle3_cli("extract", "--config", str(cfg_file), env=kill_after_batches(1))
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert "launching the SGLang capture server" in r.stderr
    log = next((root / "run" / "logs").glob("sglang-capture-*.log"))
    port = re.search(r"sglang.launch_server .*--port (\d+)", r.stderr).group(1)
    _wait_until_gone(port)
    r = eagle3_cli("extract", "--config", str(cfg_file))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "stopping the SGLang server" in r.stderr and log.is_file()
    assert not Path(cfg.target.sglang.dump_dir).exists()  # its own server's folder: removed on exit


def _processes_serving(port: str) -> list[int]:
    """Pids of processes whose command line holds `--port <port>` (the launched sglang.launch_server)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--port" in cmd and cmd[cmd.index(b"--port") + 1:][:1] == [port.encode()]:
                pids.append(int(p.name))
    return pids


def _wait_until_gone(port: str, timeout_s: float = 120) -> None:
    import time

    t0 = time.monotonic()
    while pids := _processes_serving(port):
        assert time.monotonic() - t0 < timeout_s, f"the killed client's SGLang server {pids} is still running"
        time.sleep(1)


def test_two_servers_and_two_extraction_ranks_write_one_cache(tmp_path, sglang_env):
    """docs/scale-out.md's several servers per node: target.sglang.url lists one server per process of the node,
    two extraction ranks (RANK/LOCAL_RANK 0 and 1 of WORLD_SIZE 2) each talk to their own server and dump folder
    and write one cache. Rank 1 is SIGKILLed mid-way and re-run alone. The cache holds every sample once, with the
    states a one-process extraction writes (to SGLang's batching noise), and no dump is left behind."""
    from eagle3.cache import HiddenStateDataset
    from eagle3.prepare import run as prepare
    from eagle3.targets.sglang import capture_flags, server_address, server_env
    from eagle3.targets.sglang_server import SGLangServer

    target = build_target("llama", tmp_path / "target")
    cfg = base_cfg("llama", 1, tmp_path, target, chats(tmp_path / "chats.jsonl"))
    prepare(cfg)
    servers = []
    try:
        for i in (0, 1):
            if DEVICE == "cpu":
                os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = str(i)  # one core each
            cfg.target.sglang.url = ["http://unused:1", "http://unused:2"]
            _, dump = server_address(cfg.target.sglang, i)
            servers.append(SGLangServer(capture_flags(cfg.target, cfg.data.max_length, str(target)), server_env(dump, IDS["llama"], "llama"),
                                        tmp_path / f"server{i}.log", timeout_s=900, what=f"server {i}").__enter__())
        one = cfg.model_copy(deep=True)
        one.target.sglang.url, one.extract.cache_dir = servers[0].url, str(tmp_path / "cache-one")
        one.target.sglang.dump_dir = str(tmp_path / "dump" / "0")
        r = eagle3_cli("extract", "--config", str(write_cfg(one, tmp_path / "one.yaml")))
        assert r.returncode == 0, r.stderr[-4000:]

        two = cfg.model_copy(deep=True)
        two.target.sglang.url, two.extract.cache_dir = [s.url for s in servers], str(tmp_path / "cache-two")
        two_file = write_cfg(two, tmp_path / "two.yaml")
        cmd = [sys.executable, "-m", "eagle3.cli", "extract", "--config", str(two_file)]

        def env(rank: int, **extra: str) -> dict[str, str]:
            return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", **extra}

        procs = [subprocess.Popen(cmd, cwd=REPO, env=env(0), stderr=subprocess.PIPE, text=True),
                 subprocess.Popen(cmd, cwd=REPO, env=env(1, **kill_after_batches(1)), stderr=subprocess.PIPE,
                                  text=True)]
        errs = [p.communicate(timeout=900)[1] for p in procs]
        assert procs[0].returncode == 0, errs[0][-3000:]
        assert procs[1].returncode == -signal.SIGKILL, errs[1][-3000:]
        assert f"using the SGLang server(s) at {servers[1].url} (dump folder" in errs[1]
        r = eagle3_cli("extract", "--config", str(two_file), env={"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
        assert r.returncode == 0, r.stderr[-4000:]
    finally:
        for s in servers:
            s.__exit__(None, None, None)
    r = eagle3_cli("cache", "info", str(two.cache_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    for split in ("train", "eval"):
        a, b = HiddenStateDataset(one.cache_dir, split), HiddenStateDataset(two.cache_dir, split)
        rows_a = {a[i]["sample_id"]: a[i] for i in range(len(a))}
        rows_b = {b[i]["sample_id"]: b[i] for i in range(len(b))}
        assert rows_a.keys() == rows_b.keys() and len(rows_b) == len(b), split  # every sample once
        for sid, x in rows_a.items():
            y = rows_b[sid]
            assert torch.equal(x["input_ids"], y["input_ids"])
            for key in ("aux", "final"):
                torch.testing.assert_close(y[key].float(), x[key].float(), rtol=1e-3, atol=1e-3, msg=f"{sid} {key}")
    for i in (0, 1):
        assert not list((tmp_path / "dump" / str(i)).glob("*.safetensors")), i
