"""Stage throughputs, peak memory, cache size and τ of a recipe run folder, as the BENCHMARKS.md table rows.

    python benchmarks/bench_stages.py runs/smollm2-135m [runs/smollm2-135m/abl/top ...]

Reads only what the recipe already wrote (recipes/smollm2-135m/run.sh): logs/<stage>.time (`/usr/bin/time -v`:
wall time, peak RSS), logs/prepare.log and logs/extract.log (conversations/s, tokens/s), train_log.jsonl
(tokens/s, data-wait share; the first 3 steps are warm-up and not counted), eval/report.json and
tree/eval/report.json (τ, acceptance per position, tokens/s with and without speculation), cache/meta.json and its
shards (bytes per token vs the payload minimum). Also projects the cache size for Kimi-K2.5 (hidden 7168) per
10K samples of 2K tokens. Nothing is re-run: the numbers are those of the run itself.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

KIMI_HIDDEN = 7168


def peak_and_wall(time_file: Path) -> tuple[float | None, float | None]:
    """(peak RSS in MB, wall seconds) from a `/usr/bin/time -v` report."""
    if not time_file.is_file():
        return None, None
    text = time_file.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    secs = None
    if wall:
        secs = 0.0
        for part in wall.group(1).split(":"):
            secs = secs * 60 + float(part)
    return (int(rss.group(1)) / 1024 if rss else None), secs


def train_stats(run: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "tokens_per_s" in r and r["step"] > 3]
    evals = [r["eval"] for r in rows if "eval" in r]
    best = max(evals, key=lambda e: e["sim_accept_len"]) if evals else {}
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
            "data_wait_share": statistics.mean(r["data_wait_share"] for r in steps),
            "steps": rows[-1]["step"] if rows else 0, "best_sim_accept_len": best.get("sim_accept_len", float("nan")),
            "best_acc": [best.get(f"acc_{j}") for j in range(8) if f"acc_{j}" in best]}


def eval_stats(report: Path) -> dict | None:
    if not report.is_file():
        return None
    r = json.loads(report.read_text())
    s = r["sets"]["mt-bench"]
    return {"settings": r["settings"], "tau": s["tau"], "rate": s["acceptance_rate"], "turns": s["turns"],
            "spec_tps": s["tokens_per_s"]["spec"], "base_tps": s["tokens_per_s"]["baseline"],
            "tokens_per_forward": s["tokens_per_forward"], "mismatches": s.get("greedy_mismatches")}


def cache_stats(cache: Path) -> dict[str, float] | None:
    meta_file = cache / "meta.json"
    if not meta_file.is_file():
        return None
    fp = json.loads(meta_file.read_text())["fingerprint"]
    item = 4 if fp["dtype"] == "float32" else 2
    h = int(fp["hidden_size"])
    tokens = size = 0
    for split in ("train", "eval"):
        for m in (cache / split).glob("rank-*.json"):
            for sh in json.loads(m.read_text())["shards"]:
                tokens += sh["num_tokens"]
                size += sh["bytes"]
    payload = 4 * h * item + 4 + 1
    kimi = 4 * KIMI_HIDDEN * item + 4 + 1
    return {"tokens": tokens, "bytes": size, "bytes_per_token": size / tokens if tokens else float("nan"),
            "payload": payload, "kimi_bytes_per_token": kimi, "kimi_10k_x_2k_tb": kimi * 10_000 * 2048 / 1e12}


def main(runs: list[str]) -> int:
    for name in runs:
        run = Path(name)
        print(f"## {run}")
        logs = run / "logs"
        for stage in ("prepare", "extract", "train", "export-sglang", "export-vllm", "eval", "eval-tree"):
            rss, wall = peak_and_wall(logs / f"{stage}.time")
            if rss is not None:
                print(f"  {stage:14s} wall {wall:7.0f} s   peak RSS {rss:7.0f} MB")
        if (logs / "prepare.log").is_file():
            m = re.search(r"time: ([\d.]+)s \((\d+) conversations/s", (logs / "prepare.log").read_text())
            if m:
                print(f"  prepare: {m.group(2)} conversations/s rendered ({m.group(1)} s)")
        if (logs / "extract.log").is_file():
            m = re.search(r"extracted (\d+) samples, (\d+) tokens in ([\d.]+)s \((\d+) tokens/s\)",
                          (logs / "extract.log").read_text())
            if m:
                print(f"  extract: {m.group(2)} tokens of {m.group(1)} samples in {m.group(3)} s = {m.group(4)} tokens/s")
        if (run / "train_log.jsonl").is_file():
            t = train_stats(run)
            print(f"  train: {t['steps']} steps, median {t['tokens_per_s']:.0f} tokens/s, data wait "
                  f"{100 * t['data_wait_share']:.1f}%, best held-out sim_accept_len {t['best_sim_accept_len']:.3f} "
                  f"acc_j {t['best_acc']}")
        for rep in (run / "eval" / "report.json", run / "tree" / "eval" / "report.json"):
            e = eval_stats(rep)
            if e:
                st = e["settings"]
                rate = " / ".join(f"{100 * x:.0f}%" for x in e["rate"])
                print(f"  eval steps {st['num_steps']} topk {st['topk']} tokens {st['num_draft_tokens']}: τ {e['tau']:.3f} "
                      f"(per position {rate}), {e['turns']} turns, tokens/forward {e['tokens_per_forward']:.2f}, "
                      f"tokens/s spec {e['spec_tps']:.2f} vs plain {e['base_tps']:.2f}, greedy mismatches {e['mismatches']}")
        c = cache_stats(run / "cache")
        if c:
            print(f"  cache: {c['tokens']} tokens, {c['bytes'] / 1e6:.1f} MB, {c['bytes_per_token']:.1f} bytes/token "
                  f"(payload minimum {c['payload']}: {c['bytes_per_token'] / c['payload']:.4f}x); Kimi-K2.5 "
                  f"(hidden {KIMI_HIDDEN}): {c['kimi_bytes_per_token']} bytes/token -> {c['kimi_10k_x_2k_tb']:.2f} TB "
                  "per 10K samples of 2048 tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["runs/smollm2-135m"]))
