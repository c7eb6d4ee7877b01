"""The HF transformers target backend: any causal LM in-process, states captured with forward hooks.

Why hooks and not `output_hidden_states`: hooks keep only the three requested layers (not all L+1 tensors), and
they state eagle3's convention literally: id k = the tensor *entering* decoder layer k (a forward pre-hook on
layer k). The final state is the output of the final norm, i.e. what the lm_head reads. The lm_head itself is
never run: for Kimi-K2.5 the [T, 163840] logits would cost more than the rest of the capture.

Kimi-K2.5 ships as a multimodal wrapper (`KimiK25ForConditionalGeneration`, LLM config in `text_config`, weights
prefixed `language_model.`); the LLM is a plain DeepseekV3ForCausalLM, so it is built from `text_config` and
loaded with the prefix stripped. No remote code is needed for extraction.

Image samples (`HFTarget(..., images=True)`) need the whole vision-language model: transformers' image-text-to-text
class (Kimi-K2.5's native `Kimi_K25ForConditionalGeneration`, Qwen2.5-VL), whose base model merges the vision
projector's outputs into the input embeddings at the image tokens and runs its LLM with that family's positions
(Qwen2.5-VL's 3-D M-RoPE from `mm_token_type_ids`; Kimi's stay 1-D). The hooks sit on that LLM's layers as before.
"""

from __future__ import annotations

import inspect
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3 import threads
from eagle3.batching import plan_batches
from eagle3.bundled import resolve_target_path
from eagle3.precision import DTYPES
from eagle3.targets.base import Captured
from eagle3.targets.info import llm_config, read_target_info

if TYPE_CHECKING:
    from eagle3.config import ExtractConfig, TargetConfig
    from eagle3.data.images import VisionInputs


def load_causal_lm(path: str, dtype: torch.dtype, device: str = "cpu", trust_remote_code: bool = False,
                   revision: str | None = None) -> torch.nn.Module:
    """Load a causal LM for inference; a Kimi-style wrapper loads just its `language_model.*` LLM, and a
    compressed-tensors pack-quantized one (Kimi-K2.5's INT4 experts) goes through eagle3.targets.quantized, which
    needs no `compressed-tensors` package and keeps the experts packed."""
    from transformers import AutoModelForCausalLM

    from eagle3.targets.quantized import load_pack_quantized, pack_scheme

    info = read_target_info(path)
    if pack_scheme(info.text) is not None:
        return load_pack_quantized(info, dtype, device).eval().requires_grad_(False)
    kw: dict[str, Any] = {"dtype": dtype, "revision": revision}
    if device == "auto":
        kw["device_map"] = "auto"
    if info.wrapped:
        config = llm_config(info)
        model_cls = AutoModelForCausalLM._model_mapping[type(config)]
        model = model_cls.from_pretrained(path, config=config, key_mapping={r"^language_model\.": ""}, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kw)
    if device != "auto":
        model.to(device)
    return model.eval().requires_grad_(False)


def load_vision_lm(path: str, dtype: torch.dtype, device: str = "cpu", trust_remote_code: bool = False,
                   revision: str | None = None) -> torch.nn.Module:
    """The whole vision-language model (vision tower, projector, LLM) for inference on image samples."""
    from transformers import AutoModelForImageTextToText

    from eagle3.targets.quantized import pack_scheme

    if pack_scheme(read_target_info(path).text) is not None:
        raise NotImplementedError(f"{path}: image samples through a pack-quantized (INT4) checkpoint are not "
                                  "supported by the HF backend; extract them with the SGLang backend")
    kw: dict[str, Any] = {"dtype": dtype, "revision": revision, "trust_remote_code": trust_remote_code}
    if device == "auto":
        kw["device_map"] = "auto"
    model = AutoModelForImageTextToText.from_pretrained(path, **kw)
    if device != "auto":
        model.to(device)
    return model.eval().requires_grad_(False)


def vision_forward_inputs(model: torch.nn.Module, vision: VisionInputs, ids: torch.Tensor, refs: list[str],
                          dtype: torch.dtype, device: str | torch.device) -> dict[str, Any]:
    """What a vision-language model's forward takes beside `ids` for the images `refs` (in the order of their image
    tokens, row-major over a batch, as the base model scatters them): the processor's tensors, and Qwen2.5-VL's
    token types, without which its LLM silently falls back to 1-D positions. Extraction and evaluation both use it."""
    n_tokens = int((ids == vision.image_token_id).sum())
    if not refs:
        if n_tokens:
            raise ValueError(f"{n_tokens} image tokens in a batch without images")
        return {}
    inputs = {k: v.to(device) for k, v in vision.inputs(refs).items()}
    if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    vlm_base = model.model
    if "mm_token_type_ids" in inspect.signature(vlm_base.forward).parameters:
        inputs["mm_token_type_ids"] = (ids == vision.image_token_id).long().to(device)
    if hasattr(vlm_base, "rope_deltas"):
        vlm_base.rope_deltas = None  # Qwen2.5-VL keeps the last batch's position offsets between calls
    return inputs


def mrope_positions(vlm_base: torch.nn.Module, ids: torch.Tensor, extra: dict[str, Any],
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """[B, T]: the temporal row of an M-RoPE model's positions for `ids` with the image inputs `extra`
    (`vision_forward_inputs`), as the model's own get_rope_index computes them: the positions vLLM gives an EAGLE-3
    draft of such a target (eagle3.specdec `_positions`). None for 1-D positions (Kimi-K2.5) or a batch without
    images. Index arithmetic only: `vlm_base` may live on the meta device (eagle3.targets.sglang)."""
    if not extra or not hasattr(vlm_base, "get_rope_index"):
        return None
    if "mm_token_type_ids" not in extra:  # never a silent fall back to the index, which vLLM does not draft at
        raise RuntimeError(f"{type(vlm_base).__name__}.forward takes no mm_token_type_ids in this transformers "
                           "version: eagle3 cannot compute its M-RoPE positions (tested with transformers 5.19-5.25)")
    positions, _ = vlm_base.get_rope_index(ids, extra["mm_token_type_ids"], image_grid_thw=extra.get("image_grid_thw"),
                                           attention_mask=attention_mask)
    return positions[0]


class MetaPositions:
    """`mrope_positions` for prompts whose target runs elsewhere (an SGLang server): the target's VLM base built on
    the meta device (no weights, no memory) computes them from the ids and the processor's image grids."""

    def __init__(self, folder: str | Path, vision: VisionInputs):
        from transformers import AutoConfig, AutoModel

        with torch.device("meta"):
            self.base = AutoModel.from_config(AutoConfig.from_pretrained(folder))
        self.vision = vision
        self._grids: dict[str, torch.Tensor] = {}

    def _grid(self, ref: str) -> torch.Tensor:
        """An image's (t, h, w) patch grid, by reference: the processor's work, done once per picture."""
        if ref not in self._grids:
            self._grids[ref] = self.vision.inputs([ref])["image_grid_thw"][0]
        return self._grids[ref]

    def __call__(self, ids: list[int], images: list[str]) -> torch.Tensor | None:
        """[T] for a prompt with pictures; None for one without (its positions are the index)."""
        if not images:
            return None
        t = torch.tensor([ids])
        extra = {"mm_token_type_ids": (t == self.vision.image_token_id).long(),
                 "image_grid_thw": torch.stack([self._grid(r) for r in images])}
        positions = mrope_positions(self.base, t, extra)
        return None if positions is None else positions[0]


def load_target(t: TargetConfig, images: bool = False) -> tuple[torch.nn.Module, Any]:
    """The configured HF target (Kimi-style wrappers included) and its tokenizer: the one way every stage that
    runs the target in this process (evaluation, regeneration, the vLLM reference) loads it; with `images`, the
    whole vision-language model (its vision tower runs on image prompts)."""
    from eagle3.data.templates import load_tokenizer

    path = resolve_target_path(t.path)
    load = load_vision_lm if images or _vision_only(path) else load_causal_lm
    model = load(path, DTYPES[t.dtype], t.device, t.trust_remote_code, t.revision)
    return model, load_tokenizer(t)


def _vision_only(path: str) -> bool:
    """A wrapped target whose LLM alone has no causal-LM class in transformers (Qwen2.5-VL's text config): text
    prompts, too, run through the whole vision-language model."""
    from transformers import AutoModelForCausalLM

    info = read_target_info(path)
    if not info.wrapped or "vision_config" not in info.config:
        return False
    try:
        return type(llm_config(info)) not in AutoModelForCausalLM._model_mapping
    except (KeyError, ValueError):
        return True


def eos_ids(tokenizer: Any, generation_config: Any) -> list[int]:
    """The ids decoding stops at: the tokenizer's eos plus the generation config's (SmolLM2's differ, and vLLM by
    itself uses only the tokenizer's). The built-in evaluator, regeneration and the vLLM/SGLang checks all stop at
    this set, or their τ would not compare."""
    ids: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(x) for x in src)
    return sorted(ids)


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.Module]:
    """(base model, decoder layers, final norm) of a CausalLM: the usual HF layout `model.model.{layers,norm}`,
    or a multimodal wrapper's `language_model` holding it. Extraction and evaluation both hook these."""
    inner = getattr(model, "model", None)
    wrapped = getattr(model, "language_model", None)
    for base in (inner, getattr(inner, "language_model", None), getattr(wrapped, "model", None), model.base_model):
        layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
        if isinstance(layers, torch.nn.ModuleList) and norm is not None:
            return base, layers, norm
    raise ValueError(f"{type(model).__name__}: expected the base model to expose `.layers` and `.norm` "
                     "(the usual HF decoder layout); this architecture is not supported")


def on_llm_inputs(llm: torch.nn.Module, sink: Any) -> Any:
    """Hand `sink` the input embeddings [B, T, H] each forward of a vision-language model's LLM gets (the token
    embeddings with the pictures merged in: what SGLang feeds its draft at image tokens); returns the hook's handle.
    Extraction and evaluation both read them through it."""
    return llm.register_forward_pre_hook(lambda _m, _a, kw: sink(kw["inputs_embeds"]), with_kwargs=True)


class LayerTap:
    """Forward pre-hooks on the decoder layers of `layer_ids`, keeping each layer's *input* (eagle3's id k = the
    input of layer k = HF hidden_states[k]), and a forward hook on the final norm when given (the post-norm state
    the lm_head reads). `active = False` lets forwards run without keeping anything.

    By default the hooks keep references, not copies (each layer returns a new residual tensor and nothing writes
    in place): right for the evaluator's few-token forwards. With `copy_to` (extraction) each state is written,
    as its hook fires, into its third of one [..., 3H] tensor on that device: the layer's input is then freed as
    the forward moves on, no concatenation or second copy is ever made, and a GPU target hands its states to
    the host while it computes the rest (a 32K-token sample holds one copy of its states, never four)."""

    def __init__(self, layers: torch.nn.ModuleList, layer_ids: list[int], norm: torch.nn.Module | None = None,
                 copy_to: str | torch.device | None = None):
        bad = [k for k in layer_ids if not 0 <= k < len(layers)]
        if bad:
            raise ValueError(f"aux layer ids {bad} outside the target's {len(layers)} decoder layers")
        self.layer_ids = list(layer_ids)
        self.states: dict[int | str, torch.Tensor] = {}
        self.copy_to = None if copy_to is None else torch.device(copy_to)
        self.active = True
        self._handles = [layers[k].register_forward_pre_hook(self._pre_hook(k), with_kwargs=True) for k in layer_ids]
        if norm is not None:
            self._handles.append(norm.register_forward_hook(self._norm_hook))

    def _pre_hook(self, k: int):
        slot = self.layer_ids.index(k)

        def hook(_module, args, kwargs):
            if not self.active:
                return
            x = args[0] if args else kwargs["hidden_states"]
            if self.copy_to is None:
                self.states[k] = x
                return
            out = self.states.get("aux")
            h = x.shape[-1]
            if slot == 0 or out is None:  # the first tapped layer of a forward: this forward's own tensor
                out = self.states["aux"] = torch.empty(*x.shape[:-1], len(self.layer_ids) * h, dtype=x.dtype,
                                                       device=self.copy_to)
            out[..., slot * h:(slot + 1) * h].copy_(x)
            self.states[k] = out  # the hook fired; the state itself lives in `out`

        return hook

    def _norm_hook(self, _module, _args, output):
        if self.active:
            self.states["final"] = output if self.copy_to is None else output.to(self.copy_to)

    def aux(self) -> torch.Tensor:
        """[..., 3H]: the kept layer inputs concatenated in `layer_ids` order."""
        missing = [k for k in self.layer_ids if k not in self.states]
        if missing:
            raise RuntimeError(f"hooks did not fire for layers {missing}: the model skipped those modules")
        if self.copy_to is not None:
            return self.states["aux"]
        return torch.cat([self.states[k] for k in self.layer_ids], dim=-1)

    def final(self) -> torch.Tensor:
        if "final" not in self.states:
            raise RuntimeError("the final norm's hook did not fire: the model skipped it")
        return self.states["final"]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class HFTarget:
    """TargetBackend over an in-process transformers model."""

    name = "hf"

    def __init__(self, target: TargetConfig, extract: ExtractConfig, images: bool = False):
        """`images`: the samples hold images: the whole vision-language model is loaded, with its processor."""
        self.path = resolve_target_path(target.path)
        self.dtype = DTYPES[target.dtype]
        self.vision: VisionInputs | None = None
        if images:
            from eagle3.data.images import VisionInputs

            self.vision = VisionInputs.required(target)
            self.model = load_vision_lm(self.path, self.dtype, target.device, target.trust_remote_code,
                                        target.revision)
            self.config = self.model.config.get_text_config()
        else:
            self.model = load_causal_lm(self.path, self.dtype, target.device, target.trust_remote_code,
                                        target.revision)
            self.config = self.model.config
        info = read_target_info(self.path)
        self.architectures: list[str] = info.architectures
        self.model_type: str = info.model_type
        self.base, self.layers, self.norm = decoder_parts(self.model)
        self.num_layers = len(self.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        self.layer_ids = target.layer_ids(self.num_layers)
        self.batch_tokens = extract.batch_tokens
        self.max_batch_size = extract.max_batch_size
        self.device = next(self.model.parameters()).device
        self.tap = LayerTap(self.layers, self.layer_ids, self.norm, copy_to="cpu")
        # One forward at a time: the hooks keep one set of states, and online training captures from two prefetch
        # threads at once (train batches, and the eval batches at an eval step).
        self._lock = threading.Lock()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The loaded model's lm_head [V, H] (eagle3.targets.argmax.ArgmaxHead uses it rather than a second copy)."""
        return self.model.get_output_embeddings().weight

    def _vision_inputs(self, ids: torch.Tensor, images: list[list[str]]) -> dict[str, Any]:
        assert self.vision is not None
        return vision_forward_inputs(self.model, self.vision, ids, [r for rs in images for r in rs], self.dtype,
                                     self.device)

    @torch.inference_mode()
    def _forward(self, seqs: list[list[int]], images: list[list[str]] | None = None) -> list[Captured]:
        lengths = [len(s) for s in seqs]
        T = max(lengths)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            mask[j, : len(s)] = 1
        # Right padding + causal attention: real tokens never see pads; pads are cut off below.
        attn = None if min(lengths) == T else mask.to(self.device)
        self.tap.states.clear()
        extra = self._vision_inputs(ids, images or [[] for _ in seqs]) if self.vision is not None else {}
        if self.vision is None and images and any(images):
            raise ValueError("samples with images need HFTarget(..., images=True)")
        merged: dict[str, torch.Tensor] = {}
        hook = None
        if self.vision is not None:  # the LLM's input: the token embeddings with the pictures merged in
            hook = on_llm_inputs(self.base, lambda x: merged.__setitem__("embeds", x))
        try:
            base = self.model.model if self.vision is not None else self.base  # the VLM's base merges the images
            base(input_ids=ids.to(self.device), attention_mask=attn, use_cache=False, **extra)
            aux, final = self.tap.aux(), self.tap.final()  # on the host already, one copy each
            # Each sequence's rows are a contiguous view of the batch's states (no third copy); they are written
            # and dropped together.
            caps = [Captured(aux=aux[j, :n], final=final[j, :n]) for j, n in enumerate(lengths)]
            if self.vision is not None:
                at = ids == self.vision.image_token_id
                positions = mrope_positions(base, ids.to(self.device), extra, attn)
                for j, c in enumerate(caps):
                    c.image_embeds = merged["embeds"][j][at[j].to(self.device)].to("cpu")
                    if positions is not None and at[j].any():  # a text sample's are the index
                        c.positions = positions[j, :lengths[j]].to("cpu")
            return caps
        finally:
            self.tap.states.clear()
            if hook is not None:
                hook.remove()

    def capture(self, sequences: list[list[int]], images: list[list[str]] | None = None) -> list[Captured]:
        """States for every token of every sequence, in input order, computed in length-sorted batches; `images`: each
        sequence's images (eagle3.data.images references), in the order of its image tokens."""
        if any(len(s) == 0 for s in sequences):
            raise ValueError("cannot capture states of an empty sequence")
        out: list[Captured | None] = [None] * len(sequences)
        for batch in plan_batches([len(s) for s in sequences], self.batch_tokens, self.max_batch_size):
            with self._lock:
                threads.adjust()  # in the thread that runs the forward (online capture runs in its own)
                caps = self._forward([sequences[i] for i in batch],
                                     None if images is None else [images[i] for i in batch])
            for i, c in zip(batch, caps, strict=True):
                out[i] = c
        for s, c in zip(sequences, out, strict=True):
            assert c is not None and c.aux.shape[0] == len(s), "token count mismatch in captured states"
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.tap.close()
