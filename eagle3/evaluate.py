"""`eagle3 eval`: acceptance length and speed under real speculative decoding.

    eagle3 eval --config configs/smollm2-135m.yaml eval.max_prompts=10 eval.max_new_tokens=64
    eagle3 eval --config configs/smollm2-135m.yaml --engine vllm      # also measure τ inside vLLM
    eagle3 eval --config configs/smollm2-135m.yaml --engine sglang    # ... or a running SGLang server

The built-in evaluator (eagle3.specdec) runs the HF target and the head with engine-style chain/tree drafting and
verification, on every prompt set of `eval.prompt_sets`, and runs plain decoding on the same prompts for the
speed baseline. It writes `<output_dir>/eval/report.json` and `report.png` and prints τ per set. At temperature 0
it also checks that every speculative answer equals plain greedy decoding token for token, and explains every
divergence (eagle3.divergence): a near-tie within the dtype's rounding is counted and logged; a clear margin is
an error that names the prompt, turn, position and gap, and makes `eagle3 eval` exit non-zero unless
`eval.allow_divergence` is set.

`--engine vllm|sglang` first runs the built-in evaluator, then sends the exact same rendered prompts to the
engine and reads its own acceptance counters, so the two τ are printed side by side.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch

from eagle3 import threads
from eagle3.checkpoints import resolve_checkpoint
from eagle3.config import Config, DataConfig, EvalConfig, EvalEngine, ImageInputs, TargetConfig
from eagle3.data.images import VisionInputs
from eagle3.data.vocab import OutOfVocab
from eagle3.engines import EngineRun
from eagle3.logs import Progress, UserError, setup_logging
from eagle3.prompts import Prompt, PromptSet, load_prompt_set
from eagle3.rope import context_window
from eagle3.specdec import AcceptanceStats, Generation, HFTargetDecoder, SpecSettings, SpeculativeDecoder
from eagle3.targets.hf import eos_ids, load_target
from eagle3.targets.info import TargetInfo

log = logging.getLogger("eagle3")


# ------------------------------------------------------------------------------------------------- loading
def draft_for_target(folder: Path, target: torch.nn.Module, aux_layer_ids: list[int] | None) -> Any:
    """The head (any format eagle3.formats reads), on the target's device and dtype, with the target's
    embeddings; ids checked against the target. A published head that names no ids gets the engines' default
    ids for this target (what SGLang and vLLM capture for it)."""
    from eagle3.formats import load_draft
    from eagle3.layer_ids import default_layer_ids, validate_layer_ids

    p = next(target.parameters())
    embed = target.get_input_embeddings().weight.detach()
    family = TargetInfo.of(target.config.to_dict()).family
    draft = load_draft(folder, embed_weight=embed, dtype=p.dtype, engine="sglang", family=family).to(p.device).eval()
    c, tc = draft.config, target.config.get_text_config()
    if not c.aux_layer_ids:
        c.aux_layer_ids = default_layer_ids(tc.num_hidden_layers)
        log.info("%s names no aux layer ids: using the engines' default for this target, %s", folder, c.aux_layer_ids)
    if c.vocab_size != tc.vocab_size or c.target_hidden_size != tc.hidden_size:
        raise ValueError(f"{folder}: the head was made for vocab {c.vocab_size} / hidden {c.target_hidden_size}, "
                         f"but the target has vocab {tc.vocab_size} / hidden {tc.hidden_size}")
    if not c.aux_layer_ids:
        raise ValueError(f"{folder}: the head does not record its aux layer ids")
    validate_layer_ids(c.aux_layer_ids, tc.num_hidden_layers, where=f"{folder} aux_layer_ids")
    if aux_layer_ids and list(aux_layer_ids) != list(c.aux_layer_ids):
        raise ValueError(f"target.aux_layer_ids={aux_layer_ids} but the head {folder} was trained on "
                         f"ids {c.aux_layer_ids} (eagle3 convention); evaluate it with its own ids")
    return draft


def vision_of(target: TargetConfig, with_images: list[PromptSet]) -> VisionInputs | None:
    """The target's processor when some prompt set has images (None when none has); a target that takes no images
    is an error naming the sets, never a run that measures them as text."""
    if not with_images:
        return None
    vision = VisionInputs.of(target)
    if vision is None:
        raise UserError(f"prompt set(s) {', '.join(ps.name for ps in with_images)} hold images, and target.path="
                        f"{target.path!r} takes none (no image processor): leave them out of eval.prompt_sets")
    return vision


def image_inputs_for(recorded: str | None, engine: str, folder: Path) -> ImageInputs:
    """What the head reads at image tokens in this evaluation: what it was trained with (its config records
    draft.image_inputs), else what the engine measured beside the built-in feeds (SGLang, the default engine of
    the exports, when only the built-in runs). A head trained for one engine is not measured as the other serves."""
    from eagle3.export import IMAGE_INPUTS_OF

    served = IMAGE_INPUTS_OF.get(engine)
    if recorded is not None and served is not None and recorded != served:
        raise UserError(f"{folder}: the head was trained with draft.image_inputs={recorded!r}, and {engine} feeds "
                        f"{served!r} at image tokens: evaluate it with the engine it was trained for")
    return recorded or served or IMAGE_INPUTS_OF["sglang"]  # type: ignore[return-value]


def settings_from(e: EvalConfig) -> SpecSettings:
    return SpecSettings(num_steps=e.num_steps, topk=e.topk, num_draft_tokens=e.num_draft_tokens,
                        temperature=e.temperature, draft_sampling=e.draft_sampling,
                        max_new_tokens=e.max_new_tokens)


# ------------------------------------------------------------------------------------------------ running
class PromptRenderer:
    """Turns (tools included) -> token ids with the target's chat template (eagle3.data.templates.render_prompt)."""

    def __init__(self, tokenizer: Any, data: DataConfig, vision: VisionInputs | None = None):
        self.tokenizer, self.data, self.vision = tokenizer, data, vision

    def __call__(self, history: list[Any], tools: list[dict[str, Any]] | None = None) -> list[int]:
        from eagle3.data.templates import render_prompt

        d = self.data
        return render_prompt(history, self.tokenizer, d.chat_template, d.thinking, d.system_prompt, tools,
                             self.vision)

    def check_tools(self, sets: list[PromptSet]) -> None:
        """Refuse prompt sets with tools under a template that would drop them (they would be measured on prompts
        the target never sees in service)."""
        from eagle3.data.templates import check_renders_tools, resolve_template

        prompts = [p for ps in sets for p in ps.prompts]
        tpl = resolve_template(self.data.chat_template, self.tokenizer)
        check_renders_tools(self.tokenizer, tpl, sum(p.has_tools for p in prompts), len(prompts), "prompts")

    def answer(self, tokens: list[int], eos: set[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)

    def turn(self, prompt: Prompt, history: list[Any], text: str | None) -> list[int]:
        """The ids of a prompt's next turn to generate: a token-id prompt's own; else the dialogue so far with the
        user's `text` appended to `history` (in place; None: the turn's messages are all there) rendered with the
        prompt's tools. Every evaluator renders a dialogue this way, so their turns are the same ids."""
        from eagle3.data.types import Turn

        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if text is not None:
            history.append(Turn("user", text))
        return self(history, prompt.tools)


CONTEXT_BUCKETS = ((2048, "<2K"), (8192, "2-8K"), (32768, "8-32K"), (None, ">32K"))
"""The card's context-length buckets: where a verify step drafts (its root's position)."""


def context_bucket(position: int) -> str:
    return next(name for edge, name in CONTEXT_BUCKETS if edge is None or position < edge)


@dataclass
class _Sums:
    """The head's, plain decoding's and n-gram drafting's counters over some turns (a set, or one category), and
    the plain output's tokens outside the head's draft vocab."""

    spec: AcceptanceStats = field(default_factory=AcceptanceStats)
    base: AcceptanceStats = field(default_factory=AcceptanceStats)
    ngram: AcceptanceStats | None = None
    oov: OutOfVocab | None = None

    def add(self, out: Generation, ref: Generation, ng: Generation | None, prompt: list[int],
            t2d: np.ndarray | None) -> None:
        self.spec.add(out.accept_lengths, len(out.tokens), out.target_forwards, out.seconds)
        self.base.add([], len(ref.tokens), ref.target_forwards, ref.seconds)
        if ng is not None:
            self.ngram = self.ngram or AcceptanceStats()
            self.ngram.add(ng.accept_lengths, len(ng.tokens), ng.target_forwards, ng.seconds)
        if t2d is not None:  # from the reference decode the evaluator runs anyway: no extra decoding
            self.oov = self.oov or OutOfVocab()
            self.oov.add(ref.tokens, prompt, t2d)

    def metrics(self, num_positions: int) -> dict[str, Any]:
        out = metrics(self.spec, self.base, num_positions)
        if self.ngram is not None:
            out["ngram"] = metrics(self.ngram, self.base, num_positions)
        if self.oov is not None:
            oov = self.oov.to_json()
            out.update(out_of_vocab=oov["out_of_vocab"], out_of_vocab_in_prompt=oov["out_of_vocab_in_prompt"])
        return out


def evaluate_set(dec: SpeculativeDecoder, ps: PromptSet, render: PromptRenderer, eos: set[int], seed: int,
                 progress: Progress, ngram: tuple[int, int] | None = None) -> tuple[dict[str, Any], list[list[int]]]:
    """Speculative, plain and (with `ngram` = (min_n, max_n)) prompt-lookup decoding of every turn of every prompt;
    returns the set's metrics and the rendered prompts (what an engine check replays)."""
    from eagle3.data.types import Turn

    t2d = getattr(dec.draft, "t2d", None)  # the head's draft vocab, for the share of the output it cannot propose
    tally = _SetTally(dec.s.num_steps, dec.s.temperature <= 0,
                      t2d.detach().bool().cpu().numpy() if isinstance(t2d, torch.Tensor) else None)
    window = context_window(dec.target.model.config.get_text_config().to_dict())
    rendered: list[list[int]] = []
    for i, prompt in enumerate(ps.prompts):
        hist_spec: list[Turn] = list(prompt.messages or [])
        hist_base: list[Turn] = list(prompt.messages or [])
        for t, text in enumerate(prompt.to_generate()):
            ids_spec, ids_base = render.turn(prompt, hist_spec, text), render.turn(prompt, hist_base, text)
            images = [i for turn in hist_base for i in turn.images]  # user turns': the same in both histories
            if window is not None and max(len(ids_spec), len(ids_base)) + dec.s.max_new_tokens > window:
                # past the window the target itself decodes from positions it never saw: not a turn to judge by
                tally.past_window += 1
                log.warning("%s %s turn %d: %d prompt tokens + %d new ones are past the target's context window (%d): "
                            "left out", ps.name, prompt.id, t + 1, len(ids_spec), dec.s.max_new_tokens, window)
                progress.update(len(prompt.to_generate()) - t)  # this turn and the ones that would follow it
                break
            threads.adjust()  # once per turn: its spec and plain decodes run on the same thread count
            seed_t = seed + 1000 * i + t
            out = dec.generate(ids_spec, torch.Generator().manual_seed(seed_t), images)
            ref = dec.generate_baseline(ids_base, torch.Generator().manual_seed(seed_t), images)
            ng = None if ngram is None else dec.generate_ngram(ids_base, torch.Generator().manual_seed(seed_t),
                                                               *ngram, images=images)
            tally.add(prompt, t, ids_spec, ids_base, out, ref, ng, images)
            tally.judge(dec, prompt.id, t, ids_spec, ids_base, out, ref, images)
            rendered.append(ids_spec)
            if text is not None:
                hist_spec.append(Turn("assistant", render.answer(out.tokens, eos)))
                hist_base.append(Turn("assistant", render.answer(ref.tokens, eos)))
            progress.update(1, tau=f"{tally.sums.spec.tau:.2f}")
    return tally.result(len(ps.prompts), ngram is not None), rendered


@dataclass
class _SetTally:
    """What one prompt set's turns add up to: the sums (the set's and each category's), the context buckets, the
    greedy divergences and the turns left out."""

    steps: int
    greedy: bool
    t2d: np.ndarray | None
    sums: _Sums = field(default_factory=lambda: _Sums())
    per_cat: dict[str, _Sums] = field(default_factory=dict)
    buckets: dict[str, list[AcceptanceStats]] = field(default_factory=dict)
    per_turn: list[dict[str, Any]] = field(default_factory=list)
    divergences: list[dict[str, Any]] = field(default_factory=list)
    inherited: int = 0
    ngram_mismatches: int = 0
    past_window: int = 0

    def add(self, prompt: Any, t: int, ids_spec: list[int], ids_base: list[int], out: Generation, ref: Generation,
            ng: Generation | None, images: list[str]) -> None:
        cat = [self.per_cat.setdefault(prompt.category, _Sums())] if prompt.category is not None else []
        for acc in [self.sums, *cat]:
            acc.add(out, ref, ng, ids_base, self.t2d)
        for who, gen in enumerate((out, ng)):
            for length, pos in zip(gen.accept_lengths if gen else [], gen.positions if gen else [], strict=True):
                self.buckets.setdefault(context_bucket(pos), [AcceptanceStats(), AcceptanceStats()])[who].add([length])
        self.ngram_mismatches += bool(ng is not None and self.greedy and ng.tokens != ref.tokens)
        self.per_turn.append({"id": prompt.id, "category": prompt.category, "turn": t + 1,
                              "prompt_tokens": len(ids_spec), "new_tokens": len(out.tokens),
                              "verify_steps": out.num_steps,
                              "tau": (sum(out.accept_lengths) / out.num_steps) if out.num_steps else None,
                              **({"images": images} if images else {})})

    def judge(self, dec: SpeculativeDecoder, prompt_id: str, t: int, ids_spec: list[int], ids_base: list[int],
              out: Generation, ref: Generation, images: list[str]) -> None:
        """A greedy speculative answer that parts from plain greedy decoding, explained (eagle3.divergence)."""
        from eagle3.divergence import explain

        if not self.greedy or out.tokens == ref.tokens:
            return
        if ids_spec != ids_base:
            # an earlier turn of this dialogue parted: its answers are in these two prompts, so this turn follows
            # from that divergence and is not judged again
            self.inherited += 1
            return
        num_layers = dec.target.model.config.get_text_config().num_hidden_layers
        d = explain(dec, prompt_id, t + 1, ids_base, out.tokens, ref.tokens, num_layers, images)
        (log.info if d.near_tie else log.error)("%s", d.line())
        self.divergences.append(d.to_json())

    def result(self, prompts: int, ngram: bool) -> dict[str, Any]:
        result = self.sums.metrics(self.steps)
        result.update(prompts=prompts, turns=len(self.per_turn), per_turn=self.per_turn)
        if self.past_window:
            result["turns_past_context_window"] = self.past_window
        result["context_buckets"] = {name: _bucket_row(self.buckets[name], self.steps) for _, name in CONTEXT_BUCKETS
                                     if name in self.buckets}
        if self.per_cat:  # each category as a set of its own: the card's rows (report.card)
            turns = Counter(t["category"] for t in self.per_turn)
            result["categories"] = {c: {"turns": turns[c], **acc.metrics(self.steps)}
                                    for c, acc in sorted(self.per_cat.items())}
        if self.greedy:
            near = sum(d["near_tie"] for d in self.divergences)
            result.update(greedy_mismatches=len(self.divergences) + self.inherited, near_ties=near,
                          clear_divergences=len(self.divergences) - near, divergences=self.divergences,
                          after_earlier_divergence=self.inherited)
            if ngram:
                result["ngram"]["greedy_mismatches"] = self.ngram_mismatches
        return result


def _bucket_row(stats: list[AcceptanceStats], num_positions: int) -> dict[str, Any]:
    head, ng = stats
    row: dict[str, Any] = {"verify_steps": head.steps, "tau": head.tau,
                           "acceptance_rate": head.acceptance_rate(num_positions)}
    if ng.steps:
        row["ngram"] = {"verify_steps": ng.steps, "tau": ng.tau, "acceptance_rate": ng.acceptance_rate(num_positions)}
    return row


def metrics(spec: AcceptanceStats, base: AcceptanceStats, num_positions: int) -> dict[str, Any]:
    tps_spec, tps_base = spec.tokens_per_second, base.tokens_per_second
    return {
        "tau": spec.tau,
        "acceptance_rate": spec.acceptance_rate(num_positions),
        "verify_steps": spec.steps,
        "accepted_tokens": spec.accepted_tokens,
        "generated_tokens": spec.generated,
        "baseline_generated_tokens": base.generated,
        "target_forwards": spec.target_forwards,
        "tokens_per_forward": spec.tokens_per_forward,
        "tokens_per_s": {"spec": tps_spec, "baseline": tps_base},
        "speedup": tps_spec / tps_base if tps_base else float("nan"),
        "seconds": {"spec": spec.seconds, "baseline": base.seconds},
    }


def run_builtin(run: EngineRun, data: DataConfig) -> tuple[dict[str, Any], dict[str, list[list[int]]], Path]:
    """The built-in evaluation; returns (report, rendered prompts per set, draft folder)."""
    folder = resolve_checkpoint(run.eval, run.paths)
    log.info("eval: target %s (%s, %s), draft %s", run.target.path, run.target.dtype, run.target.device, folder)
    sets = [load_prompt_set(n, run.paths.prepared_dir, run.eval.max_prompts) for n in run.eval.prompt_sets]
    vision = vision_of(run.target, [ps for ps in sets if ps.has_images])
    model, tokenizer = load_target(run.target, images=vision is not None)
    draft = draft_for_target(folder, model, run.target.aux_layer_ids)
    ids = list(draft.config.aux_layer_ids)
    target = HFTargetDecoder(model, ids, vision)
    settings = settings_from(run.eval)
    eos = set(eos_ids(tokenizer, model.generation_config))
    convention = image_inputs_for(draft.config.image_inputs, run.eval.engine, folder)
    dec = SpeculativeDecoder(target, draft, settings, eos, convention)
    render = PromptRenderer(tokenizer, data, vision)
    render.check_tools(sets)
    _warm_up(dec, render, sets[0].prompts[0])

    report: dict[str, Any] = {
        "engine": "builtin",
        "device": str(target.device),
        "target": {"path": run.target.path, "dtype": run.target.dtype,
                   "architectures": getattr(model.config, "architectures", None),
                   "num_layers": model.config.get_text_config().num_hidden_layers},
        "draft": str(folder),
        "aux_layer_ids": ids,
        **({"image_inputs": convention} if vision is not None else {}),
        "settings": {**asdict(settings), "seed": run.eval.seed, "max_prompts": run.eval.max_prompts},
        "definitions": {
            "tau": "mean over verify steps of (accepted draft tokens + 1 bonus token), as SGLang/vLLM report it",
            "acceptance_rate": "per draft position j: share of verify steps that accepted at least j tokens",
            "tokens_per_forward": "generated tokens per target forward (prefill included)",
            "ngram": "prompt-lookup drafting (vLLM's rule) on the same turns: its tau counts only the verify steps "
                     "that found a match, its tokens_per_forward every forward",
            "engine tokens_per_forward": "from the engine's counters, generated / (generated - accepted), which "
                                         "counts drafts a turn's last step accepted past max_new_tokens as "
                                         "generated (at most one step per turn above the built-in's count)",
            "context_buckets": "verify steps by the context length they draft at (the root's position)",
            "out_of_vocab": "share of plain decoding's generated tokens (end token included) that the head's draft "
                            "vocab (t2d) cannot propose; out_of_vocab_in_prompt: those that also occur in the turn's "
                            "prompt (copyable)",
        },
        "sets": {},
    }
    rendered: dict[str, list[list[int]]] = {}
    total = sum(ps.num_turns for ps in sets)
    with Progress(total, "eval", unit="turn") as progress:
        for ps in sets:
            ngram = (run.eval.ngram_min, run.eval.ngram_max) if run.eval.ngram else None
            result, rendered[ps.name] = evaluate_set(dec, ps, render, eos, run.eval.seed, progress, ngram)
            report["sets"][ps.name] = result
            log.info("eval %s: τ=%.3f over %d turns", ps.name, result["tau"], result["turns"])
    target.close()
    return report, rendered, folder


def _warm_up(dec: SpeculativeDecoder, render: PromptRenderer, warm: Any) -> None:
    """A few tokens decoded both ways first: first-call allocations would otherwise be billed to whichever method
    runs first."""
    warm_ids = render([_user("Hello")]) if warm.has_images else warm.token_ids if warm.token_ids is not None else render(
        list(warm.messages or []) + [_user(x) for x in warm.turns[:1]], warm.tools)
    full = dec.s.max_new_tokens
    dec.s.max_new_tokens = 4
    dec.generate(warm_ids[:64], torch.Generator().manual_seed(0))
    dec.generate_baseline(warm_ids[:64], torch.Generator().manual_seed(0))
    dec.s.max_new_tokens = full


def _user(text: str) -> Any:
    from eagle3.data.types import Turn

    return Turn("user", text)


def write_report(report: dict[str, Any], eval_dir: Path) -> None:
    from eagle3.report import card, plot, summary_lines, write_json

    report["card"] = card(report)
    write_json(report, eval_dir / "report.json")
    plot(report, eval_dir / "report.png")
    for line in summary_lines(report):
        print(line, flush=True)
    print(f"report: {eval_dir / 'report.json'} and {eval_dir / 'report.png'}", flush=True)


def run_engine_only(run: EngineRun, data: DataConfig) -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
    """`eval.builtin: false`: the engine decodes every turn with the head, no target is loaded in this process (a
    target too big for it, or a quick card: vLLM decodes all of MT-bench in minutes where the built-in takes an
    hour on a CPU)."""
    from eagle3.data.templates import load_tokenizer

    engine = run.eval.engine
    sets = [load_prompt_set(n, run.paths.prepared_dir, run.eval.max_prompts) for n in run.eval.prompt_sets]
    vision = vision_of(run.target, with_images := [ps for ps in sets if ps.has_images])
    if vision is not None and engine != "sglang":
        raise UserError(f"prompt set(s) {', '.join(ps.name for ps in with_images)} hold images: {engine} alone "
                        "(eval.builtin false) sends none; measure them with eval.builtin true, or in SGLang")
    folder = resolve_checkpoint(run.eval, run.paths)
    log.info("eval in %s only: target %s, draft %s", engine, run.target.path, folder)
    render = PromptRenderer(load_tokenizer(run.target), data, vision)
    render.check_tools(sets)
    result, rendered = ENGINE_ONLY[engine](run, sets, render, folder)
    report: dict[str, Any] = {
        "engine": engine,
        "builtin": False,
        "target": {"path": run.target.path, "dtype": run.target.dtype} | (
            {"tp_size": run.target.sglang.tp_size} if engine == "sglang" else {}),
        "draft": str(folder),
        "settings": {**asdict(settings_from(run.eval)), "seed": run.eval.seed, "max_prompts": run.eval.max_prompts},
        "definitions": {"tau": ENGINE_TAU[engine]},
        "sets": result.pop("sets"),
        "engines": {engine: result},
    }
    return report, rendered


def _sglang_dialogues(run: EngineRun, sets: list[PromptSet], render: PromptRenderer, folder: Path
                      ) -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
    from eagle3.engines.sglang_eval import run_sglang_dialogues

    result, rendered = run_sglang_dialogues(run, sets, render, folder)
    if run.eval.hybrid is not None:  # the hybrid on the turns the head's run rendered
        _sglang_hybrid(run, result, [p for ps in rendered.values() for p in ps], result["prompt_groups"],
                       list(rendered), folder)
    return result, rendered


def _sglang_hybrid(run: EngineRun, head: dict[str, Any], prompts: list[list[int]], groups: list[str],
                   sets: list[str], folder: Path, images: list[list[str]] | None = None) -> None:
    """eagle3's hybrid drafter in SGLang on the prompts the head decoded: its figures per group into `head`
    (`hybrid_groups`, the card's columns) and its run's summary (`hybrid`: with how many outputs equal the head's)."""
    from eagle3.engines.sglang_eval import run_sglang

    assert run.eval.hybrid is not None
    hy = run_sglang(run, prompts, folder, run.eval.hybrid.engine_rule(run.eval.ngram_max), groups, sets, images)
    head["hybrid_groups"] = hy.pop("groups")
    outs = hy.pop("outputs", None)
    head["hybrid"] = hy | {"same_outputs_as_head": sum(a == b for a, b in
                                                       zip(outs or [], head.get("outputs") or [], strict=False))}


def _vllm_dialogues(run: EngineRun, sets: list[PromptSet], render: PromptRenderer, folder: Path
                    ) -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
    from eagle3.engines.vllm_dialogues import run_vllm_dialogues

    return run_vllm_dialogues(run, sets, render, folder)


ENGINE_ONLY = {"sglang": _sglang_dialogues, "vllm": _vllm_dialogues}
"""eval.engine -> every turn decoded in that engine alone (`eval.builtin: false`)."""
ENGINE_TAU = {
    "sglang": "SGLang's (completion_tokens - 1) / spec_verify_ct: accepted + bonus tokens per verify step, the "
              "prefill's token excluded (sglang_accept_length includes it)",
    "vllm": "vLLM's 1 + num_accepted_tokens / num_drafts: accepted + bonus tokens per draft; tokens_per_forward = "
            "generated / (generated - accepted), every target forward counted",
}
"""What τ means in an engine-only report."""
if set(ENGINE_ONLY) != set(ENGINE_TAU) or {"builtin", *ENGINE_ONLY} != set(get_args(EvalEngine)):
    raise RuntimeError(f"eval.engine's choices {get_args(EvalEngine)} and the engine-only runners {tuple(ENGINE_ONLY)} "
                       "differ")


def run(cfg: Config) -> dict[str, Any]:
    """`eagle3 eval`: built-in speculative decoding, then (optionally) the same prompts inside an engine."""
    setup_logging()
    engine_run = EngineRun(cfg.target, cfg.eval, cfg.paths)
    if not cfg.eval.builtin:
        report, rendered = run_engine_only(engine_run, cfg.data)
        write_report(report, cfg.eval_dir)
        (cfg.eval_dir / "rendered_prompts.json").write_text(json.dumps(rendered))
        return report
    report, rendered, folder = run_builtin(engine_run, cfg.data)
    if cfg.eval.engine != "builtin":
        check = ENGINE_CHECKS[cfg.eval.engine]
        report["engines"] = {cfg.eval.engine: check(engine_run, report, rendered, folder)}
    write_report(report, cfg.eval_dir)
    (cfg.eval_dir / "rendered_prompts.json").write_text(json.dumps(rendered))
    refuse_clear_divergences(report, cfg.eval, cfg.eval_dir)
    return report


def vllm_check(run: EngineRun, report: dict[str, Any], rendered: dict[str, list[list[int]]], folder: Path
               ) -> dict[str, Any]:
    """The built-in's rendered prompts inside vLLM, one group per set and category so vLLM's τ fills the same card
    (prompts without a category form the group `set/`, so a set's row is always its groups pooled); with
    eval.ngram, vLLM's own n-gram drafting on the same prompts (the card's vLLM n-gram column); with eval.hybrid,
    eagle3's hybrid drafter in vLLM (its columns) and, for a rule on suffix decoding, vLLM's suffix decoding alone
    (the `vllm suffix` columns: the single methods beside the pairing)."""
    from eagle3.engines.vllm_dialogues import others_beside
    from eagle3.engines.vllm_eval import pooled_groups, run_vllm

    prompts = [p for ps in rendered.values() for p in ps]
    groups = _prompt_groups(report)
    result = run_vllm(run, folder, prompts, groups=groups, images=_prompt_images(report))
    found = result.setdefault("groups", {})
    found |= {name: pooled_groups(found, name) for name in report["sets"]}
    ng_groups = others_beside(run, folder, prompts, groups, list(report["sets"]), result)
    if run.eval.ngram:
        result["ngram_groups"] = ng_groups | {name: pooled_groups(ng_groups, name) for name in report["sets"]}
    return {**result, "builtin_tau": _pooled_tau(report), "prompt_groups": groups}


def _prompt_images(report: dict[str, Any]) -> list[list[str]]:
    """The pictures of each turn the built-in decoded, in its order ([] for a text turn)."""
    return [t.get("images", []) for r in report["sets"].values() for t in r["per_turn"]]


def _prompt_groups(report: dict[str, Any]) -> list[str]:
    """`set/category` of each turn the built-in decoded, in its order: the groups an engine's figures come in."""
    return [f"{name}/{t.get('category') or ''}" for name, r in report["sets"].items() for t in r["per_turn"]]


def sglang_check(run: EngineRun, report: dict[str, Any], rendered: dict[str, list[list[int]]], folder: Path
                 ) -> dict[str, Any]:
    """The built-in's rendered prompts through an SGLang server with the head, its figures per set and category
    (the card's SGLang columns); with eval.hybrid, then through a server with eagle3's hybrid drafter (its
    columns, and how many of its outputs equal the head's)."""
    from eagle3.engines.sglang_eval import run_sglang

    prompts = [p for ps in rendered.values() for p in ps]
    groups = _prompt_groups(report)
    sets = list(report["sets"])
    images = _prompt_images(report)
    result = run_sglang(run, prompts, folder, groups=groups, sets=sets, images=images)
    if run.eval.hybrid is not None:
        _sglang_hybrid(run, result, prompts, groups, sets, folder, images)
    # SGLang counts emitted tokens: the built-in's last step of a turn, cut at max_new_tokens or eos, must count
    # only what it emitted too
    return {**result, "builtin_tau": _emitted_tau(report)}


EngineCheck = Callable[[EngineRun, dict[str, Any], dict[str, list[list[int]]], Path], dict[str, Any]]
ENGINE_CHECKS: dict[str, EngineCheck] = {"vllm": vllm_check, "sglang": sglang_check}
"""eval.engine -> the same prompts inside that engine after the built-in run (`builtin` needs none)."""
if {"builtin", *ENGINE_CHECKS} != set(get_args(EvalEngine)):
    raise RuntimeError(f"eval.engine's choices {get_args(EvalEngine)} and the engine checks {tuple(ENGINE_CHECKS)} differ")


def refuse_clear_divergences(report: dict[str, Any], ev: EvalConfig, eval_dir: Path) -> None:
    """After the report is written: a divergence at a clear margin is a bug in the evaluator or the head's
    format, never rounding, so the run fails (eagle3.divergence) unless the user asked to continue."""

    clear = [d for r in report["sets"].values() for d in r.get("divergences", []) if not d["near_tie"]]
    if not clear or ev.allow_divergence:
        return
    first = clear[0]
    raise UserError(f"{len(clear)} turn(s) of speculative decoding part from plain greedy decoding at a clear "
                    f"margin (first: {first['prompt']} turn {first['turn']}, generated token {first['position']}, "
                    f"top-2 gap {first['gap']:.3g} > rounding bound {first['bound']:.3g}): not rounding, a bug in "
                    f"the evaluator or the head's format. Every one is in {eval_dir / 'report.json'} "
                    "(`divergences`); eval.allow_divergence=true keeps the exit status 0.")


def _emitted_tau(report: dict[str, Any]) -> float:
    """Tokens emitted after each turn's first (the prefill's) per verify step, pooled over every set."""
    steps = sum(r["verify_steps"] for r in report["sets"].values())
    emitted = sum(t["new_tokens"] - 1 for r in report["sets"].values() for t in r["per_turn"] if t["verify_steps"])
    return emitted / steps if steps else float("nan")


def _pooled_tau(report: dict[str, Any]) -> float:
    steps = sum(r["verify_steps"] for r in report["sets"].values())
    acc = sum(r["accepted_tokens"] for r in report["sets"].values())
    return (acc + steps) / steps if steps else float("nan")
