"""CPU glue for the real SGLang 0.5.23: monkeypatches applied lazily, when the SGLang module they patch is imported.

Test support only, loaded by `sitecustomize.py` in this folder (so in every Python process that has
tests/sglang_cpu on PYTHONPATH, SGLang's scheduler / TP worker children included) when SGLANG_USE_CPU_ENGINE=1.
SGLang's model code, scheduler, TP and EAGLE-3 worker run unmodified; these patches only add the CPU backend
glue SGLang 0.5.23 lacks for `--device cpu --attention-backend torch_native` on a machine without Intel AMX:

1. `torch_native` in the DeepSeek MLA attention-handler registry, always taking the absorbed-MLA path
   (`_patch_deepseek_attention_handler`).
2. `TorchNativeAttnBackend.forward_extend` filling extend_prefix_lens / extend_seq_lens (and the verify KV
   length) for TARGET_VERIFY and DRAFT_EXTEND_V2 batches (`_patch_torch_native_backend`).
3. torch_native EAGLE draft-decode (multi-step, `topk 1` chains) and draft-extend backends in
   `DraftBackendFactory` (`_patch_draft_backend_factory`).
4. The MLA EAGLE-3 head's embedding hand-over without CUDA calls (`_patch_mla_eagle3_set_embed`).

Each patch names the SGLang 0.5.23 internals it relies on; if one is missing the patch raises at import of the
patched module (never silently skips), so a SGLang upgrade fails loudly here instead of deep in a forward.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Callable

SGLANG_VERSION = "0.5.23"

# module name -> hook(module), run right after the module's own code.
_HOOKS: dict[str, Callable] = {}
_APPLIED: set[str] = set()


def _log(msg: str) -> None:
    if os.environ.get("EAGLE3_SGLANG_CPU_VERBOSE") == "1":
        print(f"[sglang_cpu_patches pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


_LOGGED: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        _log(msg)


def _require(obj, name: str, where: str):
    if not hasattr(obj, name):
        raise ImportError(
            f"eagle3 SGLang CPU stand-ins: {where} has no `{name}`; these patches target SGLang {SGLANG_VERSION} "
            "(tests/sglang_cpu/sglang_cpu_patches.py)")
    return getattr(obj, name)


# ---------------------------------------------------------------------------------------------------------------
# 1. DeepSeek MLA attention handler for torch_native
# ---------------------------------------------------------------------------------------------------------------


def _patch_deepseek_attention_handler(mod) -> None:
    """Register a `torch_native` handler in the DeepSeek attention-handler registry that always picks the
    absorbed-MLA forward method.

    Depends on (SGLang 0.5.23) `sglang.srt.models.deepseek_common.attention_backend_handler`:
    `AttentionBackendRegistry` (`_handlers`, `register`, `get_handler`, which falls back to the "triton" handler
    for unknown backends) and `_dispatch_mla_subtype(attn, forward_batch)` (returns AttnForwardMethod.MLA on a
    non-AMX CPU). `DeepseekV2AttentionMLA` (srt/models/deepseek_v2.py) asks the registry with the configured
    attention backend name.

    Fixes: without a torch_native entry the Triton handler is used, which picks the MHA path for a prefill
    without cached prefix (K/V of qk_head_dim / v_head_dim per head) while torch_native reads K/V back from the
    latent MLA KV pool. The first DeepseekV3 prefill then crashes in `TorchNativeAttnBackend
    ._run_sdpa_forward_extend` ("Expected size for first two dimensions of batch2 tensor to be: [4, 32] but got:
    [4, 48]", ../../shared/SGLANG-CPU.md), or, when the shapes happen to line up (kv_lora_rank ==
    qk_nope_head_dim, as in tests/models.py's tiny DeepseekV3), silently generates wrong tokens (seen here: 128,
    228, 125, 180, ... where HF gives 172, 113, 89, 92, ...). The absorbed path writes and reads the latent pool
    consistently, for prefill, decode, verify and draft extend.
    """
    registry = _require(mod, "AttentionBackendRegistry", mod.__name__)
    dispatch_mla = _require(mod, "_dispatch_mla_subtype", mod.__name__)
    _require(registry, "register", "AttentionBackendRegistry")
    if "torch_native" in getattr(registry, "_handlers", {}):
        _log("deepseek attention registry already has torch_native; left alone")
        return

    def handle_attention_torch_native(attn, forward_batch):
        """eagle3 CPU stand-in: torch_native reads K/V from the latent MLA pool, so always absorbed MLA."""
        return dispatch_mla(attn, forward_batch)

    registry.register("torch_native", handle_attention_torch_native)
    _log("registered torch_native DeepSeek attention handler (absorbed MLA)")


# ---------------------------------------------------------------------------------------------------------------
# 2. TorchNativeAttnBackend.forward_extend for TARGET_VERIFY / DRAFT_EXTEND_V2
# ---------------------------------------------------------------------------------------------------------------


def _spec_tokens_per_req(spec_info) -> int:
    n = getattr(spec_info, "num_tokens_per_req", -1)
    if n is None or n <= 0:
        n = getattr(spec_info, "draft_token_num", None)
    if n is None or n <= 0:
        raise RuntimeError("eagle3 CPU stand-in: TARGET_VERIFY batch without draft_token_num on spec_info")
    return int(n)


def _patch_torch_native_backend(mod) -> None:
    """Wrap `TorchNativeAttnBackend.forward_extend` so that TARGET_VERIFY and DRAFT_EXTEND_V2 batches reach
    `_run_sdpa_forward_extend` with the per-request lengths it needs; every other batch goes through unchanged.

    Depends on (SGLang 0.5.23) `sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend
    .forward_extend(q, k, v, layer, forward_batch, save_kv_cache)`, which reads `forward_batch.seq_lens`
    (KV length per request), `.extend_prefix_lens`, `.extend_seq_lens`; on `ForwardMode.is_target_verify()` /
    `.is_draft_extend_v2()`; and on the verify batch's `spec_info.draft_token_num` / `num_tokens_per_req`
    and `tree_topk` (srt/speculative/eagle_info.py `EagleVerifyInput`). The layout is taken from
    srt/speculative/eagle_utils.py `prepare_for_verify` (verify: seq_lens = committed prefix, draft_token_num
    new tokens per request, no extend_* fields; the same convention the triton and intel_amx backends use) and
    srt/speculative/eagle_worker_common.py `prepare_for_draft_extend` (draft extend: seq_lens already include the
    num_draft_tokens new tokens).

    Fixes: EAGLE-3 on torch_native crashing in the first verify (`run_eagle_verify` -> `forward_extend` ->
    `_run_sdpa_forward_extend`: "AttributeError: 'NoneType' object has no attribute 'shape'" at `assert
    seq_lens.shape[0] == extend_prefix_lens.shape[0]`: a TARGET_VERIFY ForwardBatch has no extend_* fields, and
    its seq_lens exclude the draft tokens). DRAFT_EXTEND_V2 batches get the fields from
    `prepare_for_draft_extend`; they are derived here only if missing. The draft tokens of a
    `topk 1` chain attend causally to the prefix and to each other, which is exactly the causal SDPA
    `_run_sdpa_forward_extend` runs; a real tree (topk > 1) needs the custom mask and raises NotImplementedError.
    """
    cls = _require(mod, "TorchNativeAttnBackend", mod.__name__)
    original = _require(cls, "forward_extend", "TorchNativeAttnBackend")
    if getattr(original, "_eagle3_cpu_patched", False):
        return
    import torch

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            spec_info = forward_batch.spec_info
            topk = getattr(spec_info, "tree_topk", getattr(spec_info, "topk", 1))
            if topk != 1:
                raise NotImplementedError(
                    "eagle3 CPU stand-in: torch_native TARGET_VERIFY supports only topk 1 chains (causal); a draft "
                    f"tree (tree_topk={topk}) needs spec_info.custom_mask, which is not implemented")
            n = _spec_tokens_per_req(spec_info)
            prefix = forward_batch.seq_lens
            fields = dict(
                seq_lens=prefix + n,
                extend_prefix_lens=prefix.to(torch.int32),
                extend_seq_lens=torch.full_like(prefix, n, dtype=torch.int32),
            )
        elif mode.is_draft_extend_v2() and (forward_batch.extend_prefix_lens is None
                                             or forward_batch.extend_seq_lens is None):
            seq_lens = forward_batch.seq_lens
            bs = seq_lens.shape[0]
            if q.shape[0] % bs:
                raise RuntimeError(f"eagle3 CPU stand-in: DRAFT_EXTEND_V2 with {q.shape[0]} tokens for {bs} requests")
            n = q.shape[0] // bs
            fields = dict(
                extend_prefix_lens=(seq_lens - n).to(torch.int32),
                extend_seq_lens=torch.full_like(seq_lens, n, dtype=torch.int32),
            )
        else:
            return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        _log_once(f"torch_native forward_extend: filled {sorted(fields)} for {mode.name}")
        saved = {name: getattr(forward_batch, name) for name in fields}
        try:
            for name, value in fields.items():
                setattr(forward_batch, name, value)
            return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        finally:
            for name, value in saved.items():
                setattr(forward_batch, name, value)

    forward_extend.__doc__ = original.__doc__
    forward_extend.__wrapped__ = original
    forward_extend._eagle3_cpu_patched = True
    cls.forward_extend = forward_extend
    _log("patched TorchNativeAttnBackend.forward_extend (TARGET_VERIFY / DRAFT_EXTEND_V2 lengths)")


# ---------------------------------------------------------------------------------------------------------------
# 3. torch_native EAGLE draft backends
# ---------------------------------------------------------------------------------------------------------------


def _make_draft_decode_classes():
    """The torch_native multi-step draft-decode backend (defined on first use: it subclasses SGLang's class)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class TorchNativeChainDraftStepBackend(TorchNativeAttnBackend):
        """Draft-decode step `step` of a `topk 1` chain: the draft token of this step attends to the committed
        prefix plus the step + 1 draft tokens written so far (its own included).

        Relies on the slot layout of `assign_draft_cache_locs_contiguous` (kernels/ops/speculative/cache_locs.py,
        called from srt/speculative/eagle_worker_common.py `prepare_for_draft`): with topk 1 the draft tokens'
        KV slots are req_to_token[r, seq_len : seq_len + num_steps], so the plain torch_native decode over
        req_to_token with KV length seq_len + step + 1 is exact (the same lengths intel_amx's
        `IntelAMXMultiStepDraftBackend` builds).
        """

        def __init__(self, model_runner, step: int):
            super().__init__(model_runner)
            self.step = step
            self.draft_seq_lens = None

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if self.draft_seq_lens is None:
                raise RuntimeError("eagle3 CPU stand-in: draft decode step run before init_forward_metadata")
            saved = forward_batch.seq_lens
            forward_batch.seq_lens = self.draft_seq_lens
            try:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            finally:
                forward_batch.seq_lens = saved

    class TorchNativeMultiStepDraftBackend:
        """torch_native counterpart of the per-step draft-decode containers in srt/layers/attention
        (`TritonMultiStepDraftBackend`, `IntelAMXMultiStepDraftBackend`): `attn_backends[i]` serves draft step i
        (i < speculative_num_steps - 1), `init_forward_metadata` sets every step's KV lengths.

        Only `topk 1` (chains); a tree needs per-branch req_to_token rows and is refused at start-up.
        """

        def __init__(self, model_runner, topk: int, speculative_num_steps: int):
            if topk != 1:
                raise NotImplementedError(
                    "eagle3 CPU stand-in: torch_native EAGLE draft decode supports only --speculative-eagle-topk 1 "
                    f"(got {topk}); trees need per-branch KV rows and a custom verify mask")
            self.topk = topk
            self.speculative_num_steps = speculative_num_steps
            self.attn_backends = [TorchNativeChainDraftStepBackend(model_runner, i)
                                  for i in range(speculative_num_steps - 1)]
            self.device = model_runner.device
            self.token_to_kv_pool = model_runner.token_to_kv_pool
            self.req_to_token_pool = model_runner.req_to_token_pool

        def init_forward_metadata(self, forward_batch):
            seq_lens = forward_batch.seq_lens
            for backend in self.attn_backends:
                backend.init_forward_metadata(forward_batch)
                backend.draft_seq_lens = seq_lens + backend.step + 1

        def init_cuda_graph_state(self, *args, **kwargs):
            raise NotImplementedError("eagle3 CPU stand-in: no graph capture on torch_native; run with "
                                      "--disable-cuda-graph")

    return TorchNativeChainDraftStepBackend, TorchNativeMultiStepDraftBackend


def _patch_draft_backend_factory(mod) -> None:
    """Give `DraftBackendFactory` torch_native entries: a multi-step draft-decode backend for `topk 1` chains
    and a draft-extend backend (a plain `TorchNativeAttnBackend`, which the forward_extend patch above makes
    DRAFT_EXTEND_V2-ready).

    Depends on (SGLang 0.5.23) `sglang.srt.speculative.draft_utils.DraftBackendFactory`: `create_decode_backend`
    and `create_draft_extend_backend` build a local `backend_map` {name: factory returning (stamp, backend)} and
    pass it to `_create_backend(backend_name, backend_map, error_template, stamps_children=False)`; only
    `create_decode_backend` passes stamps_children=True (it then reads `backend.attn_backends`). Also on
    `self.draft_model_runner`, `self.topk`, `self.speculative_num_steps`.

    Fixes: the EAGLE-3 server refusing to start with "EAGLE is not supported in decode attention backend
    torch_native" (on CPU only intel_amx is in the maps, and it needs AMX and the real sgl_kernel).
    """
    cls = _require(mod, "DraftBackendFactory", mod.__name__)
    original = _require(cls, "_create_backend", "DraftBackendFactory")
    _require(cls, "create_decode_backend", "DraftBackendFactory")
    _require(cls, "create_draft_extend_backend", "DraftBackendFactory")
    if getattr(original, "_eagle3_cpu_patched", False):
        return

    def _create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
        if "torch_native" not in backend_map:
            backend_map = dict(backend_map)
            if stamps_children:  # create_decode_backend
                def make_decode():
                    _, multi_step = _make_draft_decode_classes()
                    return "torch_native", multi_step(self.draft_model_runner, self.topk,
                                                      self.speculative_num_steps)

                backend_map["torch_native"] = make_decode
            else:  # create_draft_extend_backend
                def make_extend():
                    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

                    return "torch_native", TorchNativeAttnBackend(self.draft_model_runner)

                backend_map["torch_native"] = make_extend
        return original(self, backend_name, backend_map, error_template, stamps_children=stamps_children)

    _create_backend.__wrapped__ = original
    _create_backend._eagle3_cpu_patched = True
    cls._create_backend = _create_backend
    _log("patched DraftBackendFactory._create_backend (torch_native draft decode / extend)")


def _patch_mla_eagle3_set_embed(mod) -> None:
    """`Eagle3DeepseekV2ForCausalLM.set_embed` / `set_embed_and_head` without their trailing
    `torch.cuda.empty_cache()` / `torch.cuda.synchronize()` (a CPU-only torch raises "Found no NVIDIA driver").
    The weight hand-over itself (the target's embeddings, and lm_head for a full-vocab head) is SGLang's own code,
    run unchanged with those two calls made no-ops for its duration.

    Depends on (SGLang 0.5.23) `sglang.srt.models.kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM` with `set_embed` and
    `set_embed_and_head` (the Llama head's `llama_eagle3.py` makes no CUDA call there).
    """
    cls = _require(mod, "Eagle3DeepseekV2ForCausalLM", mod.__name__)
    for name in ("set_embed", "set_embed_and_head"):
        original = _require(cls, name, "Eagle3DeepseekV2ForCausalLM")
        if getattr(original, "_eagle3_cpu_patched", False):
            continue

        def without_cuda(self, *args, _original=original, **kwargs):
            import torch

            if torch.cuda.is_available():
                return _original(self, *args, **kwargs)
            saved = torch.cuda.empty_cache, torch.cuda.synchronize
            torch.cuda.empty_cache = torch.cuda.synchronize = lambda *a, **k: None
            try:
                return _original(self, *args, **kwargs)
            finally:
                torch.cuda.empty_cache, torch.cuda.synchronize = saved

        without_cuda.__wrapped__ = original
        without_cuda._eagle3_cpu_patched = True
        setattr(cls, name, without_cuda)
    _log("patched Eagle3DeepseekV2ForCausalLM.set_embed / set_embed_and_head (no CUDA calls on CPU)")


IMPORT_BOUND_OPS = ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
                    "fused_qkvzba_split_reshape_cat_contiguous_cpu")
"""CPU ops `sglang/srt/models/qwen3_5.py` binds at import time (`if _is_cpu:`, AMX or not)."""


def _patch_sgl_kernel_ops(torch) -> None:
    """`torch.ops.sgl_kernel.NAME` resolves for the IMPORT_BOUND_OPS, to the stand-in's function of that name (which
    raises NotImplementedError when called); every other missing op stays missing.

    SGLang's CPU build registers its kernels as torch ops, and `qwen3_5.py` binds four of them at import time; with no
    op there the import fails, and SGLang's multimodal registry, importing `multimodal/processors/qwen_vl.py` (which
    imports that model), drops the Qwen2-VL / Qwen2.5-VL processor with a log line only, then refuses the model:
    "No processor registered for architecture". Only those names: SGLang probes others with `hasattr` to pick fused
    paths (`convert_weight_packed` decides whether the AMX backend exists at all).
    """
    ops = torch.ops
    namespace = ops.sgl_kernel
    if getattr(namespace, "_eagle3_cpu_patched", False):
        return

    class StandInOps(type(namespace)):
        _eagle3_cpu_patched = True

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except (AttributeError, RuntimeError):
                if name not in IMPORT_BOUND_OPS:
                    raise
                import sgl_kernel

                return getattr(sgl_kernel, name)

    ops.sgl_kernel = StandInOps("sgl_kernel")
    _log(f"torch.ops.sgl_kernel: {', '.join(IMPORT_BOUND_OPS)} resolve to stand-ins that raise when called")


# ---------------------------------------------------------------------------------------------------------------
# Lazy application: a post-import hook per patched module
# ---------------------------------------------------------------------------------------------------------------

_HOOKS.update({
    "sglang.srt.models.deepseek_common.attention_backend_handler": _patch_deepseek_attention_handler,
    "sglang.srt.layers.attention.torch_native_backend": _patch_torch_native_backend,
    "sglang.srt.speculative.draft_utils": _patch_draft_backend_factory,
    "sglang.srt.models.kimi_k25_eagle3": _patch_mla_eagle3_set_embed,
    "torch": _patch_sgl_kernel_ops,
})


# Short names for EAGLE3_SGLANG_CPU_SKIP_PATCHES (comma-separated), to reproduce a blocker or bisect a failure.
PATCH_NAMES = {
    "deepseek_mla": "sglang.srt.models.deepseek_common.attention_backend_handler",
    "torch_native_extend": "sglang.srt.layers.attention.torch_native_backend",
    "draft_backends": "sglang.srt.speculative.draft_utils",
    "mla_eagle3_embed": "sglang.srt.models.kimi_k25_eagle3",
    "sgl_kernel_ops": "torch",
}


def _skipped() -> set[str]:
    names = {n.strip() for n in os.environ.get("EAGLE3_SGLANG_CPU_SKIP_PATCHES", "").split(",") if n.strip()}
    unknown = names - set(PATCH_NAMES)
    if unknown:
        raise ValueError(f"EAGLE3_SGLANG_CPU_SKIP_PATCHES: unknown {sorted(unknown)}; known: {sorted(PATCH_NAMES)}")
    return {PATCH_NAMES[n] for n in names}


def _run_hook(name: str, module) -> None:
    if name in _APPLIED:
        return
    _APPLIED.add(name)
    if name in _skipped():
        _log(f"skipped the patch of {name} (EAGLE3_SGLANG_CPU_SKIP_PATCHES)")
        return
    _HOOKS[name](module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a patched module it asks the other finders for the real spec and chains the
    patch after the loader's exec_module, so the patch runs exactly when (and if) SGLang imports the module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _HOOKS or fullname in _APPLIED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_patch(module, _exec=exec_module, _name=fullname):
            _exec(module)
            _run_hook(_name, module)

        loader.exec_module = exec_then_patch  # this spec's own loader instance
        return spec


_FINDER = _PostImportFinder()


def install() -> None:
    """Install the post-import hooks (idempotent); modules already imported are patched at once."""
    for name in list(_HOOKS):
        if name in sys.modules:
            _run_hook(name, sys.modules[name])
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _log("installed post-import hooks")
