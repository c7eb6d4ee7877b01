"""The capture server's command line, and what a running one must report, for eagle3's capture to be whole.

    flags = capture_flags(cfg.target, cfg.data.max_length, model_path)   # `sglang.launch_server` flags
    check_server_info(url, cfg.target, cfg.data.max_length)              # a running server's /server_info

Every flag here answers one way SGLang would hand over fewer, other or partial states than the prompt's: a radix-
cache hit or a chunked prefill (tokens missing or split), DP attention (sharded states), all-reduce fusion (each TP
rank a partial sum), a prefill CUDA graph (the model replayed without eagle3's hooks), a context too short for
`data.max_length`. eagle3's own command sets them (eagle3.targets.sglang), `target.sglang.launch_args` may not
undo them, and the preflight checks a server started by hand against the same list.
"""

from __future__ import annotations

import logging
from typing import Any

from eagle3.config import TargetConfig
from eagle3.targets.info import TargetInfo
from eagle3.targets.sglang_server import server_info

log = logging.getLogger("eagle3")

# Flags eagle3 sets itself, or that would drop/split tokens or shard the states: refused in launch_args.
_REFUSED_FLAGS = {
    "--model-path": "set target.path",
    "--model": "set target.path",
    "--tp-size": "set target.sglang.tp_size",
    "--tp": "set target.sglang.tp_size",
    "--port": "set target.sglang.url (or let eagle3 pick a free port)",
    "--host": "set target.sglang.url",
    "--dtype": "set target.dtype",
    "--chunked-prefill-size": "chunked prefill splits prompts; eagle3 disables it (-1)",
    "--enable-mixed-chunk": "mixed chunks split prompts",
    "--enable-dp-attention": "DP attention shards hidden states across ranks; rank 0 would dump a part",
    "--attn-dp-size": "DP attention shards hidden states across ranks; rank 0 would dump a part",
    "--speculative-algorithm": "extraction serves the target alone",
    "--pp-size": "pipeline parallelism puts the aux layers on different ranks",
    "--cuda-graph-backend-prefill": "a prefill CUDA graph replays the model without eagle3's capture hooks; eagle3 "
                                    "disables them",
    "--cuda-graph-config": "it can turn prefill CUDA graphs on; eagle3 disables them",
    "--enable-piecewise-cuda-graph": "a prefill CUDA graph replays the model without eagle3's capture hooks",
    "--flashinfer-allreduce-fusion-backend": "all-reduce fusion hands each TP rank a partial sum of the residual",
    "--enable-flashinfer-allreduce-fusion": "all-reduce fusion hands each TP rank a partial sum of the residual",
    "--enable-aiter-allreduce-fusion": "all-reduce fusion hands each TP rank a partial sum of the residual",
}


def check_launch_args(args: list[str]) -> None:
    """Refuse extra flags that eagle3 owns or that would silently drop, split or shard tokens."""
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in _REFUSED_FLAGS:
            raise ValueError(f"target.sglang.launch_args: {flag} is not allowed here ({_REFUSED_FLAGS[flag]})")
        if flag.startswith("--speculative-"):
            raise ValueError(f"target.sglang.launch_args: {flag}: extraction serves the target without a draft")


def target_flags(target: TargetConfig, model_path: str, role_flags: list[str]) -> list[str]:
    """`sglang.launch_server` flags serving the configured target (host and port apart): the target's own, then
    `role_flags` (what the capture server or the EAGLE-3 server adds), then `target.sglang.launch_args`."""
    s = target.sglang
    check_launch_args(s.launch_args)
    flags = ["--model-path", model_path, "--tp-size", str(s.tp_size), "--dtype", target.dtype, *role_flags]
    if target.trust_remote_code:
        flags.append("--trust-remote-code")
    if target.revision:
        flags += ["--revision", target.revision]
    return flags + list(s.launch_args)


CONTEXT_MARGIN = 7
"""Tokens SGLang 0.5.23 keeps beyond the longest prompt it takes: a prompt must be shorter than
`max_req_input_len` = min(context length, KV pool) - 6 (`tp_worker.py`), and `max_new_tokens` fits after it."""


def capture_context(target: TargetConfig, max_length: int) -> int:
    """The capture server's `--context-length`: room for a `data.max_length` prompt (CONTEXT_MARGIN), or the one
    `target.sglang.launch_args` gives, which must leave that room."""
    need = max_length + CONTEXT_MARGIN
    args = target.sglang.launch_args
    for i, a in enumerate(args):
        flag, _, value = a.partition("=")
        if flag == "--context-length":
            given = int(value or (args[i + 1] if i + 1 < len(args) else 0))
            if given < need:
                raise ValueError(f"target.sglang.launch_args: --context-length {given} is too short for "
                                 f"data.max_length {max_length} (SGLang needs {need}: each prompt plus "
                                 f"{CONTEXT_MARGIN}); drop it, eagle3 sets it from data.max_length")
            return given
    return need


def capture_env(target: TargetConfig, max_length: int, info: TargetInfo) -> dict[str, str]:
    """SGLang refuses a context longer than the model's window unless told otherwise; a `data.max_length` prompt at
    the very end of the window needs CONTEXT_MARGIN slots past it, never prefilled (`max_new_tokens: 1` stops after
    the prefill), so the capture server is told when that is all it is."""
    from eagle3.rope import context_window

    window = context_window(info.text)
    if window is not None and max_length <= window < capture_context(target, max_length):
        return {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    return {}


def capture_flags(target: TargetConfig, max_length: int, model_path: str) -> list[str]:
    """The capture server's flags for this target and data.max_length (host and port apart)."""
    context = capture_context(target, max_length)  # refuses a launch_args one that is too short
    given = any(a.partition("=")[0] == "--context-length" for a in target.sglang.launch_args)
    return target_flags(target, model_path, [
        *([] if given else ["--context-length", str(context)]),  # a data.max_length prompt fits
        "--disable-radix-cache",          # a prefix hit would prefill (and dump) only the tail of a prompt
        "--chunked-prefill-size", "-1",   # a chunk would be dumped as a separate, partial prompt
        # SGLang 0.5.23 captures prefill CUDA graphs by default on CUDA (its breakable graphs, Kimi/DeepSeek
        # included), off on the CPU, so the CPU suite never meets them: a replayed graph runs the model without the
        # Python hooks eagle3 captures in. Decode graphs only cost startup (extraction is prefill).
        "--cuda-graph-backend-prefill", "disabled",
        "--cuda-graph-backend-decode", "disabled",
        "--skip-server-warmup",           # its request would only leave a stray dump
        # At TP>1 on Hopper/Blackwell SGLang fuses the all-reduce into the next layer's residual RMSNorm for
        # DeepSeek/Kimi (and other MoE) models: the residual stream a layer hands on is then not yet summed over
        # the TP ranks, and rank 0 would dump its own partial sum as the layer's input.
        "--enforce-disable-flashinfer-allreduce-fusion",
    ])


def prefill_graphs(info: dict[str, Any]) -> str | None:
    """What a server's /server_info says of prefill CUDA graphs, when they are on: SGLang 0.5.23's resolved
    `cuda_graph_config.prefill.backend` (breakable by default on CUDA), or the older `enable_piecewise_cuda_graph`."""
    config = info.get("cuda_graph_config")
    if isinstance(config, dict):
        backend = (config.get("prefill") or {}).get("backend")
        if backend not in (None, "disabled"):
            return f"cuda_graph_config.prefill.backend={backend}"
    if info.get("enable_piecewise_cuda_graph"):
        return "enable_piecewise_cuda_graph"
    return None


def longest_prompt(info: dict[str, Any]) -> int | None:
    """The longest prompt a server with these /server_info answers takes: one less than its scheduler's
    `max_req_input_len` (context length and KV pool both count), else its context length less CONTEXT_MARGIN;
    None when it says neither."""
    if info.get("max_req_input_len") is not None:
        return int(info["max_req_input_len"]) - 1
    if info.get("context_length") is not None:
        return int(info["context_length"]) - CONTEXT_MARGIN
    return None



def check_server_info(url: str, target: TargetConfig, max_length: int) -> None:
    """A running capture server's resolved flags (/server_info) against what extraction needs: every token
    prefilled in one piece, states replicated on every TP rank, the hooks run (no prefill graph), prompts of
    `max_length` taken."""
    info = server_info(url)
    if info is None:
        log.warning("preflight: %s answers neither /server_info nor /get_server_info; flags not checked", url)
        return
    problems = []
    if info.get("disable_radix_cache") is False:
        problems.append("the radix cache is on (start with --disable-radix-cache)")
    cps = info.get("chunked_prefill_size")
    if cps is not None and int(cps) > 0:
        problems.append(f"chunked prefill is on (size {cps}; start with --chunked-prefill-size -1)")
    if info.get("enable_dp_attention") or int(info.get("attn_dp_size") or 1) > 1:
        problems.append("DP attention is on (hidden states are sharded; start without --attn-dp-size)")
    if any(info.get(k) for k in ("flashinfer_allreduce_fusion_backend", "enable_flashinfer_allreduce_fusion",
                                 "enable_aiter_allreduce_fusion")):
        problems.append("all-reduce fusion is on (a layer's input is a partial sum over the TP ranks; start with "
                        "--enforce-disable-flashinfer-allreduce-fusion, without --enable-aiter-allreduce-fusion)")
    graphs = prefill_graphs(info)
    if graphs:
        problems.append(f"prefill CUDA graphs are on ({graphs}: a replayed graph skips eagle3's capture; start "
                        "with --cuda-graph-backend-prefill disabled)")
    longest = longest_prompt(info)
    if longest is not None and longest < max_length:
        problems.append(f"it takes prompts of at most {longest} tokens, data.max_length is "
                        f"{max_length} (start it with --context-length "
                        f"{capture_context(target, max_length)} and a KV pool that holds as many "
                        "tokens, or lower data.max_length)")
    if problems:
        raise RuntimeError(f"preflight: the SGLang server at {url} would drop or split tokens: "
                           + "; ".join(problems))
    tp = info.get("tp_size")
    if tp is not None and int(tp) != target.sglang.tp_size:
        log.warning("preflight: the server at %s runs TP=%s, target.sglang.tp_size is %d", url, tp,
                    target.sglang.tp_size)
