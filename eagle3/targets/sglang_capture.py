"""eagle3's hidden-state capture inside an SGLang server: an SGLang plugin, active only when asked for.

SGLang 0.5.23 loads the plugins registered under the `sglang.srt.plugins` entry-point group at the start of
every scheduler process (where the TP workers and their models live). eagle3 registers `plugin` there
(pyproject.toml), so installing eagle3 in SGLang's Python is all a server needs. The plugin does nothing unless
the server was started with `EAGLE3_SGLANG_DUMP_DIR` set (`eagle3 sglang serve`, or `SGLangTarget`, which
launches it): a normal SGLang server in the same environment is untouched.

When active, it adds two hooks through SGLang's own `HookRegistry`:
1. after `ModelRunner.load_model`: `model.set_eagle3_layers_to_capture(to_engine_ids(ids, "sglang", family))`,
   the call SGLang makes itself when it serves an EAGLE-3 draft, so the model's decoder loop keeps the residual
   stream *entering* each layer of its `layers_to_capture`. The hook reads `layers_to_capture` back and refuses
   to start unless it equals eagle3's ids (id k = input of layer k): SGLang spells ids differently for Llama-
   and DeepSeek-family models and between versions, and a wrong layer is silent poison for the drafter.
2. before `LogitsProcessor.forward`: the processor still holds every prompt token's final state (after the
   final norm; the models apply it before the call) and the aux states. For a prefill batch, tensor-parallel
   rank 0 copies them to the CPU once and writes one dump per prompt (eagle3.targets.sglang_dump). Decode,
   verify and draft batches pass through untouched.

The contract with the model code, as SGLang 0.5.23 has it (tests/test_sglang_real.py runs it for every family):
- aux states arrive as a list of `[T, H]` tensors (Llama, Qwen) or packed into one `[T, 3H]` tensor (DeepSeek-V3,
  Kimi-K2.5: `layers/aux_hidden_states.py`); both are accepted;
- the Kimi-K2.5 wrapper embeds the tokens itself and calls its language model with `input_ids=None`
  (`managers/mm_utils.py`): the ids then come from the forward batch, which always carries them.

- a batch with images (a vision-language target, the pictures sent with the request) carries the merged input
  embeddings in the logits metadata (`mm_input_embeds`, every row of the batch), and its ids hold vocab_size - 1 at
  image positions (SGLang's hash pads, clamped before the embedding): each prompt's rows at that id go with its
  states (eagle3.targets.sglang_dump.image_parts), from which the client takes its image positions.

Plain TP replicates hidden states on every rank after the all-reduce, so rank 0 alone writes. DP attention
(token-sharded states) is refused by the client's preflight; states of another length than the batch's
tokens are never written.

Where the states go (the client chose it with the request's rid, which the forward batch carries):
- a rid made by eagle3's Mooncake client (`eagle3/.../<storage>`, eagle3.targets.sglang_dump.store_key): into the
  Mooncake Store under that rid, encoded by the cache codec it names (fp8 quantised on the GPU, before the copy
  to the host), when the server was started with the EAGLE3_MOONCAKE_* environment (eagle3.targets.mooncake);
  a failed put leaves `<rid>#error` saying why, for the client to report;
- any other request: a file in the dump folder (eagle3.targets.sglang_dump), named by its token ids.
So one server serves clients on its own machine through /dev/shm and clients elsewhere through the store.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from eagle3.targets.sglang_dump import (
    ENV_DUMP_DIR,
    ENV_FAMILY,
    ENV_LAYER_IDS,
    ENV_SEGMENT,
    STORE_KEY_PREFIX,
    ensure_dump_dir,
    image_parts,
    pack,
    prompt_states,
    store_key_storage,
    write_dump,
    write_error,
)

ENTRY_POINT = "eagle3_capture"
"""Its name in the `sglang.srt.plugins` group (what `SGLANG_PLUGINS`, SGLang's plugin allow-list, must name)."""

_warned: set[str] = set()


def _say(msg: str) -> None:
    """Server-side log line; SGLang owns the logging config, so write straight to stderr, flushed."""
    print(f"[eagle3 capture pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _say(msg)


def _settings() -> tuple[str, list[int], str]:
    dump_dir = os.environ[ENV_DUMP_DIR]
    layer_ids = [int(i) for i in json.loads(os.environ[ENV_LAYER_IDS])]
    family = os.environ.get(ENV_FAMILY, "llama")
    if family not in ("llama", "deepseek"):
        raise ValueError(f"{ENV_FAMILY}={family!r}: expected 'llama' or 'deepseek'")
    return dump_dir, layer_ids, family


def capture_lists(model: Any) -> list[tuple[str, list[int]]]:
    """Every non-empty `layers_to_capture` in the model tree (Kimi's multimodal wrapper nests the LLM)."""
    found = []
    for name, module in model.named_modules():
        v = getattr(module, "layers_to_capture", None)
        if v:
            found.append((name or "<root>", sorted(int(i) for i in v)))
    return found


def enable_capture(model: Any, layer_ids: list[int], family: str) -> None:
    """Ask the model to capture the inputs of `layer_ids` (eagle3 convention) and check what it set."""
    from eagle3.layer_ids import to_engine_ids

    if not hasattr(model, "set_eagle3_layers_to_capture"):
        raise RuntimeError(
            f"{type(model).__name__} has no set_eagle3_layers_to_capture: SGLang cannot capture aux hidden states "
            f"for this architecture"
        )
    engine_ids = to_engine_ids(layer_ids, "sglang", family)  # type: ignore[arg-type]
    model.set_eagle3_layers_to_capture(engine_ids)
    found = capture_lists(model)
    if not found:
        raise RuntimeError(f"set_eagle3_layers_to_capture({engine_ids}) left no layers_to_capture in the model")
    bad = [(n, v) for n, v in found if v != sorted(layer_ids)]
    if bad:
        raise RuntimeError(
            f"SGLang spelled eagle3 ids {layer_ids} (input of decoder layer k) as {engine_ids} for a {family}-family "
            f"model and got layers_to_capture {bad}; expected {sorted(layer_ids)}. The layer-id translation in "
            f"eagle3.layer_ids.to_engine_ids does not match this SGLang version: refusing to capture wrong layers"
        )
    _say(f"capturing inputs of decoder layers {layer_ids} (SGLang spelling {engine_ids}, {family} family)")


def _is_prefill(meta: Any) -> bool:
    mode = getattr(meta, "forward_mode", None)
    if mode is None or not mode.is_extend():
        return False
    for other in ("is_target_verify", "is_draft_extend", "is_draft_extend_v2", "is_idle"):
        fn = getattr(mode, other, None)
        if fn is not None and fn():
            return False
    return True


def _segment_lengths(meta: Any) -> list[int] | None:
    lens = getattr(meta, "extend_seq_lens_cpu", None)
    if lens is None and getattr(meta, "extend_seq_lens", None) is not None:
        lens = meta.extend_seq_lens.tolist()
    return [int(n) for n in lens] if lens is not None else None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def pack_aux(aux_hidden_states: Any, num_layers: int, hidden_size: int) -> Any:
    """The aux states as one `[T, num_layers * H]` tensor, from either contract (a list of `[T, H]` or the packed
    tensor); None when there are none or their shape is not that of `num_layers` captures of width H."""
    import torch

    if aux_hidden_states is None:
        return None
    if isinstance(aux_hidden_states, torch.Tensor):
        packed = aux_hidden_states
    else:
        parts = list(aux_hidden_states)
        if len(parts) != num_layers:
            return None
        packed = torch.cat(parts, dim=-1)
    if packed.dim() != 2 or packed.shape[-1] != num_layers * hidden_size:
        return None
    return packed


def capture_batch(input_ids: Any, hidden_states: Any, meta: Any, aux_hidden_states: Any, dump_dir: str,
                  layer_ids: list[int], store: Any = None, vocab_size: int | None = None) -> int:
    """Hand over each prompt of a prefill batch (to `store` when its rid asks for it, else a dump file); return how
    many were handed over (0 for other batches).

    `input_ids` may be None (the Kimi-K2.5 wrapper): the forward batch `meta` then supplies them. A batch with
    images carries the model's merged input embeddings (`mm_input_embeds`, every row of the batch); each prompt's
    rows at id `vocab_size - 1`, where SGLang clamped its image pads (eagle3.targets.sglang_dump.served_ids), go
    with its states (`image_parts`)."""
    if not _is_prefill(meta):
        return 0
    differ = tp_disagreement(aux_hidden_states, hidden_states)  # every TP rank takes part: before any return
    if _rank() != 0:
        return 0
    if input_ids is None:
        input_ids = getattr(meta, "input_ids", None)
    if input_ids is None:
        _warn_once("noids", "neither the logits processor nor the forward batch has the token ids; nothing is written")
        return 0
    hidden = int(hidden_states.shape[-1])
    aux = pack_aux(aux_hidden_states, len(layer_ids), hidden)
    if aux is None:
        shape = (tuple(aux_hidden_states.shape) if hasattr(aux_hidden_states, "shape") else
                 f"{len(aux_hidden_states)} tensors" if aux_hidden_states is not None else None)
        _warn_once("noaux", f"the logits processor got aux states {shape}, not {len(layer_ids)} captures of width "
                            f"{hidden}: capture is not enabled in this model; nothing is written")
        return 0
    lens = _segment_lengths(meta)
    if lens is None:
        _warn_once("nolens", "the batch metadata has no extend_seq_lens; nothing is written")
        return 0
    rows = {"input_ids": int(input_ids.shape[0]), "aux": int(aux.shape[0]), "final": int(hidden_states.shape[0])}
    if any(n != sum(lens) for n in rows.values()):
        _warn_once("rows", f"the batch has {sum(lens)} new tokens but the states have {rows} rows (sharded or padded "
                           f"states?); nothing is written")
        return 0
    input_ids, image = _image_rows(meta, input_ids, vocab_size)
    rids = list(getattr(meta, "rids", None) or [None] * len(lens))
    starts = [sum(lens[:i]) for i in range(len(lens))]

    if differ:
        _refuse_batch(differ, rids, starts, lens, input_ids, dump_dir, store)
        return 0
    to_store = [i for i, rid in enumerate(rids) if isinstance(rid, str) and rid.startswith(STORE_KEY_PREFIX)]
    if to_store and store is None:
        _warn_once("nostore", f"request {rids[to_store[0]]!r} asks for the Mooncake Store, but this server was not "
                              "started with it (EAGLE3_MOONCAKE_*: `eagle3 sglang serve` with target.sglang.transport "
                              "mooncake); its states are not handed over")
    elif to_store:
        _put_in_store(store, [(rids[i], starts[i], lens[i], image(input_ids, starts[i], lens[i])) for i in to_store],
                      input_ids, aux, hidden_states, layer_ids)
    files = [i for i in range(len(lens)) if i not in to_store]
    if files:
        # One device->host copy for the whole batch, then cheap CPU slicing.
        ids_c, aux_c, fin_c = input_ids.to("cpu"), aux.to("cpu"), hidden_states.to("cpu")
        for i in files:
            s, n = starts[i], lens[i]
            write_dump(dump_dir, ids_c[s:s + n], aux_c[s:s + n], fin_c[s:s + n], layer_ids, image(input_ids, s, n))
    return len(files) + (len(to_store) if store is not None else 0)


def _image_rows(meta: Any, input_ids: Any, vocab_size: int | None
                ) -> tuple[Any, Callable[[Any, int, int], dict[str, Any] | None]]:
    """The batch's ids, and (ids, start, length) -> that prompt's `image_parts` for a batch with images (its
    `mm_input_embeds`), else None. The models clamp their image pads in place before the embedding; the ids of an
    image batch are clamped here too, so a model that clamped a copy names its dumps by the ids the client computes."""
    embeds = getattr(meta, "mm_input_embeds", None)
    tokens = int(input_ids.shape[0])
    if embeds is not None and (vocab_size is None or int(embeds.shape[0]) != tokens):
        _warn_once("mm", f"a batch with images has merged input embeddings of {tuple(embeds.shape)} for {tokens} "
                         f"new tokens (vocab size {vocab_size}); none are handed over")
        embeds = None
    if embeds is None or vocab_size is None:
        return input_ids, lambda ids, s, n: None
    clamped = vocab_size - 1
    return input_ids.clamp(max=clamped), lambda ids, s, n: image_parts(ids[s:s + n], embeds[s:s + n], clamped)


def tp_disagreement(aux_hidden_states: Any, hidden_states: Any) -> str | None:
    """Why the TP ranks hold different states, or None when they agree (or there is one rank). Plain TP replicates
    the residual stream on every rank after each all-reduce, and rank 0 writes on that ground; a server that fuses
    the all-reduce into the next layer's norm (FlashInfer/AITER all-reduce fusion, turned on by SGLang for
    DeepSeek/Kimi at TP > 1 on Hopper) hands each rank a partial sum, which would be written as the layer's input
    without a word. A checksum of the batch's states, gathered over the TP group, tells the two apart."""
    import torch

    try:
        import torch.distributed as dist
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()
    except Exception:  # noqa: BLE001 - no SGLang (the CPU tests' fakes) or no TP group: one rank
        return None
    if group.world_size <= 1 or aux_hidden_states is None:
        return None
    parts = [aux_hidden_states] if isinstance(aux_hidden_states, torch.Tensor) else list(aux_hidden_states)
    mine = torch.stack([s for x in [*parts, hidden_states] for s in (x.double().sum(), x.double().abs().sum())])
    everyone = [torch.empty_like(mine) for _ in range(group.world_size)]
    dist.all_gather(everyone, mine, group=group.device_group)
    if all(torch.allclose(x, everyone[0], rtol=1e-6, atol=0.0) for x in everyone):
        return None
    return ("the TP ranks hold different hidden states (partial sums: all-reduce fusion is on; start the server "
            "with --enforce-disable-flashinfer-allreduce-fusion, as `eagle3 sglang serve` does), so nothing is "
            "written")


def _refuse_batch(why: str, rids: list[Any], starts: list[int], lens: list[int], input_ids: Any, dump_dir: str,
                  store: Any) -> None:
    """Every prompt of the batch answered with `why` instead of states (a store's error record, a dump folder's
    `.error` file), so the client raises it, naming the sample."""
    _warn_once("tp", why)
    for rid, s, n in zip(rids, starts, lens, strict=True):
        if store is not None and isinstance(rid, str) and rid.startswith(STORE_KEY_PREFIX):
            store.put_small(rid + "#error", why.encode())
        else:
            write_error(dump_dir, input_ids[s:s + n].to("cpu"), why)


def _put_in_store(store: Any, prompts: list[tuple[str, int, int, dict[str, Any] | None]], input_ids: Any, aux: Any,
                  final: Any, layer_ids: list[int]) -> None:
    """Each (rid, start, length, image parts) prompt's states into the store under its rid, encoded as the rid asks;
    a failed put leaves a small `<rid>#error` record with the reason, so the client says why instead of "not found"."""
    objects, errors = {}, {}
    for rid, s, n, image in prompts:
        try:
            storage = store_key_storage(rid)
            tensors, meta = prompt_states(input_ids[s:s + n], aux[s:s + n], final[s:s + n], layer_ids, storage,
                                          image)
            meta["segment_bytes"] = str(store.segment)
            meta["segment"] = store.segment_name
            objects[rid] = pack(tensors, meta)
        except Exception as e:  # noqa: BLE001 - reported to the client under the request's key
            errors[rid] = f"the server could not encode the states: {e}"
    for rid, code in store.put(objects).items():
        if code != 0:
            from eagle3.targets.mooncake import describe

            size = len(objects[rid][0]) + sum(p.numel() * p.element_size() for p in objects[rid][1])
            errors[rid] = (f"the server's put of {size / 1e6:.1f} MB failed: {describe(code)}; its segment lends "
                           f"{store.segment / 1e9:.2f} GB: raise target.sglang.mooncake.segment_gb (or clients) and "
                           "restart the servers")
    for rid, why in errors.items():
        _warn_once(f"put{why[:40]}", f"request {rid}: {why}")
        store.put_small(rid + "#error", why.encode())


def _vocab_size(lm_head: Any) -> int | None:
    """The vocabulary the model clamps image pads into (`input_embedding.num_embeddings`, mm_utils.py): the
    (parallel) lm_head's full, unpadded size, which equals its embedding's."""
    n = getattr(lm_head, "num_embeddings", None)
    return int(n) if n is not None else None


_STORE: list[Any] = []
"""The Mooncake Store connection of this scheduler process (TP rank 0 only), made once the model is loaded."""


def open_store() -> Any:
    """TP rank 0's connection to the store, lending EAGLE3_MOONCAKE_SEGMENT bytes; None without the environment.
    A server that should hand over through the store and cannot reach it refuses to start (this runs in the
    load-model hook, whose errors stop SGLang), naming why."""
    from eagle3.targets.mooncake import StateStore, StoreAddress

    addr = StoreAddress.from_env()
    if addr is None or _rank() != 0:
        return None
    if not _STORE:
        segment = int(os.environ.get(ENV_SEGMENT, "0"))
        _STORE.append(StateStore(addr, segment=segment, what="the SGLang capture server"))
        _say(f"Mooncake Store joined: master {addr.master}, segment {_STORE[0].segment_name} lending "
             f"{segment / 1e9:.2f} GB")
    return _STORE[0]


def plugin() -> None:
    """The `sglang.srt.plugins` entry point: register the two hooks when EAGLE3_SGLANG_DUMP_DIR is set."""
    if not os.environ.get(ENV_DUMP_DIR):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    dump_dir, layer_ids, family = _settings()
    ensure_dump_dir(dump_dir)
    store: list[Any] = []

    def after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(runner, "is_draft_worker", False):
            enable_capture(runner.model, layer_ids, family)
            store[:] = [open_store()]
        return result

    def before_logits(processor: Any, input_ids: Any, hidden_states: Any, lm_head: Any, logits_metadata: Any,
                      aux_hidden_states: Any = None, *args: Any, **kwargs: Any) -> None:
        try:
            capture_batch(input_ids, hidden_states, logits_metadata, aux_hidden_states, dump_dir, layer_ids,
                          store[0] if store else None, vocab_size=_vocab_size(lm_head))
        except Exception:  # a failed capture must not kill serving; the client reports the missing dump
            _warn_once("exc", "capture failed (the client will report the missing dump):\n" + traceback.format_exc())

    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.load_model", after_load_model,
                          HookType.AFTER)
    HookRegistry.register("sglang.srt.layers.logits_processor.LogitsProcessor.forward", before_logits,
                          HookType.BEFORE)
    _say(f"plugin active: dumps -> {dump_dir}, layer ids {layer_ids} ({family})"
         + (f", Mooncake Store at {os.environ['EAGLE3_MOONCAKE_MASTER']}"
            if os.environ.get("EAGLE3_MOONCAKE_MASTER") else ""))
