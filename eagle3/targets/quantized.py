"""Kimi-K2.5's INT4 checkpoint as the HF reference: compressed-tensors `pack-quantized` routed experts, read without
the `compressed-tensors` package and kept packed in memory.

    from eagle3.targets.hf import load_causal_lm
    model = load_causal_lm("/models/Kimi-K2.5", torch.bfloat16, "auto")  # config.json picks this loader

Why eagle3 reads these weights itself: transformers 5 holds a DeepseekV3 layer's routed experts as two fused 3-D
parameters (`experts.gate_up_proj` [E, 2I, H], gate rows then up rows; `experts.down_proj` [E, H, I]) while
Kimi-K2.5 stores each expert's three projections one by one (`...experts.{e}.{gate,up,down}_proj.weight_packed` /
`weight_scale` / `weight_shape`). transformers reads them only with the `compressed-tensors` package installed
(without it the load stops), and a fused parameter its conversion does not fill stays at random init:
`eagle3 verify-extraction` would then fail a good cache.
And dequantized, the routed experts are ~1.0 T parameters, 2 TB in bf16, twice what 8 H200s hold; packed they are
the ~0.57 TB the checkpoint is. So each MoE layer's experts stay packed (`PackedExperts`) and are dequantized one
expert at a time as the forward reaches them, in transformers' eager per-expert loop.

The format (compressed-tensors 0.12-0.20 `pack_to_int32` / `unpack_from_int32` / `dequantize`; Kimi-K2.5's
`text_config.quantization_config`: one config group, weights `type: int`, `num_bits: 4`, `strategy: group`,
`group_size: 32`, `symmetric: true`, no activation quantization; its `ignore` list keeps attention, shared
experts, the dense MLP and lm_head in bf16, so only routed experts are packed):
- `weight_packed` int32 [out, in * bits / 32]: a row's element j sits in word j // (32 / bits) at bit
  bits * (j % (32 / bits)), low bits first, stored unsigned as q + 2**(bits - 1) (q in [-8, 7] for 4 bits);
- `weight_scale` [out, in / group_size] (bf16): weight = q * the scale of its group of columns, computed in the
  scale's dtype and then cast (compressed-tensors' `dequantize`); symmetric, so no zero point;
- `weight_shape` int [2]: (out, in).

Nothing is initialised: the model is built on the meta device and every tensor it holds is the checkpoint's. A
quantized tensor with no place, or a tensor the model needs that the checkpoint lacks, is refused by name from
the shard headers before any data is read; after loading, anything still unloaded is refused again by name.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.logs import Progress
from eagle3.targets.info import llm_config
from eagle3.targets.weights import _weight_map

if TYPE_CHECKING:
    from eagle3.targets.info import TargetInfo

log = logging.getLogger("eagle3")

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight_packed", "weight_scale", "weight_shape")
_EXPERT_KEY = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.(?P<part>weight_packed|weight_scale|weight_shape)$")
_QUANTIZED_SUFFIX = re.compile(r"\.weight_(packed|scale|shape|zero_point|g_idx|global_scale)$")
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class PackScheme:
    """What the loader takes from a pack-quantized config: symmetric integer weights, one scale per group of
    `group_size` input columns."""

    num_bits: int
    group_size: int


def pack_scheme(text: dict[str, Any]) -> PackScheme | None:
    """The pack-quantized scheme of an LLM's config (Kimi-K2.5's text_config); None where it has none (other
    quantization methods stay with transformers). ValueError naming the field where the scheme is one this loader
    would read wrong (a zero point, activation order, quantized activations, several groups)."""
    q = text.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors":
        return None
    groups: dict[str, Any] = q.get("config_groups") or {}
    if all((g.get("format") or q.get("format")) != "pack-quantized" for g in groups.values()):
        return None
    where = "quantization_config.config_groups"
    if len(groups) != 1:
        raise ValueError(f"{where}: {len(groups)} groups ({', '.join(groups)}); the INT4 reference reads one "
                         "(Kimi-K2.5 has one, group_0)")
    name, group = next(iter(groups.items()))
    weights = group.get("weights") or {}
    for key, want in (("type", "int"), ("strategy", "group"), ("symmetric", True), ("actorder", None),
                      ("dynamic", False)):
        if weights.get(key, want) != want:
            raise ValueError(f"{where}.{name}.weights.{key} is {weights[key]!r}; the INT4 reference reads {want!r} "
                             "only (as Kimi-K2.5 has)")
    bits, size = weights.get("num_bits"), weights.get("group_size")
    if bits not in (2, 4, 8) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"{where}.{name}.weights: num_bits {bits!r}, group_size {size!r}; the INT4 reference reads "
                         "2, 4 or 8 bits (whole values per int32 word) in groups of a positive size")
    if group.get("input_activations") is not None:
        raise ValueError(f"{where}.{name}.input_activations is set (activations quantized too); the INT4 reference "
                         "is weight-only, as Kimi-K2.5 is")
    return PackScheme(bits, size)


def unpack(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """int8 [..., cols] from int32 words [..., cols * num_bits / 32] (the layout in the module docstring)."""
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)
    unsigned = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # `&` drops the arithmetic shift's sign
    return (unsigned.flatten(-2)[..., :cols] - (1 << (num_bits - 1))).to(torch.int8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, num_bits: int, cols: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Weights [..., out, cols] in `dtype`: each int times its group's scale, in the scale's dtype (as
    compressed-tensors computes it, so a bf16 model gets the bits SGLang's kernels see)."""
    q = unpack(packed, num_bits, cols).to(scale.dtype)
    groups = scale.shape[-1]
    return (q.unflatten(-1, (groups, cols // groups)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


class PackedExperts(nn.Module):
    """One MoE layer's routed experts as the checkpoint stores them (packed ints and scales, [E, rows, ...] with
    gate rows before up rows, as transformers fuses them), computed by transformers' eager experts loop with each
    expert's weights dequantized as the loop reaches it: one expert's bf16 weights (88 MB for Kimi) exist at a
    time, never the layer's 34 GB."""

    def __init__(self, experts: nn.Module, scheme: PackScheme, scale_dtype: torch.dtype, dtype: torch.dtype):
        super().__init__()
        e, two_i, h = experts.gate_up_proj.shape
        i = experts.down_proj.shape[-1]
        if two_i != 2 * i or any(d % scheme.group_size or d * scheme.num_bits % 32 for d in (h, i)):
            raise ValueError(f"experts of hidden {h}, intermediate {i} (fused gate_up {two_i}): not whole groups of "
                             f"{scheme.group_size} or int32 words of {scheme.num_bits}-bit values")
        self.num_experts, self.hidden_dim, self.intermediate_dim = e, h, i
        self.num_bits, self.dtype, self.act_fn = scheme.num_bits, dtype, experts.act_fn
        for name, rows, cols in (("gate_up", 2 * i, h), ("down", h, i)):
            self.register_buffer(f"{name}_packed", torch.empty(e, rows, cols * scheme.num_bits // 32,
                                                               dtype=torch.int32, device="meta"), persistent=False)
            self.register_buffer(f"{name}_scale", torch.empty(e, rows, cols // scheme.group_size, dtype=scale_dtype,
                                                              device="meta"), persistent=False)
        # Which (expert, projection, part) the checkpoint has written: the buffers start uninitialised.
        self.filled = torch.zeros(e, len(PROJECTIONS), len(PARTS), dtype=torch.bool)

    def materialize(self, device: torch.device) -> None:
        for name, buf in list(self._buffers.items()):
            self._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)

    def _place(self, proj: str) -> tuple[str, slice, int]:
        """(buffer prefix, rows, input columns) of one projection within an expert."""
        i, h = self.intermediate_dim, self.hidden_dim
        return {"gate_proj": ("gate_up", slice(0, i), h), "up_proj": ("gate_up", slice(i, 2 * i), h),
                "down_proj": ("down", slice(0, h), i)}[proj]

    @torch.no_grad()
    def load_piece(self, expert: int, proj: str, part: str, tensor: torch.Tensor, key: str) -> None:
        """Copy one checkpoint tensor into place; ValueError naming `key` where it does not fit exactly."""
        name, rows, cols = self._place(proj)
        if part == "weight_shape":
            if tensor.tolist() != [rows.stop - rows.start, cols]:
                raise ValueError(f"{key}: weight_shape {tensor.tolist()}, the model's {proj} is "
                                 f"[{rows.stop - rows.start}, {cols}]")
        else:
            dst = getattr(self, f"{name}_{'packed' if part == 'weight_packed' else 'scale'}")[expert, rows]
            if tensor.shape != dst.shape or tensor.dtype != dst.dtype:
                raise ValueError(f"{key}: {tensor.dtype} {list(tensor.shape)}, the model takes {dst.dtype} "
                                 f"{list(dst.shape)} there")
            dst.copy_(tensor)
        self.filled[expert, PROJECTIONS.index(proj), PARTS.index(part)] = True

    def missing(self, name: str) -> list[str]:
        """The checkpoint names (`name` = this module's) of every piece not loaded."""
        return [f"{name}.{e}.{PROJECTIONS[p]}.{PARTS[k]}" for e, p, k in (~self.filled).nonzero().tolist()]

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert in the model's dtype: what transformers' fused parameters
        would hold at index `expert`."""
        return (dequantize(self.gate_up_packed[expert], self.gate_up_scale[expert], self.num_bits, self.hidden_dim,
                           self.dtype),
                dequantize(self.down_packed[expert], self.down_scale[expert], self.num_bits, self.intermediate_dim,
                           self.dtype))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' `DeepseekV3Experts` eager forward, op for op, on dequantized weights."""
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        for expert in hit:
            top_k_pos, token_idx = torch.where(mask[expert])
            gate_up, down = self.expert_weights(expert)
            gate, up = F.linear(hidden_states[token_idx], gate_up).chunk(2, dim=-1)
            out = F.linear(self.act_fn(gate) * up, down) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


@dataclass
class _Plan:
    plain: dict[str, str] = field(default_factory=dict)
    """checkpoint key -> the model's parameter or buffer name"""
    pieces: dict[str, tuple[str, int, str, str]] = field(default_factory=dict)
    """checkpoint key -> (experts module, expert, projection, part)"""


def _sort_keys(keys: list[str], prefix: str, ignore: list[str]) -> _Plan:
    """Each checkpoint key's destination; the wrapper's other towers (no `prefix`) and the model's ignored keys
    (DeepSeek-V3's MTP layer 61) are left out. A quantized key other than a routed expert's is refused."""
    plan = _Plan()
    for key in sorted(keys):
        name = key[len(prefix):]
        if not key.startswith(prefix) or any(re.search(p, name) for p in ignore):
            continue
        m = _EXPERT_KEY.match(name)
        if m:
            plan.pieces[key] = (m["module"], int(m["expert"]), m["proj"], m["part"])
        elif _QUANTIZED_SUFFIX.search(name):
            raise ValueError(f"{key}: a quantized tensor the INT4 reference cannot place (it reads routed experts' "
                             "weight_packed/weight_scale/weight_shape); its module would stay at random init")
        else:
            plan.plain[key] = name
    return plan


def _pack_experts(model: nn.Module, plan: _Plan, prefix: str, scheme: PackScheme, scale_dtype: torch.dtype,
                  dtype: torch.dtype) -> list[str]:
    """Put a PackedExperts in place of each fused experts module the checkpoint has packed pieces for; the names
    of the pieces it then lacks."""
    first: dict[str, str] = {}
    for key, (module, *_rest) in plan.pieces.items():
        first.setdefault(module, key)
    for module, key in first.items():
        try:
            experts = model.get_submodule(module)
        except AttributeError:
            experts = None
        if not (isinstance(getattr(experts, "gate_up_proj", None), nn.Parameter) and experts.gate_up_proj.dim() == 3):
            raise ValueError(f"{key}: {type(model).__name__} has no fused experts module `{module}` (3-D gate_up_proj "
                             "and down_proj) to put it in; its weights would stay at random init")
        model.set_submodule(module, PackedExperts(experts, scheme, scale_dtype, dtype))
    missing: set[str] = set()
    for module in first:
        packed = model.get_submodule(module)
        keys = {f"{prefix}{name}" for name in packed.missing(module)}
        missing |= keys
        for key, (mod, expert, *_rest) in plan.pieces.items():
            if mod == module and expert >= packed.num_experts:
                raise ValueError(f"{key}: expert {expert} of a layer with {packed.num_experts} routed experts")
    return sorted(missing - plan.pieces.keys())


def _needed(model: nn.Module) -> list[str]:
    """The parameters and persistent buffers a checkpoint must provide (a tied alias once)."""
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append(name)
    return out


def _plan(model: nn.Module, keys: list[str], prefix: str, scheme: PackScheme, scale_dtype: torch.dtype,
          dtype: torch.dtype) -> _Plan:
    """Where every checkpoint tensor goes, from the names alone: refuses, before any data is read, a quantized
    tensor with no place and a tensor the model needs that the checkpoint lacks."""
    ignore = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    plan = _sort_keys(keys, prefix, ignore)
    missing = _pack_experts(model, plan, prefix, scheme, scale_dtype, dtype)
    needed = _needed(model)
    have = set(plan.plain.values())
    missing += [prefix + n for n in needed if n not in have]
    if missing:
        raise ValueError(f"{missing[0]} is missing from the checkpoint ({len(missing)} tensors in all): the model "
                         "would run with it uninitialised")
    known = set(needed)
    unknown = sorted(k for k, n in plan.plain.items() if n not in known)
    if unknown:
        log.warning(f"INT4 target: {len(unknown)} checkpoint tensors the model has no place for, skipped "
                    f"(first: {unknown[0]})")
    plan.plain = {k: n for k, n in plan.plain.items() if n in known}
    return plan


def _device_map(model: nn.Module, device: str) -> dict[str, int | str]:
    """`device` for everything, or with "auto" accelerate's balanced map over the GPUs (as transformers makes
    it), sized from the packed experts' real bytes."""
    if device != "auto":
        return {"": device}
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = sorted(getattr(model, "_no_split_modules", None) or [])
    memory = get_balanced_memory(model, no_split_module_classes=no_split)
    device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
    if "disk" in device_map.values():
        raise ValueError("target.device=auto: the INT4 model does not fit in this machine's GPU and host memory "
                         f"(accelerate would offload {sum(v == 'disk' for v in device_map.values())} modules to disk)")
    return device_map


def _device_of(name: str, device_map: dict[str, int | str]) -> torch.device:
    parts = name.split(".")
    for n in range(len(parts), -1, -1):
        d = device_map.get(".".join(parts[:n]))
        if d is not None:
            return torch.device(f"cuda:{d}" if isinstance(d, int) else d)
    raise KeyError(f"{name}: not in the device map")


def _assign(model: nn.Module, name: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype,
            key: str) -> None:
    """Replace the meta tensor `name` with the checkpoint's `tensor` (floats cast to `dtype`)."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    old = getattr(module, attr)
    if tensor.shape != old.shape:
        raise ValueError(f"{key}: shape {list(tensor.shape)}, the model's {name} is {list(old.shape)}")
    value = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


def _load(model: nn.Module, plan: _Plan, info: TargetInfo, weight_map: dict[str, str],
          device_map: dict[str, int | str], dtype: torch.dtype) -> None:
    """Read every planned tensor, one at a time, straight to its device: host memory holds one tensor (Kimi's
    largest is the 2.35 GB embedding) beside the OS page cache."""
    from safetensors import safe_open

    fp32 = [p.replace("*", ".*") for p, d in (getattr(model, "_get_dtype_plan", lambda _d: {})(dtype)).items()
            if d == torch.float32]  # transformers' `_keep_in_fp32_modules(_strict)`: DeepSeek-V3's router in fp32
    by_file: dict[str, list[str]] = defaultdict(list)
    for key in [*plan.plain, *plan.pieces]:
        by_file[weight_map[key]].append(key)
    with Progress(len(by_file), "loading the INT4 target", unit="file") as progress:
        for file, keys in sorted(by_file.items()):
            with safe_open(str(info.folder / file), framework="pt") as f:
                for key in keys:
                    tensor = f.get_tensor(key)
                    if key in plan.pieces:
                        module, expert, proj, part = plan.pieces[key]
                        model.get_submodule(module).load_piece(expert, proj, part, tensor, key)
                        continue
                    name = plan.plain[key]
                    keep = torch.float32 if any(re.search(p, name) for p in fp32) else dtype
                    _assign(model, name, tensor, _device_of(name, device_map), keep, key)
            progress.update()


def _finish(model: nn.Module, prefix: str, device_map: dict[str, int | str], device: str) -> None:
    """Rotary tables rebuilt (computed at init, never stored), ties re-made, and a last check that nothing is left
    unloaded; then accelerate's hooks carry activations across the GPUs."""
    for name, module in list(model.named_modules()):
        if "RotaryEmbedding" in type(module).__name__ and any(b.is_meta for b in module.buffers()):
            model.set_submodule(name, type(module)(module.config).to(_device_of(name, device_map)))
    model.tie_weights()
    left = [prefix + n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    for name, module in model.named_modules():
        if isinstance(module, PackedExperts):
            left += [prefix + k for k in module.missing(name)]
    if left:
        raise ValueError(f"{left[0]} was never loaded ({len(left)} tensors in all): refusing a model that would "
                         "run with it uninitialised")
    if device == "auto":
        from accelerate import dispatch_model

        dispatch_model(model, device_map=device_map)


def load_pack_quantized(info: TargetInfo, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """The target's LLM (Kimi-K2.5: `language_model.*` of the wrapper) with its pack-quantized routed experts kept
    packed (`PackedExperts`) and everything else in `dtype` (DeepSeek-V3's router in fp32, as transformers keeps
    it). `device`: one device, or "auto" for accelerate's balanced map over the GPUs."""
    from transformers import AutoModelForCausalLM

    scheme = pack_scheme(info.text)
    if scheme is None:
        raise ValueError(f"{info.folder / 'config.json'}: no compressed-tensors pack-quantized quantization_config")
    weight_map = _weight_map(info.folder)
    prefix = "language_model." if info.wrapped else ""
    scale_key = next((k for k in sorted(weight_map) if k.endswith(".weight_scale")), None)
    if scale_key is None:
        raise ValueError(f"{info.folder}: config.json says pack-quantized but no tensor is a weight_scale")
    from safetensors import safe_open

    with safe_open(str(info.folder / weight_map[scale_key]), framework="pt") as f:
        scale_dtype = _SAFETENSORS_DTYPES[f.get_slice(scale_key).get_dtype()]
    config = llm_config(info, quantization=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM._model_mapping[type(config)](config)
    model.to(dtype)  # on meta: only the dtypes, for the device map's sizes
    model.tie_weights()
    plan = _plan(model, list(weight_map), prefix, scheme, scale_dtype, dtype)
    device_map = _device_map(model, device)
    packed = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedExperts)]
    for name, module in packed:
        module.materialize(_device_of(name, device_map))
    size = sum(b.numel() * b.element_size() for _, m in packed for b in m.buffers()) / 1e9
    log.info(f"INT4 target: {len(plan.pieces)} packed tensors ({len(packed)} MoE layers, {size:.1f} GB) kept "
             f"packed, {len(plan.plain)} tensors in {dtype}; device map over {sorted(set(map(str, device_map.values())))}")
    _load(model, plan, info, weight_map, device_map, dtype)
    _finish(model, prefix, device_map, device)
    return model
