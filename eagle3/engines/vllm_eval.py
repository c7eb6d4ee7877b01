"""Measure the head's acceptance inside vLLM, on the prompts the built-in evaluator used.

    bash scripts/setup_vllm_cpu.sh     # once: vLLM for CPU in its own virtualenv, /work/vllm-venv
    EAGLE3_VLLM_PYTHON=/work/vllm-venv/bin/python eagle3 eval --config configs/smollm2-135m.yaml --engine vllm

The parent side (`run_vllm`) exports the head to vLLM's format and starts THIS FILE as a script in a subprocess
(`$EAGLE3_VLLM_PYTHON` or the current interpreter): vLLM starts engine processes and owns the device, so it gets
a process of its own, and the script imports nothing from eagle3 (it also runs in a virtualenv without eagle3).
The script runs `vllm.LLM(model=target, speculative_config={"method": "eagle3", "model": draft,
"num_speculative_tokens": n}, enforce_eager=True)` on the token-id prompts and writes vLLM's Prometheus-style
counters: `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos`. τ = 1 + accepted / drafts (vLLM's acceptance length, bonus token included).

What real vLLM (vllm-cpu 0.32.0) needs, learnt by running it: `enforce_eager=True` (the compiled CPU path gave
wrong greedy text), `LLM(...)` only under `if __name__ == "__main__"` (engine processes re-import the main
module), `VLLM_CPU_KVCACHE_SPACE` (GiB; default here 2), and the evaluator's own stop ids (`stop_token_ids`:
vLLM stops only at the tokenizer's eos by default, the evaluator also at generation_config's). At temperature 0
the parent also decodes the prompts with plain HF greedy and reports how many vLLM outputs equal it.

Image prompts (`run_vllm(..., images=...)`, a vision-language target such as Qwen2.5-VL): the ids arrive as prepare
and the built-in evaluator render them, each image's placeholder expanded to its N tokens by the HF processor, and
each image goes to vLLM as `multi_modal_data`. vLLM 0.32 always applies its own expansion to ONE placeholder
(`_maybe_apply_prompt_updates`, vllm/multimodal/processing/processor.py; Qwen2.5-VL's replacement in
model_executor/models/qwen2_5_vl.py): pre-expanded ids would get N more tokens at the first pad of each run and keep
the rest as text, silently. So the child collapses each run of image tokens to one, and reports whether vLLM's
prompt ids equal the ones sent. Torchvision for vLLM's processes: eagle3.engines.vllm_torchvision. At temperature 0
image prompts get their HF reference from the whole vision-language model (eagle3.engines.reference).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3.config import EvalConfig, TargetConfig
    from eagle3.engines import EngineRun

log = logging.getLogger("eagle3")

PREFIX = "vllm:spec_decode_"


# ---------------------------------------------------------------------------------------------- parsing
def parse_vllm_metrics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Spec-decode counters -> τ and per-position acceptance. `records`: [{"name", "value"} | {"name", "values"}]
    as `LLM.get_metrics()` gives them (Counter / Vector); label sets of the same name are summed."""
    totals, per_pos = _counters(records)
    if totals["num_drafts"] <= 0:
        raise ValueError("vLLM reported no speculative drafts: was the draft loaded (speculative_config) and were "
                         "stats enabled (disable_log_stats=False)?")
    return _rates(totals, per_pos)


def group_metrics(snapshots: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per group of prompts, τ and acceptance from the counters' growth while that group ran: `snapshots` are
    [{"group", "metrics"}] taken after each group, in run order (vLLM's counters are cumulative). A group with no
    draft (every turn ended at once) has τ nan."""
    out: dict[str, dict[str, Any]] = {}
    before: tuple[dict[str, float], list[float]] = ({}, [])
    for snap in snapshots:
        totals, per_pos = _counters(snap["metrics"])
        delta = {k: v - before[0].get(k, 0.0) for k, v in totals.items()}
        pos = [v - (before[1][i] if i < len(before[1]) else 0.0) for i, v in enumerate(per_pos)]
        out[snap["group"]] = _rates(delta, pos, snap.get("generated"))
        before = (totals, per_pos)
    return out


def pooled_groups(groups: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """The groups `name` and `name/...` counted together (a prompt set over its categories)."""
    parts = [g for k, g in groups.items() if k == name or k.startswith(name + "/")]
    totals = {k: float(sum(g[k] for g in parts)) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    width = max((len(g["acceptance_rate"]) for g in parts), default=0)
    per_pos = [sum(g["acceptance_rate"][i] * g["num_drafts"] for g in parts if i < len(g["acceptance_rate"]))
               for i in range(width)]
    generated = sum(g["generated_tokens"] for g in parts) if all("generated_tokens" in g for g in parts) else None
    return _rates(totals, per_pos, generated)


def _rates(totals: dict[str, float], per_pos: list[float], generated: int | None = None) -> dict[str, Any]:
    """τ and acceptance from the counters; with the tokens generated, also tokens per target forward: each forward
    emits one token that was not an accepted draft (the prefill's, a bonus, or a step without a draft), so
    forwards = generated - accepted (what compares drafting methods: REFERENCE.md §3)."""
    drafts = totals["num_drafts"]
    extra: dict[str, Any] = {}
    if generated is not None:
        forwards = generated - totals["num_accepted_tokens"]
        extra = {"generated_tokens": int(generated),
                 "tokens_per_forward": generated / forwards if forwards > 0 else float("nan")}
    return extra | {
        "tau": 1.0 + totals["num_accepted_tokens"] / drafts if drafts else float("nan"),
        "acceptance_rate": [v / drafts for v in per_pos] if drafts else [],
        "num_drafts": int(drafts),
        "num_draft_tokens": int(totals["num_draft_tokens"]),
        "num_accepted_tokens": int(totals["num_accepted_tokens"]),
        "draft_token_acceptance": (totals["num_accepted_tokens"] / totals["num_draft_tokens"]
                                   if totals["num_draft_tokens"] else float("nan")),
    }


def _counters(records: list[dict[str, Any]]) -> tuple[dict[str, float], list[float]]:
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
    return totals, per_pos


# ------------------------------------------------------------------------------------------- parent side
def stop_token_ids(target: TargetConfig) -> list[int]:
    """The ids the built-in evaluator stops at (tokenizer eos + generation_config eos), so that vLLM stops at
    exactly the same tokens: vLLM alone uses only the tokenizer's eos, and SmolLM2's generation_config differs."""
    from transformers import GenerationConfig

    from eagle3.bundled import resolve_target_path
    from eagle3.data.templates import load_tokenizer
    from eagle3.targets.hf import eos_ids

    try:
        generation = GenerationConfig.from_pretrained(resolve_target_path(target.path))
    except OSError:  # no generation_config.json
        generation = None
    return eos_ids(load_tokenizer(target), generation)


def _run_echoing(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, list[str]]:
    """Run `cmd` with its output passed through to this process's stderr as it comes (vLLM's start takes minutes
    on a CPU), keeping the last lines to explain a failure."""
    import collections

    tail: collections.deque[str] = collections.deque(maxlen=200)
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:  # type: ignore[union-attr]
            sys.stderr.write(line)
            tail.append(line.rstrip("\n"))
            if time.monotonic() > deadline:
                proc.kill()
                tail.append(f"(killed after {timeout_s:.0f} s)")
                break
        return proc.wait(), list(tail)


def _root_cause(tail: list[str]) -> str:
    """The line of vLLM's output that says what went wrong."""
    if any("No module named 'vllm'" in line for line in tail):
        return ("this interpreter cannot import vllm: set EAGLE3_VLLM_PYTHON to vLLM's virtualenv python "
                "(bash scripts/setup_vllm_cpu.sh creates one)")
    errors = [line for line in tail if "Error" in line and ":" in line]
    return errors[-1].strip() if errors else (tail[-1] if tail else "no output")


CPU_SAMPLING = (
    "not to be trusted: this vLLM's CPU backend scales the target's logits at the draft positions by garbage "
    "instead of the temperature (its C++ stand-in for the Triton `expand_kernel` writes into an int64 copy of the "
    "output and drops it, vllm/utils/cpu_triton_utils.py in vLLM 0.32), and the repair the eval applies for it did "
    "not take. The built-in evaluator's τ, or vLLM on a GPU, is the one to use")
"""Why vLLM's τ at temperature > 0 is flagged on a CPU (see _repair_cpu_expand)."""

def run_vllm(run: EngineRun, draft_folder: Path | None, prompts: list[list[int]], python: str | None = None,
             timeout_s: float = 3600, check_greedy: bool = True, groups: list[str] | None = None,
             method: str = "eagle3", images: list[list[str]] | None = None, hybrid: dict[str, Any] | None = None,
             ) -> dict[str, Any]:
    """Export the head for vLLM, replay `prompts` (token ids) in vLLM, return its τ and counters; with `groups`
    (one name per prompt, e.g. `mt-bench/coding`), vLLM runs each group in turn and `groups` in the result holds
    each one's τ, acceptance and tokens per target forward (group_metrics). `method="ngram"`: vLLM's own
    prompt-lookup drafting instead of the head (eval.ngram_min / ngram_max, eval.num_steps tokens); `"suffix"`: its
    suffix decoding (arctic-inference's suffix trees over the prompt and earlier outputs); `"plain"`: no drafting,
    only the outputs (a dialogue's earlier answers, eagle3.engines.vllm_dialogues). `images`: per prompt, the image files (absolute
    paths) its image tokens stand for, in order ([] for a text prompt); the ids hold each image's tokens expanded
    as the HF processor does, and the result's `image_prompts` / `image_prompts_same_ids` say how many image prompts
    vLLM expanded to exactly the ids sent (see the module docstring).

    At temperature 0 (and `check_greedy`), vLLM's outputs are also compared with plain HF greedy decoding of
    the target: speculative decoding must not change greedy text (`greedy_same` of `greedy_compared`). `hybrid`
    (method eagle3): the rule of eagle3's hybrid drafter, a vLLM plugin (eagle3.engines.vllm_hybrid)."""
    from eagle3.bundled import resolve_target_path
    from eagle3.engines.hybrid_rule import suffix_dir
    from eagle3.engines.reference import compare_greedy, hf_greedy
    from eagle3.engines.vllm_hybrid import child_hybrid_args
    from eagle3.engines.vllm_torchvision import torchvision_env
    from eagle3.targets.info import read_target_info

    out_dir, draft_args = _method_args(method, draft_folder, run.paths.export_dir / "vllm", run.eval,
                                       run.target.layer_id_family, hybrid)
    python = python or os.environ.get("EAGLE3_VLLM_PYTHON") or sys.executable
    stop = stop_token_ids(run.target)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vllm-cpu's default reserves more than a small box has
    with tempfile.TemporaryDirectory(prefix="eagle3-vllm-") as tmp:
        prompts_file, result_file = Path(tmp) / "prompts.json", Path(tmp) / "result.json"
        prompts_file.write_text(json.dumps(prompts))
        torchvision_env(env, Path(tmp))
        hybrid_args = [] if hybrid is None else child_hybrid_args(env, Path(tmp), method)
        if method == "suffix":  # arctic-inference's suffix tree, where scripts/setup_suffix_decoding.sh built it
            env["PYTHONPATH"] = os.pathsep.join(x for x in (str(suffix_dir()), env.get("PYTHONPATH", "")) if x)
        side_args = _side_files(run, Path(tmp), len(prompts), groups, images)
        side_args += ["--mla"] if read_target_info(run.target.path).mla else []
        cmd = [python, str(Path(__file__).resolve()), "--target", resolve_target_path(run.target.path),
               *draft_args, "--prompts", str(prompts_file), "--out", str(result_file),
               "--num-spec", str(run.eval.num_steps), "--temperature", str(run.eval.temperature),
               "--draft-sample-method", run.eval.draft_sampling,
               "--max-tokens", str(run.eval.max_new_tokens), "--dtype", run.target.dtype, "--seed",
               str(run.eval.seed), "--stop-token-ids", ",".join(str(t) for t in stop), *side_args, *hybrid_args]
        code, tail = _run_echoing(cmd, env, timeout_s)
        if code != 0 or not result_file.is_file():
            raise RuntimeError(f"vLLM check failed (exit {code}): {_root_cause(tail)}; command: {' '.join(cmd)}")
        raw = json.loads(result_file.read_text())
    if method == "plain":  # no drafts: only the answers (to render a dialogue's next turn)
        return {"method": method, "prompts": len(prompts), "outputs": raw["outputs"], "seconds": raw.get("seconds")}
    result = _vllm_result(raw, method, out_dir, prompts, stop, run.eval.temperature)
    if hybrid is not None:
        result["hybrid"] = hybrid
    if check_greedy and run.eval.temperature <= 0 and raw.get("outputs") is not None:
        ref = hf_greedy(run.target, prompts, run.eval.max_new_tokens, stop,
                        images=images if images is not None and any(images) else None)
        result.update(compare_greedy(raw["outputs"], ref, stop))
    return result


def _side_files(run: EngineRun, tmp: Path, n: int, groups: list[str] | None, images: list[list[str]] | None
                ) -> list[str]:
    """The child's per-prompt inputs beside the prompts, written into `tmp`: group names, image files (a `data:`
    URL as a file of its bytes: the child cannot import eagle3) and the image token -> its arguments."""
    from eagle3.data.images import as_files

    args: list[str] = []
    for name, rows, what in (("images", images, "image lists"), ("groups", groups, "group names")):
        if rows is None or (name == "images" and not any(rows)):
            continue
        if len(rows) != n:
            raise ValueError(f"{len(rows)} {what} for {n} prompts")
        data = as_files(rows, tmp / "images") if name == "images" else rows
        (tmp / f"{name}.json").write_text(json.dumps(data))
        args += [f"--{name}", str(tmp / f"{name}.json")]
        if name == "images":
            args += ["--image-token-id", str(image_token(run))]
    return args


def _method_args(method: str, draft_folder: Path | None, export_to: Path, ev: EvalConfig, family: str,
                 hybrid: dict[str, Any] | None = None) -> tuple[Path | None, list[str]]:
    """(the head exported for vLLM to `export_to`, or None; the child's drafting arguments) of one method; the
    hybrid's rule is exported beside the head, where the plugin finds it (EAGLE3_HYBRID=auto), as a user serves it."""
    from eagle3.export import export

    if method == "plain":
        out_dir, draft_args = None, ["--method", "plain"]
    elif method == "eagle3":
        if draft_folder is None:
            raise ValueError("vLLM's eagle3 method needs the head to export")
        out_dir = export(draft_folder, export_to, to="vllm", num_speculative_tokens=ev.num_steps,
                         target_family=family, hybrid=hybrid)
        draft_args = ["--draft", str(out_dir)]
    else:
        out_dir = None
        draft_args = ["--method", method, "--prompt-lookup-min", str(ev.ngram_min), "--prompt-lookup-max",
                      str(ev.ngram_max)] if method == "ngram" else ["--method", method]
    return out_dir, draft_args


def _vllm_result(raw: dict[str, Any], method: str, out_dir: Path | None, prompts: list[list[int]], stop: list[int],
                 temperature: float) -> dict[str, Any]:
    """The child's counters as the evaluator's result: τ, acceptance, tokens per target forward, per group."""
    result = parse_vllm_metrics(raw["metrics"])
    generated = raw.get("generated_tokens")
    if generated is not None:
        forwards = generated - result["num_accepted_tokens"]
        result["tokens_per_forward"] = generated / forwards if forwards > 0 else float("nan")
    result.update(method=method, draft_export=str(out_dir) if out_dir else None, prompts=len(prompts),
                  generated_tokens=generated,
                  seconds=raw.get("seconds"), vllm_version=raw.get("vllm_version"), stop_token_ids=stop,
                  outputs=raw.get("outputs"))
    if raw.get("image_prompts"):
        same = raw.get("prompt_ids_same") or []
        result.update(image_prompts=raw["image_prompts"],
                      image_prompts_same_ids=sum(1 for i, s in enumerate(same) if s and raw["with_images"][i]))
        if result["image_prompts_same_ids"] != raw["image_prompts"]:
            log.error("vLLM expanded %d of %d image prompts to other ids than sent (its image processor makes another "
                      "token count, or the ids were not expanded as the HF processor does): its τ is not comparable",
                      raw["image_prompts"] - result["image_prompts_same_ids"], raw["image_prompts"])
    if raw.get("prompt_tokens") is not None:
        from eagle3.engines import prompt_agreement

        result.update(prompt_agreement("vLLM", [len(p) for p in prompts], raw["prompt_tokens"]))
    if raw.get("group_metrics"):
        result["groups"] = group_metrics(raw["group_metrics"])
    if raw.get("sampling_repair"):
        result["sampling_repair"] = raw["sampling_repair"]
        log.info("vLLM: %s", raw["sampling_repair"])
    if temperature > 0 and raw.get("platform") == "cpu" and not raw.get("sampling_ok"):
        result["untrusted"] = CPU_SAMPLING
        log.warning("vLLM's acceptance at temperature %s: %s", temperature, CPU_SAMPLING)
    return result


# -------------------------------------------------------------------------------------------- child side
def _child(argv: list[str] | None = None) -> int:
    """Runs inside vLLM's interpreter: only the standard library and vllm."""
    a = _child_args(argv)
    if a.hybrid:  # read by eagle3's plugin in every vLLM process (set before vLLM loads its plugins)
        os.environ["EAGLE3_HYBRID"] = a.hybrid
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    try:
        from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]
    except ImportError:  # older layouts
        TokensPrompt = dict  # noqa: N806

    import vllm  # type: ignore[import-not-found]

    prompts = json.loads(Path(a.prompts).read_text())
    images = json.loads(Path(a.images).read_text()) if a.images else None
    repair, sampling_ok = _repair_cpu_expand(not a.keep_vllm_sampler) if a.temperature > 0 else (None, True)
    mm = {"limit_mm_per_prompt": {"image": max(len(x) for x in images)}} if images else {}
    llm = LLM(model=a.target, dtype=a.dtype, seed=a.seed, enforce_eager=True, disable_log_stats=False,
              max_model_len=max(len(x) for x in prompts) + a.max_tokens + a.num_spec + 8,
              speculative_config=_speculative_config(a), **mm, **_mla_backend(a.mla, a.dtype))
    stop = [int(t) for t in a.stop_token_ids.split(",") if t.strip()]
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.seed,
                            stop_token_ids=stop or None)
    if images:
        requests = _image_requests(TokensPrompt, prompts, images, a.image_token_id)
    else:
        requests = [TokensPrompt(prompt_token_ids=x) for x in prompts]
    groups = json.loads(Path(a.groups).read_text()) if a.groups else [""] * len(prompts)
    t0 = time.perf_counter()
    outs, snapshots = _generate_by_group(llm, requests, params, groups)
    seconds = time.perf_counter() - t0
    records = snapshots[-1]["metrics"] if snapshots else _metrics(llm)
    Path(a.out).write_text(json.dumps({
        "metrics": records, "seconds": seconds, "vllm_version": getattr(vllm, "__version__", None),
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "prompt_tokens": [len(ids) if (ids := getattr(o, "prompt_token_ids", None)) is not None else None
                          for o in outs],
        "platform": _platform(),
        "sampling_repair": repair,
        "sampling_ok": sampling_ok,
        "group_metrics": snapshots if a.groups else None,
        **({"image_prompts": sum(1 for x in images if x), "with_images": [bool(x) for x in images],
            "prompt_ids_same": [getattr(o, "prompt_token_ids", None) is not None and list(o.prompt_token_ids) == x
                                for o, x in zip(outs, prompts, strict=True)]} if images else {}),
    }))
    return 0


def image_token(run: EngineRun) -> int:
    """The target's image placeholder id, as its processor names it (eagle3.data.images.VisionInputs)."""
    from eagle3.data.images import VisionInputs

    return VisionInputs.required(run.target).image_token_id


def collapse_image_tokens(ids: list[int], image_token: int) -> list[int]:
    """Each run of `image_token` as one: the ids before the HF processor expanded the images, which vLLM expands
    itself (it would re-expand the first token of an expanded run and keep the rest as text)."""
    return [t for i, t in enumerate(ids) if t != image_token or i == 0 or ids[i - 1] != image_token]


def _image_requests(tokens_prompt: Any, prompts: list[list[int]], images: list[list[str]], image_token: int
                    ) -> list[Any]:
    """The prompts as vLLM requests: a prompt with images gets its image token runs collapsed (collapse_image_tokens)
    and its pictures (RGB, PIL) as multi_modal_data, one run per picture in order."""
    from PIL import Image

    if len(images) != len(prompts):
        raise SystemExit(f"{len(images)} image lists for {len(prompts)} prompts")
    out = []
    for i, (ids, files) in enumerate(zip(prompts, images, strict=True)):
        if not files:
            out.append(tokens_prompt(prompt_token_ids=ids))
            continue
        short = collapse_image_tokens(ids, image_token)
        runs = short.count(image_token)
        if runs != len(files):
            raise SystemExit(f"prompt {i}: {runs} runs of image token {image_token} for {len(files)} images")
        pictures = []
        for f in files:
            with Image.open(f) as im:
                pictures.append(im.convert("RGB"))
        out.append(tokens_prompt(prompt_token_ids=short, multi_modal_data={"image": pictures}))
    return out


def _child_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="vLLM EAGLE-3 acceptance check (started by eagle3)")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", help="the exported head (method eagle3)")
    p.add_argument("--method", default="eagle3", choices=["eagle3", "ngram", "suffix", "plain"])
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-spec", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--draft-sample-method", default="greedy", choices=["greedy", "probabilistic"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-token-ids", default="", help="comma-separated ids to stop at (the evaluator's eos set)")
    p.add_argument("--groups", help="JSON list: a group name per prompt; each group runs in turn, metrics after each")
    p.add_argument("--images", help="JSON list: per prompt, the image files its image tokens stand for ([] for none)")
    p.add_argument("--image-token-id", type=int, help="the target's image placeholder id (with --images)")
    p.add_argument("--mla", action="store_true", help="the target uses multi-head latent attention")
    p.add_argument("--hybrid", help="EAGLE3_HYBRID for eagle3's hybrid drafter plugin (eagle3.engines.vllm_hybrid): `auto`, the rule exported beside the head, or a rule")
    p.add_argument("--keep-vllm-sampler", action="store_true",
                   help="do not repair the CPU backend's sampled verification (to see what _repair_cpu_expand fixes)")
    return p.parse_args(argv)


def _metrics(llm: Any) -> list[dict[str, Any]]:
    """vLLM's counters and histograms so far, as plain records."""
    records = []
    for m in llm.get_metrics():
        if hasattr(m, "values"):
            records.append({"name": m.name, "values": list(m.values)})
        elif hasattr(m, "value"):
            records.append({"name": m.name, "value": m.value})
    return records


def _generate_by_group(llm: Any, requests: list[Any], params: Any, groups: list[str]
                       ) -> tuple[list[Any], list[dict[str, Any]]]:
    """(outputs in prompt order, the counters after each group): the groups run in turn, in order of first
    appearance, so each one's acceptance is the difference of two snapshots."""
    outs: list[Any] = [None] * len(requests)
    snapshots = []
    for g in dict.fromkeys(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        for i, o in zip(idx, llm.generate([requests[i] for i in idx], params), strict=True):
            outs[i] = o
        snapshots.append({"group": g, "metrics": _metrics(llm),
                          "generated": sum(len(outs[i].outputs[0].token_ids) for i in idx)})
    return outs, snapshots


def _mla_backend(mla: bool, dtype: str) -> dict[str, Any]:
    """vLLM's CPU platform serves MLA attention with its AMX kernels wherever the CPU has AMX tiles (Intel Xeon since
    Sapphire Rapids), and those refuse float32 weights ("expect weight to be bfloat16, ..."): a float32 MLA model
    (the target: `--mla`, from eagle3.targets.info; an MLA head: the speculative config's own setting) gets vLLM's
    reference CPU MLA backend instead, which the CPUs without AMX run anyway."""
    return {"attention_backend": "CPU_MLA"} if mla and dtype == "float32" else {}


def _speculative_config(a: argparse.Namespace) -> dict[str, Any] | None:
    if a.method == "plain":
        return None
    if a.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": a.num_spec, "prompt_lookup_min": a.prompt_lookup_min,
                "prompt_lookup_max": a.prompt_lookup_max}
    if a.method == "suffix":  # suffix decoding (needs arctic-inference's suffix tree): its defaults otherwise
        return {"method": "suffix", "num_speculative_tokens": a.num_spec}
    if not a.draft:
        raise SystemExit("--draft is required with --method eagle3")
    return {"method": "eagle3", "model": a.draft, "num_speculative_tokens": a.num_spec,
            "draft_sample_method": a.draft_sample_method,
            **_mla_backend(bool(json.loads((Path(a.draft) / "config.json").read_text()).get("kv_lora_rank")), a.dtype),
            **({"disable_padded_drafter_batch": True} if a.hybrid else {})}


def _expand_ok() -> bool:
    """Whether vLLM's rejection sampler expands a per-request value to its draft positions correctly (the
    temperature it divides the target's logits by there), probed with the kernels a worker of this platform runs."""
    import torch
    from vllm.v1.sample import rejection_sampler  # type: ignore[import-not-found]

    got = rejection_sampler.expand_batch_to_tokens(torch.tensor([0.3125, 0.0]), torch.tensor([1, 3]), 3,
                                                   replace_from=0, replace_to=1)
    return got.tolist() == [0.3125, 1.0, 1.0]


def _repair_cpu_expand(repair: bool = True) -> tuple[str | None, bool]:
    """(what was repaired or None, whether sampled verification is right now) for temperature > 0.

    vLLM 0.32's CPU backend (no Triton) registers C++ stand-ins for the rejection sampler's Triton kernels; the
    one for `expand_kernel` converts its float output to an int64 copy, writes that, and drops it, so
    `expand_batch_to_tokens` returns uninitialised memory and the target's logits at the draft positions are
    divided by garbage instead of the temperature (greedy and the bonus token do not go through it). Where the
    probe shows that, the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with a torch version of
    `expand_batch_to_tokens`: the same semantics as the Triton kernel, which a GPU runs."""
    import torch
    from vllm.platforms import current_platform  # type: ignore[import-not-found]
    from vllm.v1.sample import rejection_sampler  # type: ignore[import-not-found]

    if not current_platform.is_cpu():  # GPUs run the Triton kernel
        return None, True
    current_platform.register_triton_kernel_overrides()  # what a worker does first (worker_base.py)
    if _expand_ok() or not repair:
        return None, _expand_ok()

    def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                               replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return x.repeat_interleave(counts.long(), output_size=num_tokens)

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the patch must live where the sampler runs
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return ("its CPU expand_kernel stand-in returns garbage (the target's logits at draft positions were divided "
            "by uninitialised memory at temperature > 0): replaced by a torch expand_batch_to_tokens, engine in "
            "one process"), _expand_ok()


def _platform() -> str:
    """`cpu` on vLLM's CPU backend, else its device type."""
    try:
        from vllm.platforms import current_platform  # type: ignore[import-not-found]
    except ImportError:  # a layout without it
        return "unknown"
    return "cpu" if current_platform.is_cpu() else str(getattr(current_platform, "device_type", "other"))


if __name__ == "__main__":
    sys.exit(_child())
