"""Plain HF greedy decoding of the prompts an engine decoded, the reference its speculative output must reproduce
(speculative decoding never changes greedy text), and the comparison of the two."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3.config import TargetConfig


def hf_greedy(target: TargetConfig, prompts: list[list[int]], max_new_tokens: int, stop: list[int],
              images: list[list[str]] | None = None) -> list[list[int]]:
    """Plain HF greedy decoding of every prompt (the reference vLLM's speculative output must reproduce); with
    `images` (a list of image files per prompt), the whole vision-language model decodes the prompts with images,
    their image tokens already expanded, with the processor's pixel inputs."""
    import torch

    from eagle3.logs import Progress
    from eagle3.targets.hf import load_target, vision_forward_inputs

    vision = None
    if images is not None and any(images):
        from eagle3.data.images import VisionInputs

        vision = VisionInputs.required(target)
    model, _ = load_target(target, images=vision is not None)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    outs: list[list[int]] = []
    # As long as the built-in's plain baseline (minutes on a CPU for all of MT-bench): it needs an ETA.
    with torch.no_grad(), Progress(len(prompts), "hf greedy reference", unit="prompt") as progress:
        for i, ids in enumerate(prompts):
            x = torch.tensor([ids], device=device)
            extra = vision_forward_inputs(model, vision, x, list(images[i]), dtype, device) if vision else {}
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=stop or None, pad_token_id=stop[0] if stop else 0, **extra)
            outs.append(y[0, len(ids):].tolist())
            progress.update(1)
    return outs


def _strip(tokens: list[int], stop: list[int]) -> list[int]:
    """Tokens up to and including the first stop token (HF pads after it, vLLM stops at it)."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def compare_greedy(vllm_out: list[list[int]], ref: list[list[int]], stop: list[int]) -> dict[str, Any]:
    """Per prompt: equal token lists, else the first differing position (a bf16 near-tie can flip a token; a
    mismatch in most prompts at position 0-2 means vLLM is not decoding the same model)."""
    same, first_diff = 0, []
    for i, (a, b) in enumerate(zip(vllm_out, ref, strict=True)):
        a, b = _strip(a, stop), _strip(b, stop)
        if a == b:
            same += 1
            continue
        k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        first_diff.append({"prompt": i, "position": k, "vllm_len": len(a), "hf_len": len(b)})
    return {"greedy_same": same, "greedy_compared": len(ref), "greedy_first_diffs": first_diff}
