"""`eagle3 vocab coverage`: the share of the target's own greedy output that the draft vocabulary cannot propose.

    eagle3 vocab coverage --config configs/smollm2-135m.yaml eval.max_prompts=20

A head drafts only tokens of its vocab (`t2d` of `<prepared_dir>/vocab.safetensors`), so each token outside it is a
rejection wherever the target emits it, however well the head is trained. For every prompt set of
`eval.prompt_sets` (`eval.max_prompts`, `eval.max_new_tokens`) the target decodes plainly and greedily, turn by turn
as `eagle3 eval` does (eagle3.specdec's `generate_baseline`, later turns after the earlier answers), and this prints,
per set and category: generated tokens, the share outside the draft vocab, and the share outside it that also occurs
in the turn's prompt (copyable: prompt-lookup drafting could propose it; `draft.vocab_from: answers+prompts` or a
bigger `draft.vocab_size` might). Run it before extraction to choose the vocab; `eagle3 eval`'s card reports the
same shares for the head it evaluates, from its own plain reference decode.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from eagle3 import threads
from eagle3.config import Config
from eagle3.data.vocab import OutOfVocab
from eagle3.logs import Progress, setup_logging

log = logging.getLogger("eagle3")


def run(cfg: Config) -> dict[str, Any]:
    """Decode every prompt set plainly and greedily; print and return {set: shares, with `categories`}."""
    from eagle3.data.prepared import load_vocab, read_prepared_meta
    from eagle3.data.types import Turn
    from eagle3.evaluate import PromptRenderer, settings_from
    from eagle3.prompts import load_prompt_set
    from eagle3.specdec import HFTargetDecoder, SpeculativeDecoder
    from eagle3.targets.hf import eos_ids, load_target

    setup_logging()
    read_prepared_meta(cfg.prepared_dir)  # the vocab file checked against its recorded checksum
    _, t2d_tensor = load_vocab(cfg.prepared_dir / "vocab.safetensors")
    t2d = t2d_tensor.bool().numpy()
    model, tokenizer = load_target(cfg.target)
    num_layers = model.config.get_text_config().num_hidden_layers
    target = HFTargetDecoder(model, cfg.target.layer_ids(num_layers))
    eos = set(eos_ids(tokenizer, model.generation_config))
    # plain greedy decoding needs no head: the decoder's draft is never called by generate_baseline
    dec = SpeculativeDecoder(target, None, replace(settings_from(cfg.eval), temperature=0.0), eos)  # type: ignore[arg-type]
    render = PromptRenderer(tokenizer, cfg.data)
    sets = [load_prompt_set(n, cfg.prepared_dir, cfg.eval.max_prompts) for n in cfg.eval.prompt_sets]
    render.check_tools(sets)
    result: dict[str, Any] = {}
    with Progress(sum(ps.num_turns for ps in sets), "coverage", unit="turn") as progress:
        for ps in sets:
            total, per_cat, turns = OutOfVocab(), {}, {}
            for prompt in ps.prompts:
                history: list[Turn] = list(prompt.messages or [])
                for text in prompt.to_generate():
                    ids = render.turn(prompt, history, text)
                    threads.adjust()
                    ref = dec.generate_baseline(ids, torch.Generator().manual_seed(0))
                    total.add(ref.tokens, ids, t2d)
                    if prompt.category is not None:
                        per_cat.setdefault(prompt.category, OutOfVocab()).add(ref.tokens, ids, t2d)
                        turns[prompt.category] = turns.get(prompt.category, 0) + 1
                    if text is not None:
                        history.append(Turn("assistant", render.answer(ref.tokens, eos)))
                    progress.update(1)
            result[ps.name] = {"turns": ps.num_turns, **total.to_json()}
            if per_cat:
                result[ps.name]["categories"] = {c: {"turns": turns[c], **o.to_json()}
                                                 for c, o in sorted(per_cat.items())}
    target.close()
    for line in coverage_lines(result, int(t2d.sum()), len(t2d), str(cfg.prepared_dir / "vocab.safetensors")):
        print(line, flush=True)
    return result


def coverage_lines(result: dict[str, Any], draft: int, vocab: int, where: str) -> list[str]:
    """The table `eagle3 vocab coverage` prints: a row per set, then per category of a set with several."""
    rows = []
    for name, r in result.items():
        rows.append((name, r))
        cats = r.get("categories") or {}
        if len(cats) > 1:
            rows += [(f"{name}/{c}", x) for c, x in cats.items()]
    width = max([len("prompt set"), *(len(n) for n, _ in rows)])
    lines = [f"draft vocab {where}: {draft} of {vocab} target tokens; plain greedy output of the target",
             f"{'prompt set':<{width}}  turns  generated  out of vocab  also in prompt"]
    for name, r in rows:
        lines.append(f"{name:<{width}}  {r['turns']:>5}  {r['generated_tokens']:>9}  {100 * r['out_of_vocab']:11.2f}%"
                     f"  {100 * r['out_of_vocab_in_prompt']:13.2f}%")
    return lines
