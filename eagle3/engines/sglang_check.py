"""Measure the head's acceptance inside a running SGLang server, on the prompts the built-in evaluator used.

    # the server, started by you with the SGLang export of the head:
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \
        --speculative-draft-model-path runs/x/export/sglang --speculative-num-steps 3 \
        --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
    eagle3 eval --config X --engine sglang target.sglang.url=http://127.0.0.1:30000

Each prompt goes to `/generate` as token ids; SGLang's `meta_info` carries `completion_tokens` and
`spec_verify_ct` (verify steps), and `spec_accept_length = completion_tokens / spec_verify_ct` (bonus included).
τ over the set is pooled the same way: sum of completion tokens / sum of verify steps.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def parse_sglang_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-request `meta_info` dicts -> pooled τ (Σ completion_tokens / Σ spec_verify_ct) and the mean of the
    per-request `spec_accept_length`."""
    completion = verify = 0
    per_request: list[float] = []
    for i, m in enumerate(metas):
        if "spec_verify_ct" not in m or "completion_tokens" not in m:
            raise ValueError(f"request {i}: meta_info has no spec_verify_ct/completion_tokens: was the server "
                             "started with --speculative-algorithm EAGLE3?")
        completion += int(m["completion_tokens"])
        verify += int(m["spec_verify_ct"])
        if m.get("spec_accept_length") is not None:
            per_request.append(float(m["spec_accept_length"]))
        elif int(m["spec_verify_ct"]) > 0:
            per_request.append(int(m["completion_tokens"]) / int(m["spec_verify_ct"]))
    if verify <= 0:
        raise ValueError("SGLang reported no verify steps: speculative decoding is not active on that server")
    return {
        "tau": completion / verify,
        "mean_request_accept_length": sum(per_request) / len(per_request) if per_request else float("nan"),
        "completion_tokens": completion,
        "verify_steps": verify,
        "requests": len(metas),
    }


def generate(url: str, input_ids: list[int], temperature: float, max_new_tokens: int, timeout_s: float
             ) -> dict[str, Any]:
    body = json.dumps({"input_ids": input_ids, "sampling_params": {"temperature": temperature,
                                                                   "max_new_tokens": max_new_tokens}}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - a user-given server URL
        return json.loads(resp.read())


def run_sglang(cfg: Any, prompts: list[list[int]]) -> dict[str, Any]:
    url = cfg.target.sglang.url
    if not url:
        raise ValueError("--engine sglang needs target.sglang.url (a server started with the SGLang export and "
                         "--speculative-algorithm EAGLE3)")
    metas = []
    for ids in prompts:
        out = generate(url, ids, cfg.eval.temperature, cfg.eval.max_new_tokens, cfg.target.sglang.timeout_s)
        metas.append(out.get("meta_info", {}))
    result = parse_sglang_meta(metas)
    result["url"] = url
    return result
