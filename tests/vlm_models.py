"""Tiny random vision-language targets built in code (the Hub is unreachable): Qwen2.5-VL and Kimi-K2.5 (transformers'
native `kimi_k25`), each a folder with its processor (tokenizer, image and video processors, chat template) and,
on request, the model. Their processors need torchvision (tests/vision_cpu, scripts/setup_torchvision.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizer_builders import KIMI_SPECIALS, _byte_level, kimi_test_tokenizer

QWEN_SPECIALS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258, "<|vision_start|>": 259,
                 "<|vision_end|>": 260, "<|image_pad|>": 261, "<|video_pad|>": 262}
QWEN_VOCAB = 320
# Qwen2-VL's chat template (default system prompt, images as <|vision_start|><|image_pad|><|vision_end|>).
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen25_vl(path: str | Path, with_model: bool = True, seed: int = 0) -> Path:
    """Qwen2.5-VL: 4 text layers of 64 (M-RoPE sections 2/3/3), a 2-block vision tower of 32, vocab 320."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    path = Path(path)
    tok = _byte_level(path, QWEN_VOCAB, QWEN_SPECIALS, QWEN_VL_TEMPLATE, bos=None, eos="<|im_end|>",
                      pad="<|endoftext|>")
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                        chat_template=QWEN_VL_TEMPLATE).save_pretrained(str(path))
    cfg = Qwen2_5_VLConfig(
        text_config={"vocab_size": QWEN_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                     "eos_token_id": 258, "pad_token_id": 256},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1]},
        image_token_id=261, video_token_id=262, vision_start_token_id=259, vision_end_token_id=260)
    return _save(path, cfg, Qwen2_5_VLForConditionalGeneration if with_model else None, seed)


def tiny_kimi_k25_vl(path: str | Path, with_model: bool = False, seed: int = 0) -> Path:
    """Kimi-K2.5 with its real special ids (vocab 163840, `<|media_pad|>` 163605) and the built-in kimi-k2.5
    template: a DeepSeek-V3 text model of 64 (4 layers, MLA) behind a 2-layer MoonViT of 32."""
    from transformers import (
        DeepseekV3Config,
        Kimi_K25Config,
        Kimi_K25ForConditionalGeneration,
        Kimi_K25ImageProcessor,
        Kimi_K25Processor,
        Kimi_K25VideoProcessor,
        Kimi_K25VisionConfig,
    )

    path = Path(path)
    tok = kimi_test_tokenizer(path)
    Kimi_K25Processor(image_processor=Kimi_K25ImageProcessor(), tokenizer=tok, video_processor=Kimi_K25VideoProcessor(),
                      chat_template=tok.chat_template).save_pretrained(str(path))
    text = DeepseekV3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                            first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=4096,
                            bos_token_id=KIMI_SPECIALS["[BOS]"], eos_token_id=KIMI_SPECIALS["[EOS]"],
                            pad_token_id=KIMI_SPECIALS["[PAD]"])
    vision = Kimi_K25VisionConfig(patch_size=14, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4,
                                  merge_kernel_size=[2, 2])
    cfg = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32)
    return _save(path, cfg, Kimi_K25ForConditionalGeneration if with_model else None, seed)


def _save(path: Path, cfg: Any, model_cls: Any, seed: int) -> Path:
    """The config alone (processor tests), or a random model of `model_cls` from it, seeded, into `path`."""
    if model_cls is None:
        cfg.save_pretrained(str(path))
        return path
    import torch

    torch.manual_seed(seed)
    model_cls(cfg).eval().save_pretrained(str(path))
    return path


def image_file(path: str | Path, side: int = 56, seed: int = 0, fmt: str = "PNG") -> Path:
    """A random RGB picture of side x side pixels."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.RandomState(seed).randint(0, 255, (side, side, 3), dtype=np.uint8)).save(path, fmt)
    return path


def processor(path: str | Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(path))


def sharpen(target: Path) -> Path:
    """A saved random VLM with its lm_head scaled up, so its next-token distributions peak (a random one is near flat,
    whose argmax no head learns from soft targets), and the rows of every token but printable ASCII zeroed (their logit
    0 stays below the largest of 95 random ones): its greedy answers are text that tokenizes back to the same ids, so
    a head taught them as conversations drafts them."""
    from safetensors.torch import load_file, save_file

    f = Path(target) / "model.safetensors"
    w = load_file(str(f))
    head = w["lm_head.weight"]
    head *= 30
    head[[i for i in range(head.shape[0]) if not 32 <= i < 127]] = 0
    save_file(w, str(f), metadata={"format": "pt"})
    return Path(target)


def taught_head(target: str | Path, root: Path, image_inputs: str, steps: int = 300) -> Path:
    """A head (of `image_inputs`' convention) taught a `sharpen`ed target's own greedy answers to the bundled image
    prompts, one per kind (three copies each): prepared, extracted (HF backend) and trained like a user's, so an
    engine's acceptance on those prompts is far above 1 and agreeing on it says something. Its best checkpoint."""
    import json

    from eagle3 import prepare
    from eagle3.config import load_config
    from eagle3.data.images import IMAGE_MARK
    from eagle3.data.templates import load_tokenizer
    from eagle3.engines.reference import hf_greedy
    from eagle3.engines.vllm_eval import stop_token_ids
    from eagle3.evaluate import PromptRenderer, vision_of
    from eagle3.extract import run as extract
    from eagle3.prompts import load_prompt_set
    from eagle3.trainer import run as train

    root.mkdir(parents=True)
    cfg = load_config(None, [f"output_dir={root / 'run'}", f"target.path={target}", "target.dtype=float32",
                             f"data.sources=[{{path: {root / 'data.jsonl'}}}]",
                             "target.aux_layer_ids=[1,2,3]", "data.eval_size=2", "draft.vocab_size=320",
                             f"draft.image_inputs={image_inputs}", "train.batch_tokens=2048", "train.lr=1e-2",
                             f"train.max_steps={steps}", f"train.eval_every={steps}", f"train.save_every={steps}"])
    ps = load_prompt_set("images", max_prompts=1)
    tok = load_tokenizer(cfg.target)
    render = PromptRenderer(tok, cfg.data, vision_of(cfg.target, [ps]))
    stop = stop_token_ids(cfg.target)
    turns = [(p.messages or [])[0] for p in ps.prompts]
    answers = hf_greedy(cfg.target, [render([t]) for t in turns], 24, stop, [list(t.images) for t in turns])
    with open(root / "data.jsonl", "w") as f:
        for p, turn, a in zip(ps.prompts, turns, answers, strict=True):
            user = [{"type": "image_url", "image_url": {"url": turn.images[0]}},
                    {"type": "text", "text": turn.content.replace(IMAGE_MARK, "")}]
            answer = tok.decode([t for t in a if t not in stop])
            for k in range(3):
                f.write(json.dumps({"id": f"{p.id}-{k}", "messages": [{"role": "user", "content": user},
                                                                      {"role": "assistant", "content": answer}]}) + "\n")
    prepare.run(cfg)
    extract(cfg)
    train(cfg)
    return cfg.checkpoint_dir / "best"
