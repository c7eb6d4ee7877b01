"""Extraction throughput vs a bare forward, cache size vs payload, and cache read speed, on the real SmolLM2.

    python benchmarks/bench_extract.py --prepared /tmp/h2run/prepared --samples 200 --max-tokens 192 --threads 1

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

from eagle3.bundled import SMOLLM2, resolve_target_path, sharegpt_path
from eagle3.cache import (
    HiddenStateDataset,
    Manifest,
    ShardEntry,
    ShardWriter,
    payload_bytes_per_token,
    shard_name,
    write_json_atomic,
)
from eagle3.config import Config
from eagle3.targets.hf import _DTYPES, HFTarget, load_causal_lm, plan_batches


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


def bench_dtype(samples: list[dict], dtype: str, batch_tokens: int, out: Path, max_batches: int | None) -> dict:
    cfg = Config()
    cfg.target.dtype = dtype
    cfg.target.aux_layer_ids = [2, 15, 27]
    cfg.extract.batch_tokens = batch_tokens
    target = HFTarget(cfg)
    bare = load_causal_lm(target.path, _DTYPES[dtype])
    batches = plan_batches([len(s["input_ids"]) for s in samples], batch_tokens, cfg.extract.max_batch_size)
    if max_batches:
        batches = batches[:max_batches]
    cache = out / f"cache-{dtype}"
    shutil.rmtree(cache, ignore_errors=True)
    (cache / "train").mkdir(parents=True)
    (cache / "eval").mkdir()
    fp = {"dtype": dtype, "hidden_size": target.hidden_size, "layer_ids": target.layer_ids,
          "layer_id_convention": "input-of-layer"}
    write_json_atomic(cache / "meta.json", {"fingerprint": fp, "layout": {"world_size": 1}})
    writer = ShardWriter(cache / "train" / shard_name(0, 1, 0), target.hidden_size, target.dtype)
    bare_forward(bare, [samples[0]["input_ids"][:16]])  # warm-up
    t_bare = t_ext = 0.0
    tokens = 0
    for b in batches:
        rows = [samples[i] for i in b]
        seqs = [r["input_ids"] for r in rows]
        t0 = time.perf_counter()
        bare_forward(bare, seqs)
        t1 = time.perf_counter()
        caps = target.capture(seqs)
        writer.write([{**r, "aux": c.aux, "final": c.final} for r, c in zip(rows, caps, strict=True)])
        t2 = time.perf_counter()
        t_bare += t1 - t0
        t_ext += t2 - t1
        tokens += sum(map(len, seqs))
    t0 = time.perf_counter()
    size = writer.commit()
    t_ext += time.perf_counter() - t0
    n = sum(len(b) for b in batches)
    Manifest("train", 0, 1, n, 1, [ShardEntry(0, shard_name(0, 1, 0), n, tokens, size)]).save(cache)
    Manifest("eval", 0, 1, 0, 0).save(cache)
    res = {"dtype": dtype, "samples": n, "tokens": tokens, "bare_tok_s": tokens / t_bare,
           "extract_tok_s": tokens / t_ext, "ratio": t_bare / t_ext, "bytes": size, "bytes_per_token": size / tokens,
           "payload_bytes_per_token": payload_bytes_per_token(target.hidden_size, dtype)}
    # Reading back: views only (what indexing costs) and materialised (every byte touched: a copy of each item).
    ds = HiddenStateDataset(cache, "train")
    t0 = time.perf_counter()
    for i in range(len(ds)):
        ds[i]
    t_view = time.perf_counter() - t0
    t0 = time.perf_counter()
    nbytes = 0
    for i in range(len(ds)):
        it = ds[i]
        nbytes += it["aux"].clone().nbytes + it["final"].clone().nbytes
    t_copy = time.perf_counter() - t0
    res.update(read_items_s=len(ds) / t_view, read_view_tok_s=tokens / t_view, read_copy_tok_s=tokens / t_copy,
               read_copy_gb_s=nbytes / t_copy / 1e9)
    target.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepared", default=None)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=192, help="truncate each sample (keeps the run short)")
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--compare-batches", type=int, default=6,
                    help="batches for every dtype but the first (the dtype speed comparison); 0 = all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    samples = load_samples(args.prepared, args.samples, args.max_tokens)
    out = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    try:
        for i, dtype in enumerate(args.dtypes.split(",")):
            r = bench_dtype(samples, dtype, args.batch_tokens, out, None if i == 0 else (args.compare_batches or None))
            print(f"[{dtype}] {r['samples']} samples, {r['tokens']} tokens, threads={args.threads}")
            print(f"  bare forward {r['bare_tok_s']:.0f} tok/s | extraction {r['extract_tok_s']:.0f} tok/s | "
                  f"ratio extraction/bare {r['ratio']:.3f}")
            print(f"  cache {r['bytes'] / 1e6:.1f} MB, {r['bytes_per_token']:.1f} bytes/token vs payload minimum "
                  f"{r['payload_bytes_per_token']} ({r['bytes_per_token'] / r['payload_bytes_per_token']:.4f}x)")
            print(f"  read: {r['read_items_s']:.0f} items/s as views ({r['read_view_tok_s']:.0f} tok/s); "
                  f"materialised {r['read_copy_tok_s']:.0f} tok/s = {r['read_copy_gb_s']:.2f} GB/s")
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
