"""The self-distillation recipe (recipes/smollm2-135m/self_distill.sh) end to end at a tiny budget, with the
in-process HF backend (no vLLM needed): SmolLM2 re-answers 8 ShareGPT conversations, then prepare -> extract ->
train -> export -> eval run on those answers.

    pytest -q -m slow tests/test_recipe_self_distill.py      # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recipe_runner import run_recipe


@pytest.mark.slow
def test_self_distill_tiny_budget_end_to_end(tmp_path: Path):
    out = tmp_path / "sd"
    overrides = [
        f"output_dir={out}", "target.dtype=float32", "data.max_samples=8", "data.max_length=192", "data.eval_size=2",
        "draft.vocab_size=1024", "regenerate.max_tokens=24", "train.max_steps=3", "train.batch_tokens=512",
        "train.eval_every=3", "train.save_every=3", "train.eval_max_samples=2", "eval.max_prompts=1",
        "eval.max_new_tokens=12",
    ]
    # VLLM_PYTHON empty: the in-process HF backend.
    proc = run_recipe("self_distill.sh", overrides, tmp_path, timeout=900, VLLM_PYTHON="",
                      STAGES="prepare extract train export eval")

    # The regenerated answers are SmolLM2's, not ShareGPT's, and prepare read them (not the bundled ShareGPT).
    regen = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert len(regen) == 8 and all(any(t["from"] == "gpt" for t in r["conversations"]) for r in regen)
    meta = json.loads((out / "prepared" / "meta.json").read_text())
    assert [s["path"] for s in meta["fingerprint_inputs"]["sources"]] == [str(out / "regenerated.jsonl")]
    assert "regenerated" in (out / "logs" / "regenerate.log").read_text()

    assert (out / "checkpoints" / "best" / "model.safetensors").is_file()
    for engine in ("sglang", "vllm"):
        assert (out / "export" / engine / "config.json").is_file()
    report = json.loads((out / "eval" / "report.json").read_text())
    mt = report["sets"]["mt-bench"]
    assert mt["tau"] == pytest.approx(1 + sum(mt["acceptance_rate"])) and mt["greedy_mismatches"] == 0
    assert "τ on mt-bench" in proc.stdout
