"""The README.md every exported head ships with, as published heads do: what it drafts for, how it was made, what it
measured, and the exact command that serves it.

A head's folder alone says its target, layer ids, layer kind and options; the run it came from says the rest, when
the checkpoint sits in an eagle3 output folder (`<output_dir>/checkpoints/best` or a step): the prepared data's
sources and mixture (`prepared/meta.json`), the cache's target identity (`cache/meta.json`), the training budget
(`train_log.jsonl`) and the last evaluation card (`eval/report.json`). Whatever is missing is said, never guessed.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from eagle3.layer_ids import ArchFamily
from eagle3.tracking import LOSS_LOG

CARD_NAME = "README.md"


def run_folder(draft_folder: Path) -> Path | None:
    """The eagle3 output folder a draft folder was trained in (`.../checkpoints/<best|step_N>[/draft]`), or None."""
    for up in (draft_folder.parent, draft_folder.parent.parent):
        if up.name == "checkpoints":
            return up.parent
    return None


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _training(log: Path) -> dict[str, Any] | None:
    """Steps, epochs, peak lr and the best held-out acceptance of the run's log (what the run did, nothing timed:
    two runs of one config write the same card)."""
    try:
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return None
    steps = [r for r in rows if "loss" in r and "step" in r]
    evals = [(r["step"], r["eval"]["sim_accept_len"]) for r in rows
             if isinstance(r.get("eval"), dict) and "sim_accept_len" in r["eval"]]
    if not steps:
        return None
    best = max(evals, key=lambda e: e[1], default=None)
    return {"steps": steps[-1]["step"], "epochs": steps[-1].get("epoch", 0) + 1, "best": best,
            "lr": max(r.get("lr", 0.0) for r in steps)}


def _older(path: Path, draft_folder: Path) -> bool:
    """Whether `path` was written before the draft's weights were."""
    weights = [p.stat().st_mtime for p in draft_folder.glob("*.safetensors")]
    return bool(weights) and path.stat().st_mtime < max(weights)


def serve_command(engine: str, target: str, export: Path, num_steps: int) -> str:
    """The command that serves `target` with this export as its EAGLE-3 draft (chain: steps, top-k 1)."""
    if engine == "sglang":
        return shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm",
                           "EAGLE3", "--speculative-draft-model-path", str(export), "--speculative-num-steps",
                           str(num_steps), "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens",
                           str(num_steps + 1)])
    spec = json.dumps({"method": "eagle3", "model": str(export), "num_speculative_tokens": num_steps})
    return shlex.join(["vllm", "serve", target, "--speculative-config", spec])


def model_card(draft_folder: Path, draft_config: Any, export_config: dict[str, Any], engine: str, out: Path,
               num_steps: int, target_family: ArchFamily | None = None) -> str:
    """The README.md text of the export of `draft_folder` for `engine` at `out`."""
    meta = export_config.get("eagle3_export", {})
    target = (draft_config.target or {}).get("path") or "<target>"
    run = run_folder(draft_folder)
    lines = [f"# EAGLE-3 draft head for {target} ({engine})", "",
             f"Exported by eagle3 from `{draft_folder}` for {engine}.", "", "## Target", ""]
    arch = ", ".join((draft_config.target or {}).get("architectures") or []) or "?"
    lines.append(f"- model: `{target}` ({arch}, {(draft_config.target or {}).get('num_layers', '?')} layers, "
                 f"hidden {draft_config.target_hidden_size})")
    cache = _json(run / "cache" / "meta.json") if run else None
    if cache:
        fp = cache.get("fingerprint", {})
        lines.append(f"- weights id `{fp.get('weights_id')}` (revision {fp.get('revision')}), states stored "
                     f"{fp.get('storage')} in {fp.get('dtype')}")
    lines.append(f"- auxiliary layers: eagle3 ids {draft_config.aux_layer_ids} (input of decoder layer k); "
                 f"{engine}'s spelling in this folder: {meta.get('engine_layer_ids')} "
                 f"({meta.get('target_family') or target_family}-family target)")
    lines += ["", "## Head", "",
              f"- layer: `{draft_config.arch}`, hidden {draft_config.hidden_size}, {draft_config.num_attention_heads} "
              f"heads, MLP {draft_config.intermediate_size}; EAGLE-3.1 fc_norm {draft_config.fc_norm}, norm_output "
              f"{draft_config.norm_output}; features `{draft_config.features}`",
              f"- draft vocab {draft_config.draft_vocab_size} of {draft_config.vocab_size}; RoPE scaling "
              f"{json.dumps(draft_config.rope_scaling)}", "", "## Data", ""]
    prepared = _json(run / "prepared" / "meta.json") if run else None
    if prepared:
        s = prepared.get("summary", {})
        lines.append(f"- template `{prepared.get('chat_template')}`, max length {prepared.get('max_length')}, "
                     f"{s.get('train_samples')} train samples ({s.get('train_tokens')} tokens), "
                     f"{s.get('eval_samples')} held out")
        for src in s.get("train_sources", []):
            mix = (f"; weight {src['weight']:g}: {100 * src['epoch0_share']:.1f}% of an epoch's tokens "
                   f"(x{src['epoch0_repeat']:.2f})" if "weight" in src else "")
            lines.append(f"- source `{src['name']}`: {src['samples']} samples, {src['tokens']} tokens{mix}")
    else:
        lines.append("- no prepared data next to the checkpoint: not recorded here")
    lines += ["", "## Training", ""]
    trained = _training(run / LOSS_LOG) if run else None
    if trained:
        lines.append(f"- {trained['steps']} steps over {trained['epochs']} epoch(s) of the train split, peak lr "
                     f"{trained['lr']:g}" + (
                         f"; best held-out simulated acceptance length {trained['best'][1]:.3f} (step "
                         f"{trained['best'][0]})" if trained["best"] else ""))
    else:
        lines.append("- no training log next to the checkpoint: not recorded here")
    lines += ["", "## Evaluation (the run's last `eagle3 eval`)", ""]
    report_path = run / "eval" / "report.json" if run else None
    report = _json(report_path) if report_path else None
    if report and report.get("card") and Path(str(report.get("draft"))).resolve() != draft_folder.resolve():
        lines.append(f"- the run's last report is of another head (`{report.get('draft')}`): not this one's")
    elif report and report.get("card") and _older(report_path, draft_folder):
        lines.append("- the run's last report predates this head (an earlier training of the same folder): "
                     "`eagle3 eval --config ...` measures this one")
    elif report and report.get("card"):
        st = report.get("settings", {})
        engines = ", ".join(["builtin"] * bool(report.get("sets")) + list(report.get("engines", {})))
        lines += [f"Engine(s): {engines}; steps {st.get('num_steps')} / topk {st.get('topk')} / "
                  f"{st.get('num_draft_tokens')} draft tokens, temperature {st.get('temperature')}, "
                  f"{st.get('max_new_tokens')} new tokens, target {report.get('target', {}).get('dtype')}.", "",
                  "| prompt set | turns | τ | tokens per target forward |", "|---|---|---|---|"]
        lines += [f"| {r['set']} | {r.get('turns', '')} | {r['tau']:.3f} | {r.get('tokens_per_forward', 0):.3f} |"
                  for r in report["card"] if r.get("tau") is not None]
        for name, e in report.get("engines", {}).items():
            if isinstance(e, dict) and e.get("tau") is not None:
                lines.append(f"\n{name}: τ {e['tau']:.3f} (built-in on the same prompts: {e.get('builtin_tau')})")
    else:
        lines.append("- no evaluation report next to the checkpoint: `eagle3 eval --config ...` writes one")
    lines += ["", "## Serve", "", "```"]
    served = target
    if target.startswith("bundled:"):  # a safetensors folder eagle3 makes from the bundled GGUF, once
        from eagle3.bundled import eagle3_home

        served = str(eagle3_home() / "models" / target.removeprefix("bundled:"))
        lines.append("python -c 'from eagle3.bundled import materialise_smollm2; materialise_smollm2()'  # once")
    lines += [serve_command(engine, served, out.resolve(), num_steps), "```", ""]
    return "\n".join(lines)
