"""Measure the head's acceptance inside SGLang (EAGLE-3 speculative decoding), on the prompts the built-in
evaluator used.

    eagle3 eval --config configs/kimi-k2.5.yaml --engine sglang                  # eagle3 starts the server
    eagle3 eval --config X --engine sglang target.sglang.url=http://127.0.0.1:30000   # ... or uses yours

With no `target.sglang.url`, the head is exported for SGLang (unless it already is an SGLang export) and an
SGLang server is started with it: `--speculative-algorithm EAGLE3 --speculative-draft-model-path <export>
--speculative-num-steps {eval.num_steps} --speculative-eagle-topk {eval.topk}
--speculative-num-draft-tokens {eval.num_draft_tokens}`, the target at `target.sglang.tp_size`, plus
`target.sglang.launch_args`; it is stopped when the prompts are done. A server you started must serve the same
draft with the same settings.

Each prompt goes to `/generate` as token ids. SGLang's `meta_info` carries `completion_tokens` and
`spec_verify_ct` (verify steps); its own `spec_accept_length` is completion_tokens / spec_verify_ct, which counts
the token of the prefill as if a verify step had made it. `tau` here excludes it ((completion_tokens - 1) /
spec_verify_ct, pooled over all prompts), which is exactly what the built-in evaluator and vLLM call τ
(accepted + bonus per verify step); SGLang's own figure is reported beside it. At temperature > 0 a server on a
CPU commits its argmax anyway, so its τ is marked UNTRUSTED there (`sampling_caveat`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3.engines import EngineRun

log = logging.getLogger("eagle3")


def parse_sglang_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-request `meta_info` dicts -> pooled τ (prefill token excluded, as the built-in counts it), SGLang's
    own pooled accept length (Σ completion_tokens / Σ spec_verify_ct) and the mean per-request figure."""
    completion = verify = 0
    per_request: list[float] = []
    for i, m in enumerate(metas):
        # SGLang writes spec_verify_ct only when it is above zero (tokenizer_manager.py): a turn whose prefill token
        # ended it has none, and took no verify step. Any longer turn made its tokens in verify steps.
        if "completion_tokens" not in m or ("spec_verify_ct" not in m and int(m["completion_tokens"]) > 1):
            raise ValueError(f"request {i}: meta_info has no spec_verify_ct/completion_tokens: was the server "
                             "started with --speculative-algorithm EAGLE3?")
        c, v = int(m["completion_tokens"]), int(m.get("spec_verify_ct", 0))
        completion += c
        verify += v
        if m.get("spec_accept_length") is not None:
            per_request.append(float(m["spec_accept_length"]))
        elif v > 0:
            per_request.append(c / v)
    # No verify step at all is legitimate only where every turn ended at its prefill token (a server without
    # speculative decoding fails the per-request check above first): τ is then undefined, not an error, so a
    # dialogue's running figure after such a first turn does not abort the run.
    decoded = sum(max(int(m["completion_tokens"]) - 1, 0) for m in metas if int(m.get("spec_verify_ct", 0)) > 0)
    return {
        "tau": decoded / verify if verify else float("nan"),
        "sglang_accept_length": completion / verify if verify else float("nan"),
        "mean_request_accept_length": sum(per_request) / len(per_request) if per_request else float("nan"),
        "completion_tokens": completion,
        "verify_steps": verify,
        "requests": len(metas),
    }


def group_figures(metas: list[dict[str, Any]], groups: list[str], sets: list[str]) -> dict[str, dict[str, Any]]:
    """Per group of prompts (`set/category`, one per prompt) and per set (its groups pooled): SGLang's τ and tokens
    per target forward (completion tokens over the prefill plus the verify steps: what compares drafting methods,
    REFERENCE.md §3)."""
    def figures(ms: list[dict[str, Any]]) -> dict[str, Any]:
        f = parse_sglang_meta(ms)
        forwards = f["requests"] + f["verify_steps"]
        return f | {"tokens_per_forward": f["completion_tokens"] / forwards if forwards else float("nan")}

    out = {g: figures([m for m, h in zip(metas, groups, strict=True) if h == g]) for g in dict.fromkeys(groups)}
    for name in sets:
        out[name] = figures([m for m, h in zip(metas, groups, strict=True) if h == name or h.startswith(name + "/")])
    return out


CPU_GREEDY = (
    "not the sampled acceptance: SGLang's CPU platform verifies every draft greedily at any temperature "
    "(speculative/eagle_utils.py `_verify_uses_greedy` in SGLang 0.5.23: its sampling kernel is CUDA-only), so this "
    "is greedy decoding's τ. The built-in evaluator's τ, or SGLang on a GPU, is the one to use")
"""Why SGLang's τ at temperature > 0 is flagged when the server runs on a CPU."""


def sampling_caveat(url: str, run: EngineRun) -> str | None:
    """Why the server's τ at the eval's temperature is not the sampled one, or None. Read from the server's own
    `device` (its /server_info), so a server the user started is judged as it runs, not as the config says."""
    from eagle3.targets.sglang_server import server_info

    temperature = run.eval.temperature
    if temperature <= 0:
        return None
    info = server_info(url, timeout=run.target.sglang.timeout_s)
    if info is None:
        log.warning("SGLang at %s: no /server_info, so whether it samples at temperature %s is not checked",
                    url, temperature)
        return None
    if str(info.get("device", "")).lower() == "cpu":
        log.warning("SGLang's acceptance at temperature %s: %s", temperature, CPU_GREEDY)
        return CPU_GREEDY
    return None


def turn_steps(meta: dict[str, Any]) -> dict[str, Any]:
    """One turn's verify steps and τ (None when its prefill token ended it), counted as parse_sglang_meta pools
    them: the per-category figures add back up to the set's."""
    steps = int(meta.get("spec_verify_ct", 0))
    return {"verify_steps": steps, "tau": (int(meta["completion_tokens"]) - 1) / steps if steps else None}


def eagle3_flags(run: EngineRun, target_path: str, draft: Path) -> list[str]:
    """`sglang.launch_server` flags that serve the target with the head as its EAGLE-3 draft."""
    from eagle3.targets.sglang import target_flags

    e = run.eval
    return target_flags(run.target, target_path, [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
        "--speculative-num-steps", str(e.num_steps), "--speculative-eagle-topk", str(e.topk),
        "--speculative-num-draft-tokens", str(e.num_draft_tokens), "--skip-server-warmup"])


def sglang_draft(run: EngineRun, folder: Path, hybrid: dict[str, Any] | None = None) -> Path:
    """The head as SGLang loads it: `folder` itself when it is an SGLang export (and no `hybrid` rule is to go beside
    it), else a fresh export of it (with the rule: eagle3.engines.sglang_hybrid reads it there)."""
    from eagle3.export import export

    conf = folder / "config.json"
    if hybrid is None and conf.is_file() and \
            (json.loads(conf.read_text()).get("eagle3_export") or {}).get("engine") == "sglang":
        return folder
    return export(folder, run.paths.export_dir / "sglang", to="sglang", dtype=run.target.dtype,
                  num_speculative_tokens=run.eval.num_steps, target_family=run.target.layer_id_family, hybrid=hybrid)


def generate(url: str, ids: list[int], run: EngineRun, stop: list[int], images: list[str] | None = None,
             image_token: int | None = None) -> dict[str, Any]:
    """One greedy (or seeded sampled) `/generate` for token ids, stopping where the built-in evaluator stops. A
    prompt with `images` (its ids hold each image's `image_token` run as the HF processor expanded it) is sent as
    the target's serving path takes it: each run collapsed to one placeholder, which SGLang expands again from the
    picture it gets as a `data:` URL (its `prompt_tokens` then equal the built-in's: prompt_agreement)."""
    from eagle3.data.images import data_url
    from eagle3.engines.vllm_eval import collapse_image_tokens
    from eagle3.targets.sglang_server import http_json

    e = run.eval
    params: dict[str, Any] = {"temperature": e.temperature, "max_new_tokens": e.max_new_tokens, "stop_token_ids": stop}
    if e.temperature > 0:
        params["sampling_seed"] = e.seed
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": params}
    if images:
        assert image_token is not None
        body |= {"input_ids": collapse_image_tokens(ids, image_token), "image_data": [data_url(r) for r in images]}
    return http_json("POST", url.rstrip("/") + "/generate", body, timeout=run.target.sglang.timeout_s)


@contextmanager
def serving(run: EngineRun, draft_folder: Path | None, hybrid: dict[str, Any] | None = None
            ) -> Iterator[tuple[str, Path | None]]:
    """(url, served draft): the server at `target.sglang.url`, or one started here with the head and stopped after;
    `hybrid`: eagle3's hybrid drafter rule, exported beside the head and switched on (EAGLE3_HYBRID=auto)."""
    from eagle3.bundled import resolve_target_path
    from eagle3.engines.hybrid_rule import ENV
    from eagle3.process import this_process
    from eagle3.targets.sglang import server_address
    from eagle3.targets.sglang_dump import ENV_DUMP_DIR
    from eagle3.targets.sglang_server import SGLangServer

    url, _ = server_address(run.target.sglang, this_process().local_rank)
    if url:
        if hybrid is not None:
            raise ValueError("the hybrid drafter is switched on where eagle3 starts the server: start yours with "
                             f"{ENV}=auto and the head exported with `eagle3 export --to sglang --hybrid RULE`")
        yield url, None
        return
    if draft_folder is None:
        raise ValueError("--engine sglang without target.sglang.url needs the head to serve (eval.checkpoint)")
    draft = sglang_draft(run, draft_folder, hybrid)
    os.environ.pop(ENV_DUMP_DIR, None)  # a capture plugin switched on would dump every prefill of the eval
    log_file = run.paths.logs_dir / f"sglang-eagle3{'-hybrid' if hybrid else ''}-{os.getpid()}.log"
    env = {ENV: "auto"} if hybrid is not None else {}
    with SGLangServer(eagle3_flags(run, resolve_target_path(run.target.path), draft), env, log_file,
                      run.target.sglang.startup_timeout_s, what="SGLang with the EAGLE-3 head"
                      + (" (hybrid drafter)" if hybrid else "")) as server:
        yield server.url, draft


def run_sglang(run: EngineRun, prompts: list[list[int]], draft_folder: Path | None = None,
               hybrid: dict[str, Any] | None = None, groups: list[str] | None = None,
               sets: list[str] | None = None, images: list[list[str]] | None = None) -> dict[str, Any]:
    """SGLang's τ on `prompts` (the token ids the built-in evaluator decoded), in order, one at a time; `hybrid`:
    with eagle3's hybrid drafter (eagle3.engines.sglang_hybrid) and that rule; `groups` (one `set/category` per
    prompt) and `sets`: the figures per group and per set too (`groups`, group_figures); `images`: each prompt's
    pictures ([] for a text prompt), sent with it (`generate`)."""
    from eagle3.engines import prompt_agreement
    from eagle3.engines.vllm_eval import image_token, stop_token_ids
    from eagle3.logs import Progress

    stop = stop_token_ids(run.target)
    images = images if images is not None and any(images) else None
    token = image_token(run) if images is not None else None
    outs = []
    with serving(run, draft_folder, hybrid) as (url, draft), \
            Progress(len(prompts), "sglang", unit="prompt") as progress:
        for i, ids in enumerate(prompts):
            outs.append(generate(url, ids, run, stop, images[i] if images is not None else None, token))
            progress.update(1)
        caveat = sampling_caveat(url, run)
    metas = [o.get("meta_info", {}) for o in outs]
    result = parse_sglang_meta(metas)
    if groups is not None:
        result["groups"] = group_figures(metas, groups, sets or [])
    result.update(url=url, draft=str(draft) if draft else None, stop_token_ids=stop,
                  outputs=[o.get("output_ids") for o in outs],
                  verify_steps_per_prompt=[int(m.get("spec_verify_ct", 0)) for m in metas])
    if hybrid is not None:
        result["hybrid"] = hybrid
    result.update(prompt_agreement("SGLang", [len(p) for p in prompts], [m.get("prompt_tokens") for m in metas]))
    if images is not None:
        result["image_prompts"] = sum(1 for x in images if x)
    if caveat:
        result["untrusted"] = caveat
    return result


def run_sglang_dialogues(run: EngineRun, sets: list[Any], render: Any, draft_folder: Path
                         ) -> tuple[dict[str, Any], dict[str, list]]:
    """Engine only (`eval.builtin: false`): every turn of every prompt decoded by SGLang, a later turn rendered
    after SGLang's own answers (the built-in evaluator is not run: the target is too big for this process), a
    turn's pictures (`render.vision`: its history's) sent with it.
    Returns (τ per prompt set and pooled, rendered prompts per set)."""
    from eagle3.data.types import Turn
    from eagle3.engines.vllm_eval import stop_token_ids
    from eagle3.logs import Progress
    from eagle3.report import by_category

    stop = stop_token_ids(run.target)
    token = render.vision.image_token_id if render.vision is not None else None
    results: dict[str, Any] = {}
    rendered: dict[str, list] = {}
    metas: list[dict[str, Any]] = []
    groups: list[str] = []
    outputs: list[list[int] | None] = []
    total = sum(ps.num_turns for ps in sets)
    with serving(run, draft_folder) as (url, draft), Progress(total, "sglang", unit="turn") as progress:
        for ps in sets:
            set_metas, rendered[ps.name], per_turn = [], [], []
            for prompt in ps.prompts:
                hist: list[Turn] = list(prompt.messages or [])
                for text in prompt.to_generate():
                    ids = render.turn(prompt, hist, text)
                    images = [i for t in hist for i in t.images] if prompt.token_ids is None else []
                    out = generate(url, ids, run, stop, images, token)
                    set_metas.append(out.get("meta_info", {}))
                    groups.append(f"{ps.name}/{prompt.category or ''}")
                    outputs.append(out.get("output_ids"))
                    per_turn.append({"category": prompt.category, **turn_steps(set_metas[-1])})
                    rendered[ps.name].append(ids)
                    if text is not None:
                        hist.append(Turn("assistant", render.answer(out.get("output_ids") or [], set(stop))))
                    progress.update(1, tau=f"{parse_sglang_meta(set_metas)['tau']:.2f}")
            results[ps.name] = {**parse_sglang_meta(set_metas), "turns": len(set_metas), "prompts": len(ps.prompts)}
            if categories := by_category(per_turn):
                results[ps.name]["categories"] = categories
            metas += set_metas
        caveat = sampling_caveat(url, run)
    pooled = parse_sglang_meta(metas)
    pooled.update(url=url, draft=str(draft) if draft else None, stop_token_ids=stop, sets=results,
                  prompt_groups=groups, outputs=outputs, groups=group_figures(metas, groups, [ps.name for ps in sets]))
    if caveat:
        pooled["untrusted"] = caveat
    return pooled, rendered
