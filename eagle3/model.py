"""The EAGLE-3 draft head, laid out exactly as SGLang and vLLM load it (`LlamaForCausalLMEagle3`, or
`Eagle3DeepseekV2ForCausalLM` for the MLA layer).

    fc_norm (EAGLE-3.1, optional): one RMSNorm per aux state before fc
    fc: Linear(3*H_target -> H)              fuses the target's low/mid/high residual streams
    midlayer: the first decoder layer, whose attention input is
        cat(input_layernorm(embed(token)), hidden_norm(feature))   (attention takes 2H; the residual is the feature)
        attention: Llama (q/k/v/o, GQA, RoPE) or MLA (DeepSeek-V3's: q/kv low-rank projections, interleaved RoPE
        on a shared rope key, YaRN softmax scale), then the SiLU MLP
    layers.{1..n-1} (`draft.num_layers` > 1, Llama only): plain pre-norm Llama layers on the residual stream, as
        both engines stack them; the one norm before attention is vLLM's `input_layernorm` and SGLang's
        `hidden_norm`, so the head's files carry it under both names (same values)
    norm -> lm_head: H -> draft_vocab
    the hidden handed to the next draft step: the pre-`norm` output, or the post-`norm` one (EAGLE-3.1
    `norm_output`), as both engines do
    d2t int64 [draft_vocab] (target id = i + d2t[i]), t2d bool [target_vocab]
    embed_tokens: the target's embeddings, frozen, never saved in the draft's files

Parameter names are the engines' own, so eagle3's draft folder (eagle3.formats, which reads and writes every
format) is one an engine could read as-is; the export only adds the engine's config spelling. The attention pieces are exposed separately
(`attention_inputs` / `after_attention`) because the training-time test attends over keys from several
unrolled steps with its own fast kernel (eagle3.ttt `ttt_unroll_rows`), while `decode` is the
incremental KV-cache path that the evaluator uses for chain and tree drafting.

Training-time test: step j's input at position t is (the step j-1 output hidden, token x_{t+1+j}) at RoPE
position t+j (the alignment and which positions are computed: eagle3.rows). Attention at step j: the causal
prefix of step-0 keys (positions 0..t) plus the same position's keys from steps 1..j (its own included), as the
engine's KV cache holds them when drafting j tokens ahead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right
from transformers import DeepseekV3Config, LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
    yarn_apply_mscale,
)
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from eagle3.config import DraftArch
from eagle3.layer_ids import LAYER_ID_CONVENTION, default_layer_ids, validate_layer_ids
from eagle3.rope import normalise_rope, rope_scaling_of, rope_theta_of, transformers_rope
from eagle3.rows import TTTPlan
from eagle3.targets.info import TargetInfo
from eagle3.ttt import LOCAL, Attention, LocalAttention, repeat_kv, ttt_unroll_rows

log = logging.getLogger("eagle3")

FORMAT = "eagle3-draft"
KV = tuple[Tensor, Tensor]
KVCache = tuple[KV, ...]
"""One (keys, values) per decoder layer, keys post-RoPE, each [B, kv_heads, K, head_dim]."""


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if hf_config is None:
        return {}
    if isinstance(hf_config, dict):
        return dict(hf_config)
    return hf_config.to_dict()


_MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _mla_defaults(hf: dict[str, Any], family: str, hidden: int, heads: int) -> dict[str, int]:
    """MLA dimensions: a DeepSeek/Kimi target's own; otherwise DeepSeek-V3's proportions (nope = v = d,
    rope = d/2, kv_lora = 4d, q_lora = 12d, Kimi-K2.5: d = 128) on the target's head dim d."""
    if family == "deepseek" and hf.get("kv_lora_rank"):
        return {k: int(hf[k]) for k in _MLA_DIMS if hf.get(k) is not None}
    d = int(hf.get("head_dim") or hidden // heads)
    return {"q_lora_rank": 12 * d, "kv_lora_rank": 4 * d, "qk_nope_head_dim": d,
            "qk_rope_head_dim": max(2, d // 2), "v_head_dim": d}


ArchDims = tuple[int, int, dict[str, Any] | None, dict[str, Any]]
"""(kv heads, head dim, RoPE scaling, the arch's own fields) of a head for a target."""


def _llama_dims(d: Any, hf: dict[str, Any], family: str, hidden: int, heads: int) -> ArchDims:
    if family == "deepseek":  # no Llama-sense kv heads or head_dim; MLA's YaRN is tuned to its rope sub-dimension
        return d.num_key_value_heads or heads, d.head_dim or hf.get("v_head_dim") or 128, None, {}
    return (d.num_key_value_heads or hf.get("num_key_value_heads") or heads,
            d.head_dim or hf.get("head_dim") or hidden // heads, rope_scaling_of(hf), {})


def _mla_dims(d: Any, hf: dict[str, Any], family: str, hidden: int, heads: int) -> ArchDims:
    mla = _mla_defaults(hf, family, hidden, heads)
    mla.update({k: getattr(d, k) for k in _MLA_DIMS if getattr(d, k) is not None})
    rope_scaling = rope_scaling_of(hf)
    if rope_scaling and rope_scaling["rope_type"] != "yarn":
        log.info("the target's %s RoPE scaling is not YaRN, the only one the engines serve an MLA head with: the MLA "
                 "head rotates plainly", rope_scaling["rope_type"])
        rope_scaling = None
    return heads, mla["v_head_dim"], rope_scaling, mla


ARCH_DIMS: dict[str, Callable[..., ArchDims]] = {"llama": _llama_dims, "mla": _mla_dims}
"""draft.arch -> its dimensions for a target (its attention: ATTENTIONS)."""


SHAPE_FIELDS = ("arch", "num_layers", "fc_norm", "norm_output", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "target_hidden_size",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""The config fields that decide which tensors a head has and their shapes (draft vocab aside): two heads can share
weights (resume, fine-tune) only where all of them agree."""


@dataclass
class Eagle3DraftConfig:
    """Everything needed to rebuild the head, plus where its features come from (written to config.json)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    """The target's vocabulary (the size of `t2d` and of the frozen embeddings)."""
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    aux_layer_ids: list[int] | None = None
    """Low/mid/high ids in eagle3's convention (`layer_id_convention`), see eagle3.layer_ids."""
    layer_id_convention: str = LAYER_ID_CONVENTION
    target: dict[str, Any] = field(default_factory=dict)
    """{path, architectures, model_type, num_layers} of the target the head was trained for."""
    hidden_act: str = "silu"
    features: str = "fused"
    """`fused` (EAGLE-3: low/mid/high) or `top` (ablation, EAGLE-1/2 style: only the high state reaches fc)."""
    arch: str = "llama"
    """The decoder layer's attention: `llama` (q/k/v/o) or `mla` (DeepSeek-V3's multi-head latent attention)."""
    fc_norm: bool = False
    """EAGLE-3.1: one RMSNorm per aux state before fc (weights `fc_norm.{0,1,2}.weight`)."""
    norm_output: bool = False
    """EAGLE-3.1: the next draft step receives the post-`norm` hidden instead of the pre-`norm` one."""
    num_layers: int = 1
    """Decoder layers: `midlayer`, then `layers.{1..}` on the residual stream (Llama layer only)."""
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    """MLA dimensions (arch `mla` only; DeepSeek-V3's names)."""
    image_inputs: str | None = None
    """The input the head was trained with at image tokens (`draft.image_inputs`: `placeholder`, vLLM's, or
    `target-embeddings`, SGLang's); None for a head of a run without images."""

    @classmethod
    def from_target(cls, draft: Any, target: Any, target_hf_config: Any, draft_vocab_size: int) -> Eagle3DraftConfig:
        """Dimensions from the target's HF config, overridden by the `draft` config section.

        Llama layer: Llama-style targets give heads / kv heads / head_dim directly, and their RoPE scaling (YaRN,
        llama3, linear: ROPE_KEYS). DeepSeek-style (MLA) targets such as Kimi-K2.5 have no Llama-sense kv heads or
        head_dim, so kv heads = heads and head_dim = the target's `v_head_dim` (128 when absent) rather than
        hidden/heads (7168/64 = 112); their YaRN is tuned to MLA's 64-dim rope sub-dimension, so the Llama layer
        rotates plainly with the target's rope_theta, as peers' Kimi Llama-layer heads do (TorchSpec's:
        `rope_scaling: null`); the engines serve whichever the head's config.json says.
        MLA layer: a DeepSeek/Kimi target's own MLA dimensions, for other targets DeepSeek-V3's proportions to the
        target's head dim (`_mla_defaults`); the target's YaRN (either family), as the published Kimi MLA head
        has it. Both engines serve an MLA head's scaling as DeepSeek YaRN whatever its type, so a llama3 or linear
        target's MLA head rotates plainly.
        """
        info = TargetInfo.of(_as_dict(target_hf_config))
        hf, family = info.text, info.family
        d = draft
        hidden = d.hidden_size or hf["hidden_size"]
        heads = d.num_attention_heads or hf["num_attention_heads"]
        if d.arch not in ARCH_DIMS:
            raise ValueError(f"unknown draft arch {d.arch!r}; choose one of {', '.join(ARCH_DIMS)}")
        kv_heads, head_dim, rope_scaling, mla = ARCH_DIMS[d.arch](d, hf, family, hidden, heads)
        num_layers = hf.get("num_hidden_layers")
        ids = target.aux_layer_ids or (default_layer_ids(num_layers) if num_layers else None)
        if ids and num_layers:
            validate_layer_ids(ids, num_layers, where="target.aux_layer_ids")
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=d.intermediate_size or hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=hf["hidden_size"],
            rms_norm_eps=d.rms_norm_eps or hf.get("rms_norm_eps") or 1e-5,
            rope_theta=rope_theta_of(hf),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings") or 8192,
            aux_layer_ids=list(ids) if ids else None,
            target={
                "path": target.path,
                "architectures": info.architectures or None,
                "model_type": hf.get("model_type"),
                "num_layers": num_layers,
            },
            hidden_act=hf.get("hidden_act") or "silu",
            features=d.features,
            arch=d.arch,
            fc_norm=d.fc_norm,
            norm_output=d.norm_output,
            num_layers=d.num_layers,
            image_inputs=getattr(d, "image_inputs", None),
            **mla,
        )

    def __post_init__(self) -> None:
        # A head saved before the scaling was normalised (or written by hand) rotates the same once it is.
        self.rope_scaling = normalise_rope(self.rope_scaling, self.max_position_embeddings)
        if self.num_layers < 1 or (self.num_layers > 1 and self.arch != "llama"):
            raise ValueError(f"num_layers={self.num_layers} with arch {self.arch!r}: a head has one layer or more, "
                             "and only the Llama layer stacks (SGLang's MLA head loads one)")

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: head_dim (Llama) or nope + rope (MLA)."""
        if self.arch == "mla":
            return int(self.qk_nope_head_dim or 0) + int(self.qk_rope_head_dim or 0)
        return self.head_dim

    def deepseek_config(self) -> DeepseekV3Config:
        """The MLA layer's dimensions and RoPE as DeepSeek-V3 spells them (for transformers' YaRN rotary)."""
        rope = transformers_rope(self.rope_scaling, self.rope_theta, mla=True)
        return DeepseekV3Config(
            hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope, rope_interleave=True, vocab_size=self.vocab_size, num_hidden_layers=1,
        )

    def llama_config(self) -> LlamaConfig:
        """The equivalent one-layer Llama config (for transformers' RoPE and MLP modules)."""
        rope = transformers_rope(self.rope_scaling, self.rope_theta, mla=False)
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            hidden_act=self.hidden_act,
            rope_parameters=rope,
        )

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}


class Eagle3Attention(nn.Module):
    """The Llama layer's attention: q/k/v over the 2H input, GQA, neox-style RoPE (transformers' Llama rotary)."""

    def __init__(self, c: Eagle3DraftConfig, width: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if self.n_heads % self.n_kv:
            raise ValueError(f"num_attention_heads={self.n_heads} must be a multiple of num_key_value_heads={self.n_kv}")
        width = width or 2 * c.hidden_size  # the first layer's [embed | feature]; a stacked layer's stream is H
        self.q_proj = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(c.llama_config())
        self.scale = self.head_dim**-0.5
        self.v_dim = self.head_dim

    def qkv(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v


class MLAAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention over the 2H input, as SGLang's `Eagle3DeepseekV2ForCausalLM` and
    vLLM's `deepseek_eagle3` compute it (their fused q_a/kv_a and split kv_b are the same weights re-laid):

        q = q_b(q_a_layernorm(q_a(x)))            -> per head [nope | rope]
        c, k_pe = kv_a_proj_with_mqa(x)           -> [kv_lora | rope]; k_pe is one head shared by all heads
        k_nope, v = kv_b(kv_a_layernorm(c))       -> per head [nope | v]
        interleaved (GPT-J) RoPE on q's rope part and k_pe; softmax scale qk_head_dim**-0.5 times YaRN's mscale**2

    Values are zero-padded to the query width so that one SDPA kernel (and the TTT's sink trick, which appends
    channels to q, k and v alike) serves both layers; `after_attention` drops the padding before o_proj.
    """

    def __init__(self, c: Eagle3DraftConfig):
        super().__init__()
        if not (c.q_lora_rank and c.kv_lora_rank and c.qk_nope_head_dim and c.qk_rope_head_dim and c.v_head_dim):
            raise ValueError("the MLA layer needs q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and "
                             "v_head_dim (SGLang's MLA head requires q_lora_rank)")
        self.n_heads = self.n_kv = c.num_attention_heads
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.head_dim = self.nope + self.rope
        self.kv_lora = c.kv_lora_rank
        two_h = 2 * c.hidden_size
        self.q_a_proj = nn.Linear(two_h, c.q_lora_rank, bias=False)
        self.q_a_layernorm = LlamaRMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(two_h, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = LlamaRMSNorm(self.kv_lora, eps=c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, c.hidden_size, bias=False)
        ds = c.deepseek_config()
        self.rotary_emb = DeepseekV3RotaryEmbedding(ds)
        self.scale = yarn_apply_mscale(ds.rope_parameters, self.head_dim**-0.5)

    def qkv(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, s, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, s, self.n_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        cos, sin = self.rotary_emb(x, position_ids)
        q_pe, k_pe = apply_rotary_pos_emb_interleave(q_pe, k_pe[:, None], cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.n_heads, -1, -1)], dim=-1)
        return q, k, F.pad(v, (0, self.head_dim - self.v_dim))


ATTENTIONS: dict[str, type[Eagle3Attention] | type[MLAAttention]] = {"llama": Eagle3Attention, "mla": MLAAttention}
"""draft.arch -> the decoder layer's attention (its dimensions: ARCH_DIMS)."""
if not set(get_args(DraftArch)) == set(ATTENTIONS) == set(ARCH_DIMS):
    raise RuntimeError(f"draft.arch's choices {get_args(DraftArch)}, ATTENTIONS and ARCH_DIMS must name the same layers")


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, c: Eagle3DraftConfig, llama: LlamaConfig):
        super().__init__()
        if c.arch not in ATTENTIONS:
            raise ValueError(f"unknown draft arch {c.arch!r}; choose one of {', '.join(ATTENTIONS)}")
        self.self_attn: Eagle3Attention | MLAAttention = ATTENTIONS[c.arch](c)
        self.mlp = LlamaMLP(llama)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class StackedLayer(nn.Module):
    """A layer after the first (`draft.num_layers` > 1): a pre-norm Llama layer on the residual stream. Its one
    norm before attention is `input_layernorm` here and in vLLM, `hidden_norm` in SGLang (`draft_state_dict`
    writes both)."""

    def __init__(self, c: Eagle3DraftConfig, llama: LlamaConfig):
        super().__init__()
        self.self_attn = Eagle3Attention(c, width=c.hidden_size)
        self.mlp = LlamaMLP(llama)
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)


def stacked_norm_aliases(num_layers: int) -> dict[str, str]:
    """SGLang's name of each stacked layer's pre-attention norm -> eagle3's (= vLLM's)."""
    return {f"layers.{i}.hidden_norm.weight": f"layers.{i}.input_layernorm.weight" for i in range(1, num_layers)}


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3DraftConfig, embed_weight: Tensor | None = None):
        super().__init__()
        c = self.config = config
        if c.hidden_size != c.target_hidden_size and embed_weight is not None and embed_weight.shape[1] != c.hidden_size:
            raise ValueError(
                f"the draft uses the target's embeddings, so hidden_size ({c.hidden_size}) must equal the "
                f"embedding width ({embed_weight.shape[1]}); leave draft.hidden_size unset"
            )
        llama = c.llama_config()
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(c.target_hidden_size, eps=c.rms_norm_eps) for _ in range(3))
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(c, llama)
        if c.num_layers > 1:
            self.layers = nn.ModuleDict({str(i): StackedLayer(c, llama) for i in range(1, c.num_layers)})
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        # The target's embeddings: a frozen, non-persistent buffer (not a parameter: no grads, no optimizer
        # state, not in state_dict / checkpoints / the draft's files; 2.3 GB for Kimi-K2.5).
        self.embed_tokens = nn.Embedding(1, 1)
        del self.embed_tokens.weight
        self.embed_tokens.register_buffer("weight", torch.empty(0, c.hidden_size), persistent=False)
        if embed_weight is not None:
            self.set_embeddings(embed_weight)

    # ------------------------------------------------------------------------------------------ vocab, setup
    def set_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        c = self.config
        if d2t.shape != (c.draft_vocab_size,) or t2d.shape != (c.vocab_size,):
            raise ValueError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match the head "
                f"(draft_vocab_size={c.draft_vocab_size}, vocab_size={c.vocab_size})"
            )
        target_ids = torch.arange(c.draft_vocab_size) + d2t.cpu().long()
        mask = torch.zeros(c.vocab_size, dtype=torch.bool)
        mask[target_ids] = True
        if not torch.equal(mask, t2d.cpu().bool()):
            raise ValueError("vocab mapping: t2d does not mark exactly the target ids i + d2t[i]")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def set_embeddings(self, embed_weight: Tensor) -> None:
        c = self.config
        if tuple(embed_weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"embeddings of shape {tuple(embed_weight.shape)} do not fit the head (vocab_size={c.vocab_size}, "
                f"hidden_size={c.hidden_size})"
            )
        device = self.fc.weight.device
        self.embed_tokens.weight = embed_weight.detach().to(device)

    def init_from_target(self, lm_head_weight: Tensor, embed_weight: Tensor) -> None:
        """lm_head from the target lm_head's rows of the draft vocab (call `set_vocab` first); embeddings frozen."""
        ids = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight[ids.to(lm_head_weight.device)].to(self.lm_head.weight))
        self.set_embeddings(embed_weight)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    # ---------------------------------------------------------------------------------------------- forward
    def project(self, aux: Tensor) -> Tensor:
        """[..., 3H_target] fused target features -> [..., H]."""
        aux = aux.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(3, dim=-1), strict=True)], dim=-1)
        if self.config.features == "top":
            # Ablation: the low and mid thirds never reach fc (export zeroes their fc columns to match).
            keep = torch.zeros(aux.shape[-1], dtype=aux.dtype, device=aux.device)
            keep[2 * (aux.shape[-1] // 3):] = 1
            aux = aux * keep
        return self.fc(aux)

    def embed(self, input_ids: Tensor, extra: Tensor | None = None) -> Tensor:
        """Token embeddings; with `extra` [N, H], id `vocab + k` embeds as `extra[k]`: how the target's merged
        input embeddings reach the head at image positions (draft.image_inputs=target-embeddings, SGLang's
        convention) while the ids still shift like tokens through the training-time test."""
        w = self.embed_tokens.weight
        if w.shape[0] == 0:
            raise RuntimeError("the draft has no token embeddings: pass embed_weight or call set_embeddings()")
        if extra is None:
            return F.embedding(input_ids, w)
        v = w.shape[0]
        out = F.embedding(input_ids.clamp(max=v - 1), w)
        at = input_ids >= v
        return out.masked_scatter(at[..., None], extra.to(out.dtype)[input_ids[at] - v])

    def attention_inputs(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor,
                         extra: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, heads, S, D], k and v [B, kv_heads, S, D] (RoPE applied) for tokens + features at positions;
        D is the query width (MLA's values are zero-padded to it, see MLAAttention). `extra`: see `embed`."""
        layer = self.midlayer
        emb = self.embed(input_ids, extra).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        return layer.self_attn.qkv(x, position_ids)

    @property
    def attn_scale(self) -> float:
        return self.midlayer.self_attn.scale

    def after_attention(self, hidden: Tensor, attn_out: Tensor) -> Tensor:
        """`block` on attention output [B, heads, S, D]: the pre-`norm` output hidden [B, S, H]."""
        b, _, s, _ = attn_out.shape
        return self.block(hidden, attn_out.transpose(1, 2).reshape(b, s, -1))

    def block(self, hidden: Tensor, attn_flat: Tensor) -> Tensor:
        """Residual (the feature) + o_proj(attention [..., heads*D]), then the MLP block: the pre-`norm` output."""
        layer = self.midlayer
        attn = layer.self_attn
        if attn.v_dim != attn.head_dim:  # MLA: drop the values' zero padding
            attn_flat = attn_flat.unflatten(-1, (attn.n_heads, attn.head_dim))[..., : attn.v_dim].flatten(-2)
        h = hidden + attn.o_proj(attn_flat)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def layer_inputs(self, i: int, input_ids: Tensor, hidden: Tensor, position_ids: Tensor,
                     extra: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """`attention_inputs` of layer i: the first takes tokens + features, a stacked one the stream `hidden`."""
        if i == 0:
            return self.attention_inputs(input_ids, hidden, position_ids, extra=extra)
        layer = self.layers[str(i)]
        return layer.self_attn.qkv(layer.input_layernorm(hidden), position_ids)

    def layer_block(self, i: int, hidden: Tensor, attn_flat: Tensor) -> Tensor:
        """`block` of layer i: its residual input + o_proj(attention), then its MLP block."""
        if i == 0:
            return self.block(hidden, attn_flat)
        layer = self.layers[str(i)]
        h = hidden + layer.self_attn.o_proj(attn_flat)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def handoff(self, out_hidden: Tensor) -> Tensor:
        """The hidden the next draft step receives: pre-`norm`, or post-`norm` with EAGLE-3.1's `norm_output`."""
        return self.norm(out_hidden) if self.config.norm_output else out_hidden

    def logits(self, out_hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(out_hidden))

    def forward(self, aux: Tensor, input_ids: Tensor, rows: TTTPlan, attention: Attention = "fast",
                head: Callable[[list[Tensor], Tensor], Any] | None = None, over: LocalAttention | None = None,
                checkpoint: bool = False, extra: Tensor | None = None, positions: Tensor | None = None) -> Any:
        """Training: the TTT unroll over `rows` (`ttt_unroll_rows` below) -> head(final-normed scored rows of
        each step, lm_head weight); without `head`, each step's logits. Lives in `forward`, the head included,
        so that DDP/FSDP wrappers see the whole computation (their gradient hooks need the call to go through
        them, and FSDP holds the unsharded lm_head weight only inside it). The trainer's head is the fused,
        chunked lm_head + loss (eagle3.loss.SoftCE), which never holds a step's [rows, draft_vocab] logits.
        `over`: a sequence-parallel group's attention (eagle3.sequence_parallel) when `rows` plans this rank's share
        of the positions; `checkpoint`: recompute each TTT step's layer in the backward (train.activation_checkpointing);
        `extra`: the embeddings of ids past the vocab (`embed`); `positions`: [B, window] RoPE positions where they
        are not the token index (`ttt_unroll_rows`)."""
        states = ttt_unroll_rows(self, self.project(aux), input_ids, rows, attention, over or LOCAL, checkpoint,
                                 extra, positions)
        if head is None:
            return [self.lm_head(x) for x in states]
        return head(states, self.lm_head.weight)

    def decode(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        past_kv: KVCache | None,
        attn_mask: Tensor | None = None,
        extra: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, KVCache]:
        """One incremental draft forward over S new positions, through every layer.

        past_kv: one (keys, values) per layer, each [B, kv_heads, K, head_dim] (keys post-RoPE); the returned cache
        is past + this call's. attn_mask: bool [B, S, K_total] over past+new keys (True = may attend), the same for
        every layer; None = every past key plus causal among the new ones. Returns (the hidden the next step
        receives [B,S,H] (`handoff`), logits [B,S,draft_vocab], the cache). `extra`: see `embed`.
        """
        if past_kv is not None and len(past_kv) != self.num_layers:
            raise ValueError(f"past_kv holds {len(past_kv)} layers' keys; the head has {self.num_layers}")
        h, cache = hidden, []
        for i in range(self.num_layers):
            q, k, v = self.layer_inputs(i, input_ids, h, position_ids, extra)
            if past_kv is not None:
                k = torch.cat([past_kv[i][0].to(k.dtype), k], dim=2)
                v = torch.cat([past_kv[i][1].to(v.dtype), v], dim=2)
            s, total = q.shape[2], k.shape[2]
            n_rep = q.shape[1] // k.shape[1]
            if attn_mask is None:
                mask: Any = causal_lower_right(s, total)
            else:
                if attn_mask.shape != (q.shape[0], s, total):
                    raise ValueError(f"attn_mask must be [B, S, K_total] = {(q.shape[0], s, total)}, got "
                                     f"{tuple(attn_mask.shape)}")
                mask = attn_mask[:, None].bool()
            out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask,
                                                 scale=self.attn_scale)
            b, _, s, _ = out.shape
            h = self.layer_block(i, h, out.transpose(1, 2).reshape(b, s, -1))
            cache.append((k, v))
        return self.handoff(h), self.logits(h), tuple(cache)

    # --------------------------------------------------------------------------------------------- save/load
    def draft_state_dict(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The engine-named tensors (no embeddings, no RoPE cache), contiguous, d2t int64, t2d bool."""
        sd = state_dict if state_dict is not None else self.state_dict()
        out = {k: v.detach().contiguous() for k, v in sd.items() if not k.startswith(("embed_tokens", "rotary_emb"))}
        for sglang_name, name in stacked_norm_aliases(self.num_layers).items():
            out[sglang_name] = out[name].clone()
        out["d2t"] = out["d2t"].to(torch.int64)
        out["t2d"] = out["t2d"].to(torch.bool)
        return out
