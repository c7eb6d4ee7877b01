"""vLLM beside the head on the same prompts: engine-only dialogues (`eval.builtin: false`), vLLM's n-gram drafting and
eagle3's hybrid drafter (eagle3.engines.vllm_hybrid), each one more run of eagle3.engines.vllm_eval.run_vllm."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from eagle3.engines import EngineRun
from eagle3.engines.hybrid_rule import uses_suffix
from eagle3.engines.vllm_eval import pooled_groups, run_vllm, stop_token_ids

log = logging.getLogger("eagle3")


def run_vllm_dialogues(run: EngineRun, sets: list[Any], render: Any, draft_folder: Path
                       ) -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
    """Engine only (`eval.builtin: false`): every turn of every prompt set in vLLM, with the head and (eval.ngram)
    with vLLM's n-gram drafting, no target in this process. A later turn is rendered after vLLM's plain greedy
    answer to the earlier one (decoded round by round: one vLLM run per turn index), so the head, n-gram drafting
    and the caller's other methods all replay the same rendered prompts. Returns (report sets: τ, acceptance and
    tokens per target forward per set and category, n-gram's beside them; vLLM's results; rendered prompts per
    set), the engine's results holding `prompt_groups` (a `set/category` per rendered prompt, in order)."""
    from eagle3.data.types import Turn
    from eagle3.targets.info import target_context_window

    stop = stop_token_ids(run.target)
    window = target_context_window(run.target.path)
    # (set, prompt) -> history so far; rendered prompts by (set, prompt, turn), answered round by round
    hist = {(s, i): list(p.messages or []) for s, ps in enumerate(sets) for i, p in enumerate(ps.prompts)}
    ids: dict[tuple[int, int, int], list[int]] = {}
    past: set[tuple[int, int]] = set()  # dialogues whose turn no longer fits the target's window: left out from there
    left_out: Counter[str] = Counter()  # per set, the turns left out so
    rounds = max((len(p.to_generate()) for ps in sets for p in ps.prompts), default=0)
    for r in range(rounds):
        todo = [(s, i, p) for s, ps in enumerate(sets) for i, p in enumerate(ps.prompts)
                if r < len(p.to_generate()) and (s, i) not in past]
        for s, i, p in list(todo):
            turn = render.turn(p, hist[s, i], p.to_generate()[r])
            if window is not None and len(turn) + run.eval.max_new_tokens > window[0]:
                # as the built-in evaluator: past the window the target decodes from positions it never saw
                log.warning("%s %s turn %d: %d prompt tokens + %d new ones are past the target's context window "
                            "(%d, %s): left out", sets[s].name, p.id, r + 1, len(turn), run.eval.max_new_tokens,
                            *window)
                past.add((s, i))
                left_out[sets[s].name] += len(p.to_generate()) - r
                todo.remove((s, i, p))
                continue
            ids[s, i, r] = turn
        answer = [(s, i, p) for s, i, p in todo if r + 1 < len(p.to_generate())]
        if answer:
            log.info("vLLM: round %d of %d, plain greedy answers to %d turn(s) to render the next", r + 1, rounds,
                     len(answer))
            outs = run_vllm(run, None, [ids[s, i, r] for s, i, _ in answer], method="plain")["outputs"]
            for (s, i, _), out in zip(answer, outs, strict=True):
                hist[s, i].append(Turn("assistant", render.answer(out, set(stop))))
    order = sorted(ids)  # by set, prompt, turn: the card's order
    prompts = [ids[k] for k in order]
    groups = [f"{sets[s].name}/{sets[s].prompts[i].category or ''}" for s, i, _ in order]
    rendered = {ps.name: [ids[k] for k in order if k[0] == s] for s, ps in enumerate(sets)}
    result = run_vllm(run, draft_folder, prompts, groups=groups, check_greedy=False)
    head = result.pop("groups", {})
    ngram = others_beside(run, draft_folder, prompts, groups, [ps.name for ps in sets], result)
    report_sets: dict[str, Any] = {}
    for ps in sets:
        turns = Counter(g for g in groups if g.startswith(ps.name + "/"))
        row = _with_ngram(pooled_groups(head, ps.name), ngram and pooled_groups(ngram, ps.name))
        cats = {g.split("/", 1)[1]: _with_ngram(head[g], ngram.get(g)) | {"turns": n}
                for g, n in turns.items() if g.split("/", 1)[1]}
        report_sets[ps.name] = row | {"turns": sum(turns.values()), "prompts": len(ps.prompts)} | (
            {"categories": dict(sorted(cats.items()))} if cats else {})
        if left_out[ps.name]:
            report_sets[ps.name]["turns_past_context_window"] = left_out[ps.name]
    result.update(prompt_groups=groups, stop_token_ids=stop)
    return {"sets": report_sets, **result}, rendered


def others_beside(run: EngineRun, draft_folder: Path, prompts: list[list[int]], groups: list[str],
                  sets: list[str], result: dict[str, Any]) -> dict[str, Any]:
    """The other methods on the prompts the head decoded, into `result` (their run's summary; the hybrid's and
    suffix decoding's figures per group and per set as `<method>_groups`): n-gram drafting (eval.ngram), eagle3's
    hybrid (eval.hybrid) and, for a suffix rule, suffix decoding alone. -> n-gram's figures per group ({} if not
    run), which the callers place themselves (beside the head's rows when vLLM ran alone)."""
    ngram: dict[str, Any] = {}
    if run.eval.ngram:
        ngram, result["ngram"] = beside(run, prompts, groups, result, "ngram")
    if run.eval.hybrid is not None:
        rule = run.eval.hybrid.engine_rule(run.eval.ngram_max)
        hybrid, result["hybrid"] = beside(run, prompts, groups, result, "eagle3", draft_folder, rule)
        result["hybrid_groups"] = hybrid | {name: pooled_groups(hybrid, name) for name in sets}
        if uses_suffix(rule):
            suffix, result["suffix"] = beside(run, prompts, groups, result, "suffix")
            result["suffix_groups"] = suffix | {name: pooled_groups(suffix, name) for name in sets}
    return ngram


def beside(run: EngineRun, prompts: list[list[int]], groups: list[str], head: dict[str, Any], method: str,
           draft_folder: Path | None = None, hybrid: dict[str, Any] | None = None
           ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Another vLLM run on the prompts the head decoded (vLLM's n-gram drafting or suffix decoding, or the head with
    eagle3's `hybrid` rule): (its figures per group, its run's result with how many of its outputs equal the head's:
    all greedy, so all of them unless a bf16 near-tie flips one)."""
    other = run_vllm(run, draft_folder, prompts, groups=groups, method=method, check_greedy=False, hybrid=hybrid)
    found = other.pop("groups", {})
    if (outs := other.pop("outputs", None)) is not None and head.get("outputs") is not None:
        other["same_outputs_as_head"] = sum(a == b for a, b in zip(outs, head["outputs"], strict=True))
    return found, other


def _with_ngram(head: dict[str, Any], ngram: dict[str, Any] | None) -> dict[str, Any]:
    """A card row's figures: the head's, and n-gram drafting's τ and tokens per forward where it ran."""
    return head | ({"ngram": {"tau": ngram["tau"], "tokens_per_forward": ngram.get("tokens_per_forward")}}
                   if ngram else {})
