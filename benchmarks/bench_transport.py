"""How fast states cross from a capture server to a trainer: the dump folder (`shm`) against the Mooncake Store
(`mooncake`, TCP on loopback), at Kimi-K2.5's width, and what online training through the store costs against the
offline cache on the same samples, side by side in one run.

    python benchmarks/bench_transport.py --tokens 4096 --requests 12 --threads 1        # both parts
    python benchmarks/bench_transport.py --part transport --tokens 8192 --storages exact,fp8
    python benchmarks/bench_transport.py --part training --steps 30

Part `transport`: a producer process plays the capture server's side with the plugin's own code (`capture_batch`:
a dump file for `shm`; the states encoded, packed and put into its segment of the store for `mooncake`), a
consumer process the client's (`read_dump`, or `StoreHandover.read`: get_into a registered buffer, checked, copied
out, removed); one request of `--tokens` tokens of states [T, 4 x 7168] at a time, the consumer timing each from
asking to holding its tensors. `fp8` through `shm` is quantised by the consumer (what online training does with
exact dumps); through `mooncake` by the producer. GB/s counts the bytes that cross (the storage's).

Part `training`: a tiny target's offline cache (HF extraction), then the same steps trained from that cache and
online through the store from a replay server that answers each request with the cache's states (so the target's
forward is excluded by construction: what is left is the transport, the request, the prefetch thread and the
online argmax). The ratio of the two step rates is the transport's cost; both train with `--threads` torch threads.

Needs Mooncake (`bash scripts/setup_mooncake.sh .venv/bin/python`); starts its own master with `eagle3 mooncake master`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

KIMI_H = 7168
IDS = [2, 30, 58]


class _Extend:
    def is_extend(self) -> bool:
        return True

    def is_target_verify(self) -> bool:
        return False


def _states(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 163840, (tokens,), generator=g)
    aux = torch.randn(tokens, 3 * KIMI_H, generator=g).to(torch.bfloat16)
    final = torch.randn(tokens, KIMI_H, generator=g).to(torch.bfloat16)
    return ids, aux, final


# ---------------------------------------------------------------------------------------- part 1: transport
def producer(conn, transport: str, addr, dump_dir: str, tokens: int, threads: int) -> None:
    """The server's side: on each (key, storage) asked, the plugin's capture_batch for one prompt."""
    from eagle3.targets import sglang_capture
    from eagle3.targets.mooncake import StateStore

    torch.set_num_threads(threads)
    ids, aux, final = _states(tokens, 0)
    store = StateStore(addr, segment=4 * tokens * 4 * KIMI_H * 2 + (64 << 20), what="producer") \
        if transport == "mooncake" else None
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        key = msg
        meta = SimpleNamespace(forward_mode=_Extend(), extend_seq_lens_cpu=[tokens], rids=[key])
        t0 = time.perf_counter()
        sglang_capture.capture_batch(ids, final, meta, aux, dump_dir, IDS, store)
        conn.send(time.perf_counter() - t0)
    if store is not None:
        store.close()


def run_transport(transport: str, storage: str, addr, tokens: int, requests: int, threads: int, tmp: Path) -> dict:
    from eagle3.cache.codec import STATES, codec_for, quantize
    from eagle3.targets.sglang_dump import dump_path, ensure_dump_dir, read_dump, sequence_key
    from eagle3.targets.sglang_store import StoreHandover, wire_bytes_per_token

    torch.set_num_threads(threads)
    dump_dir = ensure_dump_dir(tmp / "dump")
    ids, _, _ = _states(tokens, 0)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(there, transport, addr, str(dump_dir), tokens, threads))
    proc.start()
    assert here.recv() == "ready"
    reader = StoreHandover(addr, tmp / "logs", rank=0, storage=storage) if transport == "mooncake" else None
    codec = codec_for(storage)
    took, put = [], []
    for i in range(requests + 1):  # the first is a warm-up (page faults of fresh buffers)
        t0 = time.perf_counter()
        if reader is not None:
            (key,) = reader.keys(1)
            here.send(key)
            put.append(here.recv())
            c = reader.read(key, ids.tolist(), layer_ids=IDS, hidden_size=KIMI_H, sample=key, dtype=torch.bfloat16,
                            server="producer")
            reader.discard([key])
        else:
            here.send(f"shm-{i}")
            put.append(here.recv())
            path = dump_path(dump_dir, sequence_key(ids))
            c = read_dump(path, ids.tolist(), layer_ids=IDS, hidden_size=KIMI_H, sample="x", dtype=torch.bfloat16)
            path.unlink()
            for name in codec.fp8:  # online training quantises exact dumps itself
                quantize(getattr(c, name), STATES[name])
        if i:
            took.append(time.perf_counter() - t0)
    here.send(None)
    proc.join()
    if reader is not None:
        reader.close()
    nbytes = tokens * wire_bytes_per_token(KIMI_H, "bfloat16", storage)
    mean = statistics.mean(took)
    return {"transport": transport, "storage": storage, "tokens": tokens, "MB": nbytes / 1e6,
            "s_per_request": mean, "server_s": statistics.mean(put[1:]), "tokens_per_s": tokens / mean,
            "GB_per_s": nbytes / mean / 1e9}


# ----------------------------------------------------------------------------------------- part 2: training
def replay_server(cache_dir: str, addr, port_conn) -> None:
    """/generate answered with the offline cache's states for each prompt, through the plugin's capture_batch."""
    import http.server

    from eagle3.cache import HiddenStateDataset
    from eagle3.targets import sglang_capture
    from eagle3.targets.mooncake import StateStore
    from eagle3.targets.sglang_dump import sequence_key

    torch.set_num_threads(1)
    states = {}
    for split in ("train", "eval"):
        ds = HiddenStateDataset(cache_dir, split)
        for i in range(len(ds)):
            it = ds[i]
            states[sequence_key(it["input_ids"])] = (it["input_ids"], it["aux"].clone(), it["final"].clone())
    layer_ids = ds.layer_ids
    store = StateStore(addr, segment=512 << 20, what="replay server")

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _send(self, obj: object) -> None:
            raw = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            self._send({"disable_radix_cache": True, "chunked_prefill_size": -1, "tp_size": 1})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            found = [states[sequence_key(s)] if sequence_key(s) in states else None for s in body["input_ids"]]
            known = [(f, r) for f, r in zip(found, body["rid"], strict=True) if f is not None]
            if known:
                meta = SimpleNamespace(forward_mode=_Extend(), extend_seq_lens_cpu=[len(f[0]) for f, _ in known],
                                       rids=[r for _, r in known])
                sglang_capture.capture_batch(torch.cat([f[0] for f, _ in known]), torch.cat([f[2] for f, _ in known]),
                                             meta, torch.cat([f[1] for f, _ in known]), "/nonexistent", layer_ids,
                                             store)
            self._send([{"meta_info": {"prompt_tokens": len(s), "cached_tokens": 0}} for s in body["input_ids"]])

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_conn.send(httpd.server_address[1])
    httpd.serve_forever()


def run_training(master, steps: int, threads: int, tmp: Path, hidden: int) -> list[dict]:
    from models import make_prepared, tiny_llama, tiny_target_cfg

    from eagle3 import trainer
    from eagle3.extract import run as extract
    from eagle3.targets.mooncake import StoreAddress

    target = tiny_llama(tmp / "target", vocab=512, hidden=hidden, intermediate=2 * hidden)
    prepared = make_prepared(tmp / "prepared", n=96, vocab=512, min_len=64, max_len=256, draft_vocab=128)
    cfg = tiny_target_cfg(target, prepared, tmp / "offline", preflight=False)
    cfg.target.aux_layer_ids, cfg.cpu_threads, cfg.draft.vocab_size = [2, 4, 6], threads, 128
    tr = cfg.train
    tr.max_steps, tr.batch_tokens, tr.ttt_steps, tr.eval_every, tr.save_every, tr.log_every = steps, 1024, 3, 10_000, \
        10_000, 1
    extract(cfg)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=replay_server, args=(str(cfg.cache_dir), StoreAddress.of(master.settings), there),
                         daemon=True)
    server.start()
    port = here.recv()
    online = cfg.model_copy(deep=True)
    online.output_dir, online.extract.mode = str(tmp / "online"), "online"
    online.data.output_dir = str(prepared)
    s = online.target.sglang
    online.target.backend, s.transport, s.url, s.mooncake = "sglang", "mooncake", f"http://127.0.0.1:{port}", \
        master.settings
    rows = []
    for name, c in (("offline cache", cfg), ("online, Mooncake", online)):
        trainer.run(c)
        log = [json.loads(x) for x in (Path(c.output_dir) / "train_log.jsonl").read_text().splitlines()]
        timed = [r for r in log if "step_s" in r][3:]  # past the warm-up steps
        total = sum(r["step_s"] for r in timed)
        rows.append({"run": name, "steps": len(timed), "steps_per_s": len(timed) / total,
                     "data_wait_share": statistics.mean(r["data_wait_share"] for r in timed),
                     "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in timed)})
    server.terminate()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["transport", "training", "both"], default="both")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of one request (Kimi width: 57 KB each in bf16)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--storages", default="exact,fp8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256, help="the tiny target's width for part `training`")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from store_master import running_master

    from eagle3.targets.mooncake import StoreAddress

    tmp = Path(tempfile.mkdtemp(prefix="bench-transport-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text() or "amx_bf16" in Path("/proc/cpuinfo").read_text()
    print(f"CPU: {cpu}, {os.cpu_count()} cores, native bf16: {'yes' if bf16 else 'no'}; torch threads {args.threads}")
    try:
        with running_master(tmp / "master") as master:
            addr = StoreAddress.of(master.settings)
            if args.part in ("transport", "both"):
                print(f"\n{'transport':>10} {'storage':>8} {'MB/req':>8} {'s/req':>8} {'server s':>9} {'tok/s':>9} "
                      f"{'GB/s':>6}")
                for storage in args.storages.split(","):
                    for transport in ("shm", "mooncake"):
                        r = run_transport(transport, storage, addr, args.tokens, args.requests, args.threads,
                                          tmp / f"{transport}-{storage}")
                        print(f"{r['transport']:>10} {r['storage']:>8} {r['MB']:8.1f} {r['s_per_request']:8.3f} "
                              f"{r['server_s']:9.3f} {r['tokens_per_s']:9.0f} {r['GB_per_s']:6.2f}", flush=True)
            if args.part in ("training", "both"):
                rows = run_training(master, args.steps, args.threads, tmp / "training", args.hidden)
                print(f"\n{'run':>18} {'steps':>6} {'steps/s':>8} {'tok/s':>8} {'data wait':>10}")
                for r in rows:
                    print(f"{r['run']:>18} {r['steps']:6d} {r['steps_per_s']:8.3f} {r['tokens_per_s']:8.0f} "
                          f"{r['data_wait_share']:10.1%}")
                print(f"online / offline step rate: {rows[1]['steps_per_s'] / rows[0]['steps_per_s']:.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
