"""Where the card's two n-gram columns part: the built-in prompt lookup and vLLM's, on the same rendered prompts.

    EAGLE3_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/bench_ngram_engines.py \
        --config configs/smollm2-135m-quickstart.yaml --set mt-bench --prompts 20 [--both-turns]

Both use vLLM's rule (tests/test_vllm_ngram.py checks eagle3.specdec.ngram_proposal against vLLM's own proposer), so
a gap between them has two other sources, measured here apart: the greedy text (each engine decodes plain and with
n-gram; in bf16 the two engines part at near-ties) and the counting (vLLM's counters give generated / (generated -
accepted); the built-in counts its target forwards). Each text is also replayed through the rule offline, which
gives the figure that text alone earns. No head is needed: the prompts are rendered here (`--both-turns`: each
second turn after the built-in's plain first answer, the same prompt for both engines).
"""

from __future__ import annotations

import argparse

import torch

from eagle3.config import load_config
from eagle3.data.types import Turn
from eagle3.engines import EngineRun
from eagle3.engines.vllm_eval import run_vllm
from eagle3.evaluate import PromptRenderer, settings_from
from eagle3.prompts import load_prompt_set
from eagle3.specdec import HFTargetDecoder, SpeculativeDecoder, ngram_proposal
from eagle3.targets.hf import eos_ids, load_target


def replay(prompt: list[int], out: list[int], k: int, min_n: int, max_n: int) -> tuple[int, int]:
    """(generated, target forwards) that prompt lookup earns on a fixed greedy text: the prefill gives out[0], each
    later forward the accepted prefix of the proposal plus one token."""
    pos, forwards = 1, 1
    while pos < len(out):
        draft = ngram_proposal(prompt + out[:pos], k, min_n, max_n)
        accepted = 0
        while accepted < len(draft) and pos + accepted < len(out) and draft[accepted] == out[pos + accepted]:
            accepted += 1
        pos, forwards = pos + accepted + 1, forwards + 1
    return len(out), forwards


def ratio(rows: list[tuple[int, int]]) -> str:
    gen, fwd = map(sum, zip(*rows, strict=True))
    return f"{gen / fwd:.3f} ({gen} tokens / {fwd} forwards)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", default="mt-bench")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--both-turns", action="store_true", help="each question's second turn too")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(2)
    cfg = load_config(a.config, a.overrides)
    ev = cfg.eval
    model, tokenizer = load_target(cfg.target)
    render = PromptRenderer(tokenizer, cfg.data)
    questions = load_prompt_set(a.set, None, a.prompts).prompts
    prompts = [render([Turn("user", q.turns[0])]) for q in questions]
    eos = eos_ids(tokenizer, model.generation_config)
    # generate_baseline and generate_ngram read the target only: no head
    dec = SpeculativeDecoder(HFTargetDecoder(model, list(cfg.target.aux_layer_ids)), None, settings_from(ev), eos)
    plain = [dec.generate_baseline(q).tokens for q in prompts]
    if a.both_turns:  # second turns after the built-in's plain first answer, as its card renders them
        second = [render([Turn("user", q.turns[0]), Turn("assistant", render.answer(x, set(eos))),
                          Turn("user", q.turns[1])]) for q, x in zip(questions, plain, strict=True) if len(q.turns) > 1]
        prompts += second
        plain += [dec.generate_baseline(q).tokens for q in second]
    ngram = [dec.generate_ngram(q, None, ev.ngram_min, ev.ngram_max) for q in prompts]
    run = EngineRun(cfg.target, ev, cfg.paths)
    v_ngram = run_vllm(run, None, prompts, method="ngram", check_greedy=False)
    v_plain = run_vllm(run, None, prompts, method="plain")["outputs"]
    rule = (ev.num_steps, ev.ngram_min, ev.ngram_max)
    n = len(prompts)
    turns = "both turns" if a.both_turns else "first turns"
    print(f"\n{a.set}, {turns} of {a.prompts} prompts ({n} turns), {ev.max_new_tokens} new tokens, k {ev.num_steps}, "
          f"lookup {ev.ngram_min}-{ev.ngram_max}, target {cfg.target.dtype}")
    print(f"- plain greedy text, built-in == vLLM: {sum(x == y for x, y in zip(plain, v_plain, strict=True))} of {n}")
    print(f"- n-gram text == the engine's own plain text: built-in "
          f"{sum(g.tokens == x for g, x in zip(ngram, plain, strict=True))}, "
          f"vLLM {sum(x == y for x, y in zip(v_ngram['outputs'], v_plain, strict=True))} of {n}")
    print("tokens per target forward:")
    print(f"- built-in n-gram, its counters: {ratio([(len(g.tokens), g.target_forwards) for g in ngram])}")
    print(f"- the rule replayed on the built-in n-gram's text: "
          f"{ratio([replay(q, g.tokens, *rule) for q, g in zip(prompts, ngram, strict=True)])}")
    print(f"- the rule replayed on the built-in plain text: "
          f"{ratio([replay(q, x, *rule) for q, x in zip(prompts, plain, strict=True)])}")
    print(f"- the rule replayed on vLLM's plain text: "
          f"{ratio([replay(q, x, *rule) for q, x in zip(prompts, v_plain, strict=True)])}")
    print(f"- the rule replayed on vLLM's n-gram text: "
          f"{ratio([replay(q, x, *rule) for q, x in zip(prompts, v_ngram['outputs'], strict=True)])}")
    gen, acc = v_ngram["generated_tokens"], v_ngram["num_accepted_tokens"]
    print(f"- vLLM n-gram, its counters: {v_ngram['tokens_per_forward']:.3f} ({gen} tokens, {acc} accepted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
