"""`eagle3 vocab coverage` and the eval card's out-of-vocab column, against an independent count on a tiny target."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from copy_heads import repeat_current_token
from test_evaluate import VOCAB, _setup

from eagle3.data.vocab import OutOfVocab

PROMPTS = [("a", "x", "Say something about cats"), ("b", "x", "Hello world"), ("c", "y", "Count to a hundred"),
           ("d", "y", "Now the bus"), ("e", "y", "Sharpen the axe")]
"""The target repeats each prompt's last byte: `s` (115) and `e` (101) are outside the draft vocab (ids divisible
by 4) and copies of the prompt, `d` (100) is inside: x 1/2 out of vocab, y 2/3, all 3/5 of the generated tokens."""


def _coverage_cfg(tmp_path: Path):
    """test_evaluate's tiny target, made to repeat its current token, and head (its draft vocab: the ids divisible by
    4); the prepared vocab the same; one prompt set with two categories, a plain template."""
    from eagle3.data.prepared import save_vocab

    cfg = _setup(tmp_path)
    repeat_current_token(cfg.target.path)
    ids = torch.arange(128) * 4
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    save_vocab(cfg.prepared_dir / "vocab.safetensors", ids - torch.arange(128), t2d)
    template = tmp_path / "plain.jinja"
    template.write_text("{{ messages | map(attribute='content') | join(' ') }}")
    cfg.data.chat_template = str(template)
    prompts = tmp_path / "cov.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "category": c, "prompt": p}) for i, c, p in PROMPTS))
    cfg.eval.prompt_sets = [str(prompts)]
    cfg.eval.max_new_tokens = 12
    cfg.eval.ngram = False
    return cfg, t2d.numpy()


def _independent(cfg, t2d: np.ndarray) -> dict[str, tuple[int, int, int]]:
    """(generated, outside the vocab, outside and in the prompt) per category and in all, by plain full-sequence
    greedy decoding with transformers (no KV cache, no eagle3 decoder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.data.templates import render_prompt
    from eagle3.data.types import Turn
    from eagle3.targets.hf import eos_ids

    model = AutoModelForCausalLM.from_pretrained(cfg.target.path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(cfg.target.path)
    eos = set(eos_ids(tok, model.generation_config))
    counts: dict[str, list[int]] = {}
    for _, cat, text in PROMPTS:
        prompt = render_prompt([Turn("user", text)], tok, cfg.data.chat_template, False)
        seq, out = list(prompt), []
        with torch.no_grad():
            while len(out) < cfg.eval.max_new_tokens:
                t = int(model(torch.tensor([seq])).logits[0, -1].argmax())
                out.append(t)
                seq.append(t)
                if t in eos:
                    break
        outside = [t for t in out if not t2d[t]]
        for key in (cat, "all"):
            c = counts.setdefault(key, [0, 0, 0])
            c[0] += len(out)
            c[1] += len(outside)
            c[2] += sum(t in prompt for t in outside)
    return {k: tuple(v) for k, v in counts.items()}


def _shares(n: tuple[int, int, int]) -> tuple[float, float]:
    return n[1] / n[0], n[2] / n[0]


def test_coverage_command_and_card_equal_an_independent_count(tmp_path: Path, capsys):
    from eagle3.cli import main
    from eagle3.evaluate import run as evaluate

    cfg, t2d = _coverage_cfg(tmp_path)
    want = _independent(cfg, t2d)
    n = cfg.eval.max_new_tokens
    assert want == {"x": (2 * n, n, n), "y": (3 * n, 2 * n, 2 * n), "all": (5 * n, 3 * n, 3 * n)}  # the design

    config = tmp_path / "cfg.yaml"
    config.write_text(cfg.to_yaml())
    assert main(["vocab", "coverage", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    from eagle3.coverage import run

    got = run(cfg)["cov"]
    capsys.readouterr()
    assert got["generated_tokens"] == want["all"][0] and got["turns"] == 5
    assert (got["out_of_vocab"], got["out_of_vocab_in_prompt"]) == pytest.approx(_shares(want["all"]), abs=1e-12)
    for cat in ("x", "y"):
        c = got["categories"][cat]
        assert (c["out_of_vocab"], c["out_of_vocab_in_prompt"]) == pytest.approx(_shares(want[cat]), abs=1e-12)
    assert f"{100 * _shares(want['all'])[0]:.2f}%" in out and "cov/x" in out and "out of vocab" in out

    report = evaluate(cfg)  # the head's draft vocab is the same t2d: the card's column is the same count
    r = report["sets"]["cov"]
    assert (r["out_of_vocab"], r["out_of_vocab_in_prompt"]) == pytest.approx(_shares(want["all"]), abs=1e-12)
    assert r["categories"]["y"]["out_of_vocab"] == pytest.approx(_shares(want["y"])[0], abs=1e-12)
    rows = {row["set"]: row for row in json.loads((cfg.eval_dir / "report.json").read_text())["card"]}
    assert rows["cov"]["out_of_vocab"] == pytest.approx(_shares(want["all"])[0], abs=1e-12)
    assert rows["cov/x"]["out_of_vocab"] == pytest.approx(_shares(want["x"])[0], abs=1e-12)
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("prompt set"))
    assert "out of vocab" in header and "oov in prompt" in header
    assert f"{100 * _shares(want['x'])[0]:.2f}%" in next(x for x in printed.splitlines() if x.startswith("cov/x"))


def test_out_of_vocab_counts_generated_tokens_outside_t2d_and_copies_from_the_prompt():
    t2d = np.array([True, False, True, False, False])
    o = OutOfVocab()
    o.add([0, 1, 1, 3, 2], prompt=[1, 2], t2d=t2d)  # 1, 1, 3 outside; the two 1s are in the prompt
    o.add([4], prompt=[0], t2d=t2d)
    assert (o.generated, o.outside, o.in_prompt) == (6, 4, 2)
    assert o.to_json() == {"generated_tokens": 6, "out_of_vocab": 4 / 6, "out_of_vocab_in_prompt": 2 / 6}
