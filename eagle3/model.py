"""The EAGLE-3 draft head, laid out exactly as SGLang and vLLM load it (`LlamaForCausalLMEagle3`).

    fc: Linear(3*H_target -> H)              fuses the target's low/mid/high residual streams
    midlayer: one Llama decoder layer whose attention input is
        cat(input_layernorm(embed(token)), hidden_norm(feature))   (q/k/v take 2H; the residual is the feature)
    norm -> lm_head: H -> draft_vocab
    d2t int64 [draft_vocab] (target id = i + d2t[i]), t2d bool [target_vocab]
    embed_tokens: the target's embeddings, frozen, never saved in the draft's files

Parameter names are the engines' own, so `save_pretrained` writes a folder an engine could read as-is (the
export only adds the engine's config spelling). The attention pieces are exposed separately
(`attention_inputs` / `after_attention`) because the training-time test attends over keys from several
unrolled steps with its own fast kernel (`ttt_unroll_rows`, at the end of this file), while `decode` is the
incremental KV-cache path that the evaluator uses for chain and tree drafting.

Training-time test: step j's input at position t is (the step j-1 output hidden, token x_{t+1+j}) at RoPE
position t+j (the alignment and which positions are computed: eagle3.rows). Attention at step j: the causal
prefix of step-0 keys (positions 0..t) plus the same position's keys from steps 1..j (its own included), as the
engine's KV cache holds them when drafting j tokens ahead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from eagle3.layer_ids import LAYER_ID_CONVENTION, ArchFamily, Engine, arch_family, from_engine_ids
from eagle3.rows import Rows, every_row, shift_tokens
from eagle3.targets.info import TargetInfo

log = logging.getLogger("eagle3")

FORMAT = "eagle3-draft"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
KV = tuple[Tensor, Tensor]
Attention = Literal["fast", "dense"]


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if hf_config is None:
        return {}
    if isinstance(hf_config, dict):
        return dict(hf_config)
    return hf_config.to_dict()


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    """A non-default RoPE type (e.g. Llama-3.1's `llama3`) without `rope_theta`; None for plain RoPE."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or None
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    return {k: v for k, v in scaling.items() if k != "rope_theta"}


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

    @classmethod
    def from_target(cls, cfg: Any, target_hf_config: Any, draft_vocab_size: int) -> Eagle3DraftConfig:
        """Dimensions from the target's HF config, overridden by `cfg.draft.*`.

        Llama-style targets give heads / kv heads / head_dim directly. DeepSeek-style (MLA) targets such as
        Kimi-K2.5 have no Llama-sense kv heads or head_dim: the draft is a plain multi-head Llama layer, so
        kv heads = heads and head_dim = the target's `v_head_dim` (128 for Kimi-K2.5; 128 when absent) rather
        than hidden/heads (7168/64 = 112). Their YaRN scaling belongs to MLA's rope sub-dimension, so the draft
        uses its own plain RoPE with the target's rope_theta.
        """
        info = TargetInfo.of(_as_dict(target_hf_config))
        hf, family = info.text, info.family
        d = cfg.draft
        hidden = d.hidden_size or hf["hidden_size"]
        heads = d.num_attention_heads or hf["num_attention_heads"]
        if family == "deepseek":
            kv_heads = d.num_key_value_heads or heads
            head_dim = d.head_dim or hf.get("v_head_dim") or 128
            rope_scaling = None
        else:
            kv_heads = d.num_key_value_heads or hf.get("num_key_value_heads") or heads
            head_dim = d.head_dim or hf.get("head_dim") or hidden // heads
            rope_scaling = _rope_scaling(hf)
        num_layers = hf.get("num_hidden_layers")
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
            rope_theta=_rope_theta(hf),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings") or 8192,
            aux_layer_ids=cfg.layer_ids(num_layers) if num_layers else cfg.target.aux_layer_ids,
            target={
                "path": cfg.target.path,
                "architectures": info.architectures or None,
                "model_type": hf.get("model_type"),
                "num_layers": num_layers,
            },
            hidden_act=hf.get("hidden_act") or "silu",
            features=cfg.draft.features,
        )

    def llama_config(self) -> LlamaConfig:
        """The equivalent one-layer Llama config (for transformers' RoPE and MLP modules)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
            rope.setdefault("rope_type", rope.pop("type", "default"))
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
    def __init__(self, c: Eagle3DraftConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if self.n_heads % self.n_kv:
            raise ValueError(f"num_attention_heads={self.n_heads} must be a multiple of num_key_value_heads={self.n_kv}")
        self.q_proj = nn.Linear(2 * c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, c: Eagle3DraftConfig, llama: LlamaConfig):
        super().__init__()
        self.self_attn = Eagle3Attention(c)
        self.mlp = LlamaMLP(llama)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, n_kv, K, D] -> [B, n_kv*n_rep, K, D] (GQA: each kv head serves n_rep query heads)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


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
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(c, llama)
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(llama)
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
        if self.config.features == "top":
            # Ablation: the low and mid thirds never reach fc (export zeroes their fc columns to match).
            keep = torch.zeros(aux.shape[-1], dtype=aux.dtype, device=aux.device)
            keep[2 * (aux.shape[-1] // 3):] = 1
            aux = aux * keep
        return self.fc(aux)

    def embed(self, input_ids: Tensor) -> Tensor:
        w = self.embed_tokens.weight
        if w.shape[0] == 0:
            raise RuntimeError("the draft has no token embeddings: pass embed_weight or call set_embeddings()")
        return F.embedding(input_ids, w)

    def attention_inputs(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, heads, S, D], k and v [B, kv_heads, S, D] (RoPE applied) for tokens + features at positions."""
        layer = self.midlayer
        attn = layer.self_attn
        emb = self.embed(input_ids).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        b, s, _ = x.shape
        q = attn.q_proj(x).view(b, s, attn.n_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, s, attn.n_kv, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, s, attn.n_kv, attn.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def after_attention(self, hidden: Tensor, attn_out: Tensor) -> Tensor:
        """`block` on attention output [B, heads, S, D]: the pre-`norm` output hidden [B, S, H]."""
        b, _, s, _ = attn_out.shape
        return self.block(hidden, attn_out.transpose(1, 2).reshape(b, s, -1))

    def block(self, hidden: Tensor, attn_flat: Tensor) -> Tensor:
        """Residual (the feature) + o_proj(attention [..., heads*D]), then the MLP block: the pre-`norm` output."""
        layer = self.midlayer
        h = hidden + layer.self_attn.o_proj(attn_flat)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, out_hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(out_hidden))

    def forward(self, aux: Tensor, input_ids: Tensor, rows: Rows, attention: Attention = "fast",
                head: Callable[[list[Tensor], Tensor], Any] | None = None) -> Any:
        """Training: the TTT unroll over `rows` (`ttt_unroll_rows` below) -> head(final-normed scored rows of
        each step, lm_head weight); without `head`, each step's logits. Lives in `forward`, the head included,
        so that DDP/FSDP wrappers see the whole computation (their gradient hooks need the call to go through
        them, and FSDP holds the unsharded lm_head weight only inside it). The trainer's head is the fused,
        chunked lm_head + loss (eagle3.loss.SoftCE), which never holds a step's [rows, draft_vocab] logits."""
        states = ttt_unroll_rows(self, self.project(aux), input_ids, rows, attention)
        if head is None:
            return [self.lm_head(x) for x in states]
        return head(states, self.lm_head.weight)

    def decode(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        past_kv: KV | None,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, KV]:
        """One incremental draft forward over S new positions.

        kv tensors are [B, kv_heads, K, head_dim] (keys post-RoPE); the returned kv is past + this call's.
        attn_mask: bool [B, S, K_total] over past+new keys (True = may attend); None = every past key plus
        causal among the new ones. Returns (pre-norm output hidden [B,S,H], logits [B,S,draft_vocab], kv).
        """
        q, k, v = self.attention_inputs(input_ids, hidden, position_ids)
        if past_kv is not None:
            k = torch.cat([past_kv[0].to(k.dtype), k], dim=2)
            v = torch.cat([past_kv[1].to(v.dtype), v], dim=2)
        s, total = q.shape[2], k.shape[2]
        n_rep = self.config.num_attention_heads // self.config.num_key_value_heads
        if attn_mask is None:
            mask: Any = causal_lower_right(s, total)
        else:
            if attn_mask.shape != (q.shape[0], s, total):
                raise ValueError(f"attn_mask must be [B, S, K_total] = {(q.shape[0], s, total)}, got {tuple(attn_mask.shape)}")
            mask = attn_mask[:, None].bool()
        out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask)
        h = self.after_attention(hidden, out)
        return h, self.logits(h), (k, v)

    # --------------------------------------------------------------------------------------------- save/load
    def draft_state_dict(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The engine-named tensors (no embeddings, no RoPE cache), contiguous, d2t int64, t2d bool."""
        sd = state_dict if state_dict is not None else self.state_dict()
        out = {k: v.detach().contiguous() for k, v in sd.items() if not k.startswith(("embed_tokens", "rotary_emb"))}
        out["d2t"] = out["d2t"].to(torch.int64)
        out["t2d"] = out["t2d"].to(torch.bool)
        return out

    def save_pretrained(self, out_dir: str | Path, state_dict: dict[str, Tensor] | None = None,
                        dtype: torch.dtype | None = None) -> Path:
        """Write `config.json` (eagle3's own, `"format": "eagle3-draft"`) and `model.safetensors`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = self.draft_state_dict(state_dict)
        if dtype is not None:
            tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
        save_file({k: v.cpu() for k, v in tensors.items()}, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        (out / CONFIG_NAME).write_text(json.dumps(self.config.to_json(), indent=2) + "\n")
        return out

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        embed_weight: Tensor | None = None,
        *,
        engine: Engine | None = None,
        family: ArchFamily | None = None,
        aux_layer_ids: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Eagle3Draft:
        """Load an eagle3 draft folder, or an SGLang / vLLM (speculators) EAGLE-3 draft folder.

        Engine folders spell layer ids in the engine's convention. Top-level `eagle_aux_hidden_state_layer_ids`
        or a speculators config means vLLM (ids as-is); ids only under `eagle_config` are ambiguous (both engines
        read them, with different meanings), so the caller must say `engine=` (and `family=` for SGLang when
        the folder does not name the target). `aux_layer_ids` (eagle3 convention) overrides everything.
        """
        folder = Path(path)
        cfg_file = folder / CONFIG_NAME
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{folder}: no {CONFIG_NAME}; not a draft folder")
        raw = json.loads(cfg_file.read_text())
        config = _config_from_json(raw, cfg_file, engine=engine, family=family)
        if aux_layer_ids is not None:
            config.aux_layer_ids = list(aux_layer_ids)
        tensors = _read_weights(folder)
        tensors = _normalise_keys(tensors, folder)
        if embed_weight is None and "embed_tokens.weight" in tensors:
            embed_weight = tensors["embed_tokens.weight"]
        tensors.pop("embed_tokens.weight", None)
        if "d2t" not in tensors:
            if config.draft_vocab_size != config.vocab_size:
                raise ValueError(f"{folder}: no d2t tensor but draft_vocab_size != vocab_size")
            tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
            tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
        tensors["t2d"] = tensors["t2d"].bool()
        tensors["d2t"] = tensors["d2t"].long()
        model = cls(config).to(dtype)
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        missing = [m for m in missing if not m.startswith("rotary_emb")]
        if missing or unexpected:
            raise ValueError(f"{folder}: weights do not match the EAGLE-3 head: missing {missing}, unexpected {unexpected}")
        model.set_vocab(tensors["d2t"], tensors["t2d"])
        if embed_weight is not None:
            model.set_embeddings(embed_weight)
        return model


def _read_weights(folder: Path) -> dict[str, Tensor]:
    single = folder / WEIGHTS_NAME
    if single.is_file():
        return load_file(str(single))
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        out: dict[str, Tensor] = {}
        for s in shards:
            out.update(load_file(str(s)))
        return out
    binf = folder / "pytorch_model.bin"
    if binf.is_file():
        return torch.load(binf, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{folder}: no model.safetensors / *.safetensors / pytorch_model.bin")


def _normalise_keys(tensors: dict[str, Tensor], folder: Path) -> dict[str, Tensor]:
    """`layers.0.*` (vLLM / speculators) and `model.`-prefixed names -> the `midlayer.*` names."""
    out: dict[str, Tensor] = {}
    for k, v in tensors.items():
        name = k.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        elif name.startswith("layers."):
            raise ValueError(f"{folder}: tensor {k!r}: only one-layer EAGLE-3 heads are supported")
        out[name] = v
    return out


_ENGINE_FIELDS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def _config_from_json(raw: dict[str, Any], where: Path, *, engine: Engine | None,
                      family: ArchFamily | None) -> Eagle3DraftConfig:
    # eagle3's own folders, and eagle3's exports (which carry the full draft config under "eagle3").
    block = raw if raw.get("format") == FORMAT else raw.get("eagle3")
    if isinstance(block, dict) and block.get("format") == FORMAT:
        known = {f.name for f in dataclasses.fields(Eagle3DraftConfig)}
        return Eagle3DraftConfig(**{k: v for k, v in block.items() if k in known})
    # An engine's config: a Llama config (SGLang) or a speculators config wrapping one (vLLM).
    llama = raw.get("transformer_layer_config") or raw
    missing = [f for f in _ENGINE_FIELDS if f not in llama]
    if missing:
        raise ValueError(f"{where}: not an EAGLE-3 draft config (missing {missing})")
    heads = llama["num_attention_heads"]
    draft_vocab = raw.get("draft_vocab_size") or llama.get("draft_vocab_size")
    if draft_vocab is None:
        log.warning("%s: no draft_vocab_size; assuming the full target vocab (%d)", where, llama["vocab_size"])
        draft_vocab = llama["vocab_size"]
    eagle_cfg = raw.get("eagle_config") or {}
    ids: list[int] | None = None
    if "eagle3_aux_layer_ids" in raw:  # written by eagle3's export, already in eagle3's convention
        ids = list(raw["eagle3_aux_layer_ids"])
    elif raw.get("eagle_aux_hidden_state_layer_ids") is not None or raw.get("speculators_model_type"):
        engine_ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        ids = from_engine_ids(list(engine_ids), "vllm", "llama") if engine_ids else None
    elif eagle_cfg.get("eagle_aux_hidden_state_layer_ids") is not None:
        if engine is None:
            raise ValueError(
                f"{where}: layer ids {eagle_cfg['eagle_aux_hidden_state_layer_ids']} under eagle_config mean different "
                "layers for SGLang and vLLM; say which engine this folder was made for (engine='sglang'|'vllm')"
            )
        tgt = raw.get("target") or {}
        fam = family or (arch_family(tgt.get("architectures"), tgt.get("model_type")) if tgt else None)
        if engine == "sglang" and fam is None:
            raise ValueError(f"{where}: SGLang spells ids differently for Llama and DeepSeek targets; pass family=")
        ids = from_engine_ids(list(eagle_cfg["eagle_aux_hidden_state_layer_ids"]), engine, fam or "llama")
    else:
        log.warning("%s: the draft config names no aux layer ids; pass aux_layer_ids= to be sure", where)
    hidden = llama["hidden_size"]
    return Eagle3DraftConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=llama.get("num_key_value_heads") or heads,
        head_dim=llama.get("head_dim") or hidden // heads,
        intermediate_size=llama["intermediate_size"],
        vocab_size=llama["vocab_size"],
        draft_vocab_size=draft_vocab,
        target_hidden_size=raw.get("target_hidden_size") or llama.get("target_hidden_size") or hidden,
        rms_norm_eps=llama.get("rms_norm_eps") or 1e-5,
        rope_theta=_rope_theta(llama),
        rope_scaling=_rope_scaling(llama),
        max_position_embeddings=llama.get("max_position_embeddings") or 8192,
        aux_layer_ids=ids,
        hidden_act=llama.get("hidden_act") or "silu",
    )


# ---------------------------------------------------------------------------- training-time test
def _prefix_mask(q_pos: Tensor, t: int, sinks: int) -> Tensor:
    """Bool [B, 1, M, sinks + T]: query m (at position q_pos[b, m]) sees every sink and the keys 0..q_pos."""
    causal = torch.arange(t, device=q_pos.device) <= q_pos[..., None]  # [B, M, T]
    return F.pad(causal, (sinks, 0), value=True)[:, None]


def ttt_attention_fast(q: Tensor, k0: Tensor, v0: Tensor, ks: list[Tensor], vs: list[Tensor],
                       q_pos: Tensor | None = None) -> Tensor:
    """Exact TTT attention without a [T, (j+1)T] mask: one SDPA over the step-0 keys plus j "sink" keys.

    The j same-position scores d_i(t) = q_t . k_i,t are computed elementwise and appended to each query as
    extra channels; j shared sink keys (one-hot in those channels) then score exactly d_i(t) for query t, and
    their one-hot values report the softmax weight p_i(t) each sink received, normalised jointly with the
    step-0 causal keys. The output is SDPA's step-0 part plus sum_i p_i(t) v_i,t.
    q [B, nh, M, D]; k0, v0 [B, nkv, T, D]; each ks[i], vs[i] [B, nkv, M, D], aligned with q. q_pos [B, M]: the
    position of each query; None when the queries are positions 0..T-1 in order, which SDPA takes as a
    lower-right causal mask (sinks first, visible to every query) so flash kernels apply.
    """
    b, nh, m, d = q.shape
    t = k0.shape[2]
    n = len(ks)
    n_rep = nh // k0.shape[1]
    if n == 0:
        k, v = repeat_kv(k0, n_rep), repeat_kv(v0, n_rep)
        if q_pos is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_prefix_mask(q_pos, t, 0))
    dp = -(-(d + n) // 8) * 8  # padded head dim (kernels like multiples of 8)
    diag = torch.stack([(q * repeat_kv(k, n_rep)).sum(-1) for k in ks], dim=-1)  # [B, nh, M, n]
    q_aug = torch.cat([q, diag, q.new_zeros(b, nh, m, dp - d - n)], dim=-1)
    sinks = torch.zeros(n, dp, dtype=q.dtype, device=q.device)
    sinks[torch.arange(n), d + torch.arange(n)] = 1.0
    sinks = sinks.expand(b, k0.shape[1], n, dp)
    pad = (0, dp - d)
    k_aug = torch.cat([sinks, F.pad(k0, pad)], dim=2)
    v_aug = torch.cat([sinks, F.pad(v0, pad)], dim=2)
    mask = causal_lower_right(m, t + n) if q_pos is None else _prefix_mask(q_pos, t, n)
    out = F.scaled_dot_product_attention(q_aug, repeat_kv(k_aug, n_rep), repeat_kv(v_aug, n_rep), attn_mask=mask,
                                         scale=d**-0.5)
    result = out[..., :d]
    for i, v in enumerate(vs):
        result = result + out[..., d + i : d + i + 1] * repeat_kv(v, n_rep)
    return result


def ttt_attention_dense(q: Tensor, k0: Tensor, v0: Tensor, ks: list[Tensor], vs: list[Tensor],
                        q_pos: Tensor | None = None) -> Tensor:
    """Reference: all keys concatenated with an explicit [M, T + jM] mask (causal block + diagonal blocks)."""
    b, _, m, _ = q.shape
    t = k0.shape[2]
    n_rep = q.shape[1] // k0.shape[1]
    if q_pos is None:
        q_pos = torch.arange(m, device=q.device).expand(b, m)
    keys = torch.cat([k0, *ks], dim=2)
    values = torch.cat([v0, *vs], dim=2)
    eye = torch.eye(m, dtype=torch.bool, device=q.device).expand(b, 1, m, m)
    mask = torch.cat([_prefix_mask(q_pos, t, 0), *([eye] * len(ks))], dim=-1)
    return F.scaled_dot_product_attention(q, repeat_kv(keys, n_rep), repeat_kv(values, n_rep), attn_mask=mask)


def _rows(x: Tensor) -> Tensor:
    """[B, heads, T, D] -> [B*T, heads, D]."""
    return x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])


def ttt_unroll_rows(draft: Eagle3Draft, hidden0: Tensor, input_ids: Tensor, rows: Rows,
                    attention: Attention = "fast") -> list[Tensor]:
    """Final-normed output hidden [len(score[j]), H] of the scored rows of each unrolled step (the lm_head's
    input; see the module docstring).

    Step 0 computes keys and values at every position (they are every later query's prefix); everything else
    (queries, attention, the layer after it and the final norm) runs only on the rows in `rows`, each batch row's
    kept queries packed to the left and masked by their own positions.
    """
    attend = ttt_attention_fast if attention == "fast" else ttt_attention_dense
    b, t = input_ids.shape
    flat_pos = torch.arange(t, device=input_ids.device).repeat(b)
    keep = rows.keep[0]
    q, k0, v0 = draft.attention_inputs(shift_tokens(input_ids, 1), hidden0, flat_pos.view(b, t))
    out = attend(rows.pack(0, _rows(q)[keep]), k0, v0, [], [], rows.q_pos[0])
    hidden = draft.block(hidden0.reshape(b * t, -1)[keep], rows.unpack(0, out))  # [M0, H]
    states = [draft.norm(hidden[rows.score[0]])]
    ks: list[Tensor] = []  # step i's keys and values at the rows of keep[i] (i = 1, 2, ...)
    vs: list[Tensor] = []
    for j in range(1, rows.steps):
        keep = rows.keep[j]
        hidden = hidden[rows.parent[j]]
        ids = shift_tokens(input_ids, 1 + j).flatten()[keep]
        q, k, v = draft.attention_inputs(ids[None], hidden[None], (flat_pos[keep] + j)[None])
        ks.append(k[0].transpose(0, 1))
        vs.append(v[0].transpose(0, 1))
        at = [rows.within(i + 1, j) for i in range(len(ks))]
        out = attend(rows.pack(j, q[0].transpose(0, 1)), k0, v0, [rows.pack(j, x[w]) for x, w in zip(ks, at, strict=True)],
                     [rows.pack(j, x[w]) for x, w in zip(vs, at, strict=True)], rows.q_pos[j])
        hidden = draft.block(hidden, rows.unpack(j, out))
        states.append(draft.norm(hidden[rows.score[j]]))
    return states


def ttt_unroll(draft: Eagle3Draft, hidden0: Tensor, input_ids: Tensor, steps: int,
               attention: Attention = "fast") -> list[Tensor]:
    """Logits [B, T, draft_vocab] of every position at each of `steps` unrolled steps (the reference)."""
    b, t = input_ids.shape
    rows = every_row(b, t, steps, input_ids.device)
    return [draft.lm_head(x).view(b, t, -1) for x in ttt_unroll_rows(draft, hidden0, input_ids, rows, attention)]
