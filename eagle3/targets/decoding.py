"""An HF target decoding with a KV cache, as the built-in evaluator (eagle3.specdec) runs it: the logits and aux
states of new tokens at given positions, a tree of them verified in one forward, and a prompt's images at its
prefill (the whole vision-language model, its positions after the pictures, its merged input embeddings)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eagle3.targets.hf import LayerTap, decoder_parts, on_llm_inputs

if TYPE_CHECKING:
    from eagle3.data.images import VisionInputs


class HFTargetDecoder:
    """An HF causal LM with a KV cache, returning logits and the aux states (eagle3 ids) of the new tokens.

    Aux states come from the same forward pre-hooks extraction uses (eagle3.targets.hf.LayerTap: id k = input of
    layer k = HF hidden_states[k]), so nothing beyond the three tensors is kept.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], vision: VisionInputs | None = None):
        """`vision`: the processor of a vision-language `model` (its whole model, eagle3.targets.hf.load_vision_lm),
        for prompts with images."""
        self.model = model.eval()
        self.layer_ids = list(layer_ids)
        base, layers, _ = decoder_parts(model)
        self.tap = LayerTap(layers, self.layer_ids)
        self.llm = base
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.vision = vision
        self.offset = 0
        """What the target adds to a token's position after the prompt's prefill: Qwen2.5-VL's M-RoPE gives the
        text after an image the positions its grid leaves (rope_deltas); 0 for 1-D positions (Kimi-K2.5)."""
        self.image_embeds: torch.Tensor | None = None
        """The LLM's input embeddings at the image tokens of the last prefill (the projector's outputs) [N, H]."""
        self.prompt_positions: torch.Tensor | None = None
        """[n]: the temporal row of the last image prefill's M-RoPE positions (None for 1-D positions): what vLLM
        gives an EAGLE-3 draft as its positions over the prompt (eagle3.specdec)."""

    def close(self) -> None:
        self.tap.close()

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _prefill_images(self, input_ids: torch.Tensor, position_ids: torch.Tensor, images: list[str]
                        ) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The forward's image inputs for a prompt, and its positions: None where the model computes them itself
        from the images (M-RoPE), whose offset for the tokens after the prompt `forward` then keeps."""
        from eagle3.targets.hf import vision_forward_inputs

        self.offset, self.image_embeds, self.prompt_positions = 0, None, None
        if not images:
            return {}, position_ids
        if self.vision is None:
            raise ValueError("a prompt with images needs HFTargetDecoder(..., vision=...) and the whole "
                             "vision-language model")
        extra = vision_forward_inputs(self.model, self.vision, input_ids.view(1, -1), list(images), self.dtype,
                                      self.device)
        return extra, None if hasattr(self.model.model, "rope_deltas") else position_ids

    def _temporal_positions(self, input_ids: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor | None:
        """The temporal row [n] of the prompt's M-RoPE positions as the model computed them."""
        from eagle3.targets.hf import mrope_positions

        positions = mrope_positions(self.model.model, input_ids.view(1, -1).to(self.device), extra)
        return None if positions is None else positions[0].to("cpu")

    def _keep_image_embeds(self, input_ids: torch.Tensor) -> Any:
        at = (input_ids.view(-1) == self.vision.image_token_id).to(self.device)  # type: ignore[union-attr]

        def keep(embeds: torch.Tensor) -> None:
            self.image_embeds = embeds[0][at]
        return keep

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                tree_mask: torch.Tensor | None = None, aux: bool = True, images: list[str] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run new tokens [S] at positions [S] after `cache`; return logits [S, V] (float32) and aux [S, 3H].

        `tree_mask` is a bool [S, S] (True = may attend) among the new tokens; the cached prefix is always visible.
        `images` (a prompt's prefill only, [] for none): the prompt's images, in the order of its image tokens; they
        set the position offset of every later call and keep `image_embeds`.
        """
        s = input_ids.shape[-1]
        extra: dict[str, Any] = {}
        if images is not None:
            extra, position_ids = self._prefill_images(input_ids, position_ids, images)
        else:
            position_ids = position_ids + self.offset
        mask = None
        if tree_mask is not None:
            past = cache.get_seq_length()
            allowed = torch.cat([torch.ones(s, past, dtype=torch.bool, device=self.device),
                                 tree_mask.to(self.device)], dim=1)
            mask = torch.zeros(1, 1, s, past + s, dtype=self.dtype, device=self.device)
            mask.masked_fill_(~allowed[None, None], torch.finfo(self.dtype).min)
        self.tap.active = aux
        self.tap.states.clear()
        hook = None
        if extra:  # the LLM's input: the token embeddings with the pictures merged in
            hook = on_llm_inputs(self.llm, self._keep_image_embeds(input_ids))
        try:
            out = self.model(input_ids=input_ids.view(1, s).to(self.device),
                             position_ids=None if position_ids is None else position_ids.view(1, s).to(self.device),
                             attention_mask=mask, use_cache=True, **{self._cache_kw: cache}, **extra)
        finally:
            if hook is not None:
                hook.remove()
        if extra and position_ids is None:
            self.offset = int(self.model.model.rope_deltas.view(-1)[0])
            self.prompt_positions = self._temporal_positions(input_ids, extra)
        feats = None
        if aux:
            feats = self.tap.aux()[0]
            self.tap.states.clear()
        return out.logits[0].float(), feats


def keep_cache_positions(cache: Any, keep: torch.Tensor) -> None:
    """Keep only the sequence positions `keep` (sorted indices) of every layer of a DynamicCache, in place."""
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("sliding-window caches cannot be re-gathered to a tree path")
        idx = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


# ----------------------------------------------------------------------------------------------- sampling
