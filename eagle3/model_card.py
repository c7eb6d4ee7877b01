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

from eagle3.cache.codec import CacheError
from eagle3.cache.layout import read_meta
from eagle3.layer_ids import ArchFamily
from eagle3.paths import RunPaths

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


def serve_command(engine: str, target: str, export: Path, num_steps: int, hybrid: bool = False) -> str:
    """The command that serves `target` with this export as its EAGLE-3 draft (chain: steps, top-k 1); `hybrid`:
    paired with a model-free drafter by the rule exported beside it (eagle3.engines.vllm_hybrid, vLLM)."""
    if engine == "sglang":
        command = shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target,
                              "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(export),
                              "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", "1",
                              "--speculative-num-draft-tokens", str(num_steps + 1)])
        return f"EAGLE3_HYBRID=auto {command}" if hybrid else command
    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": num_steps}
    if hybrid:
        spec["disable_padded_drafter_batch"] = True
    command = shlex.join(["vllm", "serve", target, "--speculative-config", json.dumps(spec)])
    return f"EAGLE3_HYBRID=auto {command}" if hybrid else command


def model_card(draft_folder: Path, draft_config: Any, export_config: dict[str, Any], engine: str, out: Path,
               num_steps: int, target_family: ArchFamily | None = None, paths: RunPaths | None = None,
               hybrid: dict[str, Any] | None = None) -> str:
    """The README.md text of the export of `draft_folder` for `engine` at `out`. `paths`: the run's folders (a
    config's `cfg.paths`); without them, the default layout of the run folder the checkpoint sits in."""
    target = (draft_config.target or {}).get("path") or "<target>"
    run = run_folder(draft_folder)
    paths = paths or (RunPaths.under(run) if run else None)
    cache = _cache_meta(paths)
    lines = [f"# EAGLE-3 draft head for {target} ({engine})", "",
             f"Exported by eagle3 from `{draft_folder}` for {engine}.", "", "## Target", ""]
    lines += _target_lines(draft_config, export_config.get("eagle3_export", {}), engine, target_family, cache)
    lines += ["", "## Head", "", *_head_lines(draft_config), "", "## Data", "", *_data_lines(paths, cache)]
    lines += ["", "## Training", "", *_training_lines(paths)]
    lines += ["", "## Evaluation (the run's last `eagle3 eval`)", "", *_eval_lines(paths, draft_folder)]
    lines += ["", "## Serve", "", "```", *_serve_lines(target, engine, out, num_steps), "```", ""]
    if hybrid is not None:
        lines += _hybrid_lines(hybrid, target, engine, out, num_steps)
    return "\n".join(lines)


def _cache_meta(paths: RunPaths | None) -> dict[str, Any] | None:
    """The run's cache record (meta.json), or None: no cache next to the checkpoint (online training), or not one."""
    try:
        return read_meta(paths.cache_dir, upgraded=False) if paths else None
    except CacheError:
        return None


def _target_lines(c: Any, meta: dict[str, Any], engine: str, target_family: ArchFamily | None,
                  cache: dict[str, Any] | None) -> list[str]:
    arch = ", ".join((c.target or {}).get("architectures") or []) or "?"
    lines = [f"- model: `{(c.target or {}).get('path') or '<target>'}` ({arch}, "
             f"{(c.target or {}).get('num_layers', '?')} layers, hidden {c.target_hidden_size})"]
    fp = (cache or {}).get("fingerprint")
    if fp:
        lines.append(f"- weights id `{fp.get('weights_id')}` (revision {fp.get('revision')}), states stored "
                     f"{fp.get('storage')} in {fp.get('dtype')}")
    lines.append(f"- auxiliary layers: eagle3 ids {c.aux_layer_ids} (input of decoder layer k); {engine}'s spelling "
                 f"in this folder: {meta.get('engine_layer_ids')} ({meta.get('target_family') or target_family}-family "
                 "target)")
    return lines


def _head_lines(c: Any) -> list[str]:
    images = getattr(c, "image_inputs", None)
    return [f"- layer: `{c.arch}`, hidden {c.hidden_size}, {c.num_attention_heads} heads, MLP {c.intermediate_size}; "
            f"EAGLE-3.1 fc_norm {c.fc_norm}, norm_output {c.norm_output}; features `{c.features}`",
            f"- draft vocab {c.draft_vocab_size} of {c.vocab_size}; RoPE scaling {json.dumps(c.rope_scaling)}",
            *([f"- trained on image samples with `{images}` inputs at image tokens (draft.image_inputs: "
               f"{'vLLM' if images == 'placeholder' else 'SGLang'}'s convention)"] if images else [])]


def _data_lines(paths: RunPaths | None, cache: dict[str, Any] | None) -> list[str]:
    # the record alone (a card is written where the samples themselves may not be, and never refuses a head)
    prepared = _json(paths.prepared_dir / "meta.json") if paths else None
    if not prepared:
        return ["- no prepared data next to the checkpoint: not recorded here"]
    s = prepared.get("summary", {})
    lines = [f"- template `{prepared.get('chat_template')}`, max length {prepared.get('max_length')}, "
             f"{s.get('train_samples')} train samples ({s.get('train_tokens')} tokens), {s.get('eval_samples')} held out"]
    for src in s.get("train_sources", []):
        mix = (f"; weight {src['weight']:g}: {100 * src['epoch0_share']:.1f}% of an epoch's tokens "
               f"(x{src['epoch0_repeat']:.2f})" if "weight" in src else "")
        lines.append(f"- source `{src['name']}`: {src['samples']} samples, {src['tokens']} tokens{mix}")
    cut = ((cache or {}).get("layout") or {}).get("max_samples")
    if cut is not None and cut < (s.get("train_samples") or 0):
        lines.append(f"- extracted and trained on: the first {cut} train samples (extract.max_samples)")
    return lines


def _training_lines(paths: RunPaths | None) -> list[str]:
    trained = _training(paths.loss_log) if paths else None
    if not trained:
        return ["- no training log next to the checkpoint: not recorded here"]
    best = trained["best"]
    return [f"- {trained['steps']} steps over {trained['epochs']} epoch(s) of the train split, peak lr "
            f"{trained['lr']:g}" + (f"; best held-out simulated acceptance length {best[1]:.3f} (step {best[0]})"
                                    if best else "")]


def _eval_lines(paths: RunPaths | None, draft_folder: Path) -> list[str]:
    report_path = paths.eval_dir / "report.json" if paths else None
    report = _json(report_path) if report_path else None
    if not (report and report.get("card")):
        return ["- no evaluation report next to the checkpoint: `eagle3 eval --config ...` writes one"]
    if Path(str(report.get("draft"))).resolve() != draft_folder.resolve():
        return [f"- the run's last report is of another head (`{report.get('draft')}`): not this one's"]
    if _older(report_path, draft_folder):
        return ["- the run's last report predates this head (an earlier training of the same folder): "
                "`eagle3 eval --config ...` measures this one"]
    st = report.get("settings", {})
    engines = ", ".join(["builtin"] * bool(report.get("sets")) + list(report.get("engines", {})))
    lines = [f"Engine(s): {engines}; steps {st.get('num_steps')} / topk {st.get('topk')} / "
             f"{st.get('num_draft_tokens')} draft tokens, temperature {st.get('temperature')}, "
             f"{st.get('max_new_tokens')} new tokens, target {report.get('target', {}).get('dtype')}.", "",
             "| prompt set | turns | τ | tokens per target forward |", "|---|---|---|---|"]
    lines += [f"| {r['set']} | {r.get('turns', '')} | {r['tau']:.3f} | {r.get('tokens_per_forward', 0):.3f} |"
              for r in report["card"] if r.get("tau") is not None]
    for name, e in report.get("engines", {}).items():
        if isinstance(e, dict) and e.get("tau") is not None:
            lines.append(f"\n{name}: τ {e['tau']:.3f} (built-in on the same prompts: {e.get('builtin_tau')})")
    return lines


def _hybrid_lines(hybrid: dict[str, Any], target: str, engine: str, out: Path, num_steps: int) -> list[str]:
    """The hybrid drafter exported beside the head: its rule and the command that serves the pairing."""
    from eagle3.engines.hybrid_rule import RULE_FILE, SUFFIX_DIR

    rule = hybrid["rule"] + (f" on {', '.join(hybrid['features'])}" if hybrid["rule"] == "router" else "")
    return ["## Hybrid drafter", "",
            f"`{RULE_FILE}` holds eagle3's hybrid rule ({rule}): each round, per request, the head's draft or a "
            f"model-free one (suffix decoding, prompt lookup), through eagle3's {engine} plugin (`pip install "
            f"--no-deps eagle3` in {engine}'s environment; suffix decoding needs arctic-inference, or eagle3's "
            f"`{SUFFIX_DIR.name}` build on PYTHONPATH). Greedy output is the target's own.", "",
            "```", *_serve_lines(target, engine, out, num_steps, hybrid=True), "```", ""]


def _serve_lines(target: str, engine: str, out: Path, num_steps: int, hybrid: bool = False) -> list[str]:
    served, lines = target, []
    if target.startswith("bundled:"):  # a safetensors folder eagle3 makes from the bundled GGUF, once
        from eagle3.bundled import eagle3_home

        served = str(eagle3_home() / "models" / target.removeprefix("bundled:"))
        lines.append("python -c 'from eagle3.bundled import materialise_smollm2; materialise_smollm2()'  # once")
    return [*lines, serve_command(engine, served, out.resolve(), num_steps, hybrid)]
