"""What a config's draft head holds on each GPU, counted from the head eagle3 builds (on the meta device: no memory,
no weights, no GPU), for the docs' memory figures.

    python benchmarks/head_budget.py --config configs/kimi-k2.5.yaml --gpus 8
    python benchmarks/head_budget.py --config configs/kimi-k2.5.yaml --gpus 8 draft.arch=llama

The target's shape comes from its config.json when `target.path` has one; for configs/kimi-k2.5.yaml, whose path
is a placeholder, from Kimi-K2.5's published text_config (../shared/REFERENCE.md §4), written below. Prints the
trainable parameters by part, the frozen tensors the trainer holds (the target's embeddings, the teacher's
draft-vocab lm_head rows), and the optimizer state per GPU under DDP and under FSDP2 over `--gpus`.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

KIMI_K25_TEXT = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 163840,
    "intermediate_size": 18432, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
    "max_position_embeddings": 262144,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
"""Kimi-K2.5's LLM (text_config), as published: the shape the shipped config's head is built from."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from eagle3.config import load_config
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig

    cfg = load_config(a.config, a.overrides)
    conf = Path(cfg.target.path) / "config.json"
    hf = json.loads(conf.read_text()) if conf.is_file() else KIMI_K25_TEXT
    hf = hf.get("text_config", hf)
    dcfg = Eagle3DraftConfig.from_target(cfg.draft, cfg.target, hf, draft_vocab_size=cfg.draft.vocab_size)
    with torch.device("meta"):
        head = Eagle3Draft(dcfg)
    parts: Counter[str] = Counter()
    for name, p in head.named_parameters():
        if p.requires_grad:
            parts[name.split(".")[0] if not name.startswith(("midlayer", "layers")) else
                  ".".join(name.split(".")[:3])] += p.numel()
    trainable = sum(parts.values())
    item = torch.empty(0, dtype=torch.bfloat16).element_size()
    frozen = {"target embeddings": hf["vocab_size"] * hf["hidden_size"] * item,
              "teacher lm_head rows (draft vocab)": dcfg.draft_vocab_size * hf["hidden_size"] * item}
    print(f"{a.config} {' '.join(a.overrides)}: draft.arch={dcfg.arch}, draft vocab {dcfg.draft_vocab_size}")
    for name, n in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40s} {n / 1e6:9.1f} M")
    print(f"trainable: {trainable / 1e9:.3f} B parameters")
    for name, b in frozen.items():
        print(f"frozen {name}: {b / 1e9:.2f} GB (bf16)")
    state = 16 * trainable  # fp32 weights, gradients, AdamW m and v
    print(f"fp32 weights + gradients + AdamW m, v: {state / 1e9:.1f} GB under DDP (every GPU), "
          f"{state / a.gpus / 1e9:.2f} GB per GPU under FSDP2 over {a.gpus}; bf16 copies under autocast "
          f"{2 * trainable / 1e9:.2f} GB (FSDP2 gathers them a layer at a time)")


if __name__ == "__main__":
    main()
