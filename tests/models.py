"""Tiny random targets and prepared-data folders, built from configs and written as real folders on disk.

Other tests import these builders; every one is deterministic (fixed seed), so two calls write the same bytes.

    from models import tiny_llama, tiny_deepseek_v3, kimi_wrapped, make_prepared

(pytest puts tests/ on sys.path because tests/ has a conftest.py and no __init__.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["tiny_llama", "llama_config", "tiny_deepseek_v3", "deepseek_v3_config", "kimi_wrapped", "make_prepared", "tiny_target_cfg"]


def _save(model: torch.nn.Module, path: Path) -> Path:
    # Random norm weights (HF initialises them to 1): otherwise a pre-norm state is just a rescaled post-norm
    # one and a test could not tell them apart, while in a trained model they differ a lot.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def llama_config(vocab: int = 256, hidden: int = 64, layers: int = 8, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 128, tie: bool = False):
    """`tiny_llama`'s LlamaConfig."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                       tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_llama(path: str | Path, vocab: int = 256, hidden: int = 64, layers: int = 8, heads: int = 4,
               kv_heads: int = 2, intermediate: int = 128, seed: int = 0, tie: bool = False) -> Path:
    """A random Llama (SmolLM2's architecture, GQA) saved with save_pretrained; returns the folder.

    8 layers by default: eagle3.layer_ids.default_layer_ids(6) gives [2, 3, 3] (not strictly increasing)."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(vocab, hidden, layers, heads, kv_heads, intermediate, tie)
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(cfg).eval(), Path(path))


def deepseek_v3_config(vocab: int = 256, hidden: int = 64, layers: int = 4, **overrides):
    """Kimi-K2.5's LLM in miniature: MLA, routed experts + 1 shared, first layer dense. `overrides`: any other
    DeepseekV3Config field (heads, MLA ranks and head dims, experts, widths), e.g. the GPU-shaped fixtures of
    tests/sglang_cpu/tiny_models.py `target_shape`."""
    from transformers import DeepseekV3Config

    fields = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=4096, num_mtp_layers=0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return DeepseekV3Config(**{**fields, **overrides})


def tiny_deepseek_v3(path: str | Path, vocab: int = 256, hidden: int = 64, layers: int = 4, seed: int = 0,
                     **overrides) -> Path:
    """A random DeepseekV3ForCausalLM (MLA + MoE) saved with save_pretrained; returns the folder. `overrides` go
    to `deepseek_v3_config`."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_v3_config(vocab, hidden, layers, **overrides)).eval()
    # Random init leaves the router's correction bias at zero and weights tiny: make routing non-trivial.
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return _save(model, Path(path))


def kimi_wrapped(path: str | Path, **kw) -> Path:
    """The tiny DeepseekV3 laid out the way Kimi-K2.5 ships: a multimodal wrapper config whose LLM sits in
    `text_config`, and every weight prefixed `language_model.` (no vision tower: extraction never touches it)."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    inner = tiny_deepseek_v3(path / "_inner", **kw)
    text_config = json.loads((inner / "config.json").read_text())
    weights = load_file(str(inner / "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text_config, "vision_config": {"model_type": "moonvit"}}
    (path / "config.json").write_text(json.dumps(wrapper, indent=2))
    for f in inner.iterdir():
        f.unlink()
    inner.rmdir()
    return path


def make_prepared(path: str | Path, n: int = 12, vocab: int = 256, n_eval: int = 3, min_len: int = 5,
                  max_len: int = 40, draft_vocab: int = 64, seed: int = 0, max_length: int = 2048) -> Path:
    """A prepared-data folder in the exact layout of eagle3/data/prepared.py, with random token ids.

    Lengths vary so batching by length and padding are exercised. The loss mask covers a random suffix.
    """
    from datasets import Dataset, Features, Sequence, Value

    from eagle3.data.prepared import save_vocab

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    features = Features({"id": Value("string"), "input_ids": Sequence(Value("int32")),
                         "loss_mask": Sequence(Value("int8"))})

    def split(name: str, count: int) -> int:
        rows: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": []}
        tokens = 0
        for i in range(count):
            t = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            ids = torch.randint(3, vocab, (t,), generator=g)
            start = int(torch.randint(1, t, (1,), generator=g))
            rows["id"].append(f"{name}-{i:05d}")
            rows["input_ids"].append(ids.tolist())
            rows["loss_mask"].append([0] * start + [1] * (t - start))
            tokens += t
        Dataset.from_dict(rows, features=features).save_to_disk(str(path / name))
        return tokens

    train_tokens = split("train", n)
    eval_tokens = split("eval", n_eval)
    d2t = torch.zeros(draft_vocab, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    save_vocab(path / "vocab.safetensors", d2t, t2d)
    meta = {"fingerprint": f"test-prepared-{n}-{n_eval}-{vocab}-{seed}", "max_length": max_length,
            "summary": {"train": {"samples": n, "tokens": train_tokens}, "eval": {"samples": n_eval,
                                                                                  "tokens": eval_tokens}}}
    (path / "meta.json").write_text(json.dumps(meta, indent=2))
    return path


def tiny_target_cfg(target: Path, prepared: Path, out: Path, **extract):
    """A Config pointing at a tiny target and prepared folder, float32 on CPU, small shards."""
    from eagle3.config import Config

    cfg = Config(output_dir=str(out))
    cfg.target.path = str(target)
    cfg.target.dtype = "float32"
    cfg.data.output_dir = str(prepared)
    for k, v in extract.items():
        setattr(cfg.extract, k, v)
    return cfg


# --------------------------------------------------------------------------------------- the TTT reference
def every_row(b: int, t: int, steps: int, device: torch.device | str = "cpu"):
    """Every position computed and scored at every step: eagle3.rows.TTTPlan with nothing pruned."""
    from eagle3.rows import TTTPlan

    all_ = torch.arange(b * t, device=device)
    return TTTPlan((b, t), [all_] * steps, [all_] * steps, [all_] * steps, all_, [all_] * steps,
                   torch.full((steps,), float(b * t), device=device), t)


def ttt_unroll(draft, hidden0: torch.Tensor, input_ids: torch.Tensor, steps: int,
               attention: str = "fast", positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Logits [B, T, draft_vocab] of every position at each of `steps` unrolled steps: the draft's TTT forward
    with nothing pruned (every_row), the reference the pruned trainer is compared with."""
    from eagle3.ttt import ttt_unroll_rows

    b, t = input_ids.shape
    rows = every_row(b, t, steps, input_ids.device)
    return [draft.lm_head(x).view(b, t, -1)
            for x in ttt_unroll_rows(draft, hidden0, input_ids, rows, attention, positions=positions)]


def assert_fast_equals_dense(draft, aux: torch.Tensor, ids: torch.Tensor, steps: int,
                             positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The fast TTT attention gives the dense reference's logits and parameter gradients; the fast logits."""
    fast = ttt_unroll(draft, draft.project(aux), ids, steps, "fast", positions)
    dense = ttt_unroll(draft, draft.project(aux), ids, steps, "dense", positions)
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    gf = torch.autograd.grad(sum(x.square().mean() for x in fast), list(draft.parameters()), retain_graph=True)
    gd = torch.autograd.grad(sum(x.square().mean() for x in dense), list(draft.parameters()))
    for a, b in zip(gf, gd, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    return fast


def kill_after_batches(n: int) -> dict[str, str]:
    """Environment for a child `eagle3 extract` that SIGKILLs itself after its n-th forward batch is written
    (tests/killhook/sitecustomize.py); the repo and whatever PYTHONPATH held (the SGLang stand-ins a server it
    launches inherits) stay importable."""
    here = Path(__file__).resolve().parent
    path = [str(here / "killhook"), str(here.parent), os.environ.get("PYTHONPATH", "")]  # keep what is there
    return {"EAGLE3_TEST_KILL_AFTER_BATCHES": str(n), "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def kill_after_checkpoint(step: int) -> dict[str, str]:
    """Environment for a child trainer that SIGKILLs itself right after its step-`step` checkpoint is complete
    (tests/killhook/sitecustomize.py)."""
    here = Path(__file__).resolve().parent
    path = [str(here / "killhook"), str(here.parent), os.environ.get("PYTHONPATH", "")]
    return {"EAGLE3_TEST_KILL_AFTER_CHECKPOINT": str(step), "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def run_then_crash_after_checkpoint(monkeypatch, cfg, step: int) -> None:
    """`eagle3.trainer.run(cfg)` in this process, interrupted right after its step-`step` checkpoint is written
    (as a kill would leave it), with the trainer's save restored afterwards for the resume."""
    import pytest

    from eagle3 import trainer

    real_save = trainer.save_checkpoint

    def save_then_die(accelerator, model, state, *a):
        path = real_save(accelerator, model, state, *a)
        if state.step == step:
            raise KeyboardInterrupt(f"simulated kill right after the step-{step} checkpoint")
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        trainer.run(cfg)
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)


def checkpoint_differences(a: str | Path, b: str | Path) -> list[str]:
    """Every file of two checkpoint step folders whose bytes differ (by their checksums.json, which records every
    file's size and SHA-256): weights, optimizer and scheduler state, RNG states, trainer state, vocab, the
    draft. Empty means a resumed run reached the very same state as an uninterrupted one."""
    import json

    ca = json.loads((Path(a) / "checksums.json").read_text())
    cb = json.loads((Path(b) / "checksums.json").read_text())
    return sorted(f for f in ca.keys() | cb.keys() if ca.get(f) != cb.get(f))
