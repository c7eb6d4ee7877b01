"""Extraction throughput vs a bare forward, cache size vs payload, and cache read speed, on the real SmolLM2.

    python benchmarks/bench_extract.py --prepared /tmp/h2run/prepared --samples 200 --max-tokens 192 --threads 1
    python benchmarks/bench_extract.py --prepared runs/smollm2-135m/prepared --dtypes bfloat16 --storages exact,fp8,fp8-aux

Needs a prepared SmolLM2 set (`eagle3 prepare --config configs/smollm2-135m.yaml data.max_samples=300
output_dir=/tmp/h2run`); without --prepared it tokenizes ShareGPT conversations itself with the chat template.
Bare forward and extraction (hooks + copy-out + Arrow write) run on the same batches, interleaved batch by batch,
so load from other processes on a shared machine hits both alike; the ratio is what matters.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eagle3.batching import collate, plan_batches
from eagle3.bundled import SMOLLM2, resolve_target_path, sharegpt_path
from eagle3.cache import (
    FORMAT_VERSION,
    HiddenStateDataset,
    Manifest,
    ShardWriter,
    payload_bytes_per_token,
    shard_name,
)
from eagle3.cache.codec import dense
from eagle3.config import Config
from eagle3.fsutil import write_json_atomic
from eagle3.precision import DTYPES
from eagle3.targets.argmax import ArgmaxHead
from eagle3.targets.hf import HFTarget, load_causal_lm


def load_samples(prepared: str | None, n: int, max_tokens: int) -> list[dict]:
    if prepared:
        from eagle3.data.prepared import load_prepared

        ds = load_prepared(prepared).train.select(range(n))
        return [{"sample_id": r["id"], "input_ids": r["input_ids"][:max_tokens],
                 "loss_mask": r["loss_mask"][:max_tokens]} for r in ds]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_target_path(SMOLLM2))
    convs = json.loads(Path(sharegpt_path()).read_text())
    out = []
    for c in convs:
        msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in c.get("conversations", []) if t.get("from") in ("human", "gpt")]
        if len(msgs) < 2:
            continue
        ids = tok.apply_chat_template(msgs, tokenize=True)[:max_tokens]
        out.append({"sample_id": c["id"], "input_ids": list(ids), "loss_mask": [1] * len(ids)})
        if len(out) == n:
            break
    return out


@torch.inference_mode()
def bare_forward(model: torch.nn.Module, seqs: list[list[int]]) -> None:
    """What the target costs anyway: the padded base-model forward, nothing kept."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, : len(s)] = torch.tensor(s)
        mask[j, : len(s)] = 1
    model.model(input_ids=ids, attention_mask=None if mask.all() else mask, use_cache=False)


def _open_cache(out: Path, name: str, dtype: str, target: HFTarget, storage: str) -> tuple[Path, ShardWriter]:
    cache = out / f"cache-{dtype}-{storage}"
    shutil.rmtree(cache, ignore_errors=True)
    (cache / "train").mkdir(parents=True)
    (cache / "eval").mkdir()
    fp = {"format": FORMAT_VERSION, "dtype": dtype, "hidden_size": target.hidden_size,
          "layer_ids": target.layer_ids,
          "layer_id_convention": "input-of-layer", "storage": storage}
    write_json_atomic(cache / "meta.json", {"fingerprint": fp, "layout": {"world_size": 1}})
    return cache, ShardWriter(cache / "train" / name, target.hidden_size, target.dtype, storage=storage)


def read_speed(cache: Path, batch_tokens: int) -> dict:
    """Tokens/s of reading the cache back: item views only; collated batches (what the trainer's data thread
    does); collated and dequantised on this CPU (what a CPU trainer also pays; a GPU trainer does it on device)."""
    ds = HiddenStateDataset(cache, "train")
    tokens = int(sum(ds.lengths))
    t0 = time.perf_counter()
    for i in range(len(ds)):
        ds[i]
    t_view = time.perf_counter() - t0
    batches = plan_batches(ds.lengths, batch_tokens, 64)
    for b in batches:  # warm the page cache: every timing below reads mapped pages already in memory
        collate([ds[i] for i in b])
    t0 = time.perf_counter()
    for b in batches:
        collate([ds[i] for i in b])
    t_collate = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in batches:
        dense(collate([ds[i] for i in b]), ds.dtype)
    t_dense = time.perf_counter() - t0
    return {"read_view_tok_s": tokens / t_view, "read_collate_tok_s": tokens / t_collate,
            "read_dense_tok_s": tokens / t_dense}


def bench_dtype(samples: list[dict], dtype: str, batch_tokens: int, out: Path, max_batches: int | None,
                storages: list[str]) -> list[dict]:
    """Bare forward vs extraction into each storage, on the same batches: the capture is shared, each storage's
    write (quantisation included) is timed on its own."""
    cfg = Config()
    cfg.target.dtype = dtype
    cfg.target.aux_layer_ids = [2, 15, 27]
    cfg.extract.batch_tokens = batch_tokens
    target = HFTarget(cfg.target, cfg.extract)
    argmax = ArgmaxHead.for_backend(target, cfg.target, cfg.extract.teacher_chunk)
    bare = load_causal_lm(target.path, DTYPES[dtype])
    batches = plan_batches([len(s["input_ids"]) for s in samples], batch_tokens, cfg.extract.max_batch_size)
    if max_batches:
        batches = batches[:max_batches]
    name = shard_name(0, 1, 0)
    caches = {st: _open_cache(out, name, dtype, target, st) for st in storages}
    bare_forward(bare, [samples[0]["input_ids"][:16]])  # warm-up
    t_bare = t_cap = 0.0
    t_write = dict.fromkeys(storages, 0.0)
    tokens = 0
    for b in batches:
        rows = [samples[i] for i in b]
        seqs = [r["input_ids"] for r in rows]
        t0 = time.perf_counter()
        bare_forward(bare, seqs)
        t1 = time.perf_counter()
        caps = target.capture(seqs)
        tops = [argmax(c.final) for c in caps]  # stored with the states, as extraction does
        t_bare += t1 - t0
        t_cap += time.perf_counter() - t1
        for st, (_, writer) in caches.items():
            t2 = time.perf_counter()
            writer.write([{**r, "aux": c.aux, "final": c.final, "target_argmax": top}
                          for r, c, top in zip(rows, caps, tops, strict=True)])
            t_write[st] += time.perf_counter() - t2
        tokens += sum(map(len, seqs))
    n = sum(len(b) for b in batches)
    results = []
    for st, (cache, writer) in caches.items():
        t0 = time.perf_counter()
        entry = writer.commit(0)
        t_write[st] += time.perf_counter() - t0
        Manifest("train", 0, 1, n, 1, [entry]).save(cache)
        Manifest("eval", 0, 1, 0, 0).save(cache)
        t_ext = t_cap + t_write[st]
        results.append({"dtype": dtype, "storage": st, "samples": n, "tokens": tokens, "bare_tok_s": tokens / t_bare,
                        "extract_tok_s": tokens / t_ext, "ratio": t_bare / t_ext, "bytes": entry.bytes,
                        "bytes_per_token": entry.bytes / tokens,
                        "payload_bytes_per_token": payload_bytes_per_token(target.hidden_size, dtype, st),
                        "exact_payload": payload_bytes_per_token(target.hidden_size, dtype),
                        **read_speed(cache, 4096)})
    target.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepared", default=None)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=192, help="truncate each sample (keeps the run short)")
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--storages", default="exact", help="comma-separated extract.storage values, e.g. exact,fp8,fp8-aux")
    ap.add_argument("--compare-batches", type=int, default=6,
                    help="batches for every dtype but the first (the dtype speed comparison); 0 = all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    samples = load_samples(args.prepared, args.samples, args.max_tokens)
    out = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    try:
        for i, dtype in enumerate(args.dtypes.split(",")):
            for r in bench_dtype(samples, dtype, args.batch_tokens, out,
                                 None if i == 0 else (args.compare_batches or None), args.storages.split(",")):
                print(f"[{dtype} {r['storage']}] {r['samples']} samples, {r['tokens']} tokens, threads={args.threads}")
                print(f"  bare forward {r['bare_tok_s']:.0f} tok/s | extraction {r['extract_tok_s']:.0f} tok/s | "
                      f"ratio extraction/bare {r['ratio']:.3f}")
                print(f"  cache {r['bytes'] / 1e6:.1f} MB, {r['bytes_per_token']:.1f} bytes/token vs payload minimum "
                      f"{r['payload_bytes_per_token']} ({r['bytes_per_token'] / r['payload_bytes_per_token']:.4f}x; "
                      f"{r['bytes_per_token'] / r['exact_payload']:.3f}x the exact payload)")
                print(f"  read: views {r['read_view_tok_s']:.0f} tok/s | collated {r['read_collate_tok_s']:.0f} tok/s | "
                      f"collated + dequantised here {r['read_dense_tok_s']:.0f} tok/s")
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
