"""A tiny target whose greedy decoding repeats its current token, and a draft head exact for it at every draft
position: the acceptance a working path must reach (1.0 at each position, τ at its maximum) where a random head
reaches about none. Greedy speculative decoding is lossless whatever a head drafts, so only acceptance shows
that a head's weights, its layer ids and the drafting path were all used as meant.

    from copy_heads import copy_high_feature, repeat_current_token
"""

from __future__ import annotations

from pathlib import Path

import torch


def repeat_current_token(path: str | Path) -> None:
    """Rewrite the saved tiny Llama at `path` so that it predicts its current token, with every layer still
    computing: the embeddings live in the first half of the hidden dims, each layer's attention and MLP write only
    the second half, and lm_head row y is the unit vector of the final norm's first half times e_y. The final
    norm divides the whole state by one positive number, so the logits are cosines to e_x, largest at y = x."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    half = model.config.hidden_size // 2
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, half:] = 0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:half] = 0
            layer.mlp.down_proj.weight[:half] = 0
        rows = torch.zeros_like(model.lm_head.weight)
        rows[:, :half] = model.model.norm.weight[:half] * embed[:, :half]
        model.lm_head.weight.copy_(rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12))  # the pad row stays 0
    model.save_pretrained(path)


def copy_high_feature(head, target: str | Path) -> None:
    """Make `head` (an eagle3.model.Eagle3Draft of either layer, its vocab mapping set) exact for a
    `repeat_current_token` target: fc copies the high aux feature (fc = [0 | 0 | I]), the layer adds nothing
    (o_proj and down_proj zero, so every draft step hands on the same feature), then the target's final norm and
    its lm_head rows of the head's draft vocab. The high feature carries e_x in its first half at every layer, so
    the head drafts the token the target repeats, accepted wherever that token is in its draft vocab."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    h = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * h:] = torch.eye(h)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.norm.weight.copy_(model.model.norm.weight)
    head.init_from_target(model.lm_head.weight.detach(), model.model.embed_tokens.weight.detach())
