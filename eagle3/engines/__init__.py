"""Acceptance measured inside the serving engines, to compare with eagle3's built-in evaluator.

`vllm_eval` runs vLLM offline (in a subprocess, possibly in vLLM's own virtualenv) and reads its spec-decode
counters; `sglang_eval` asks a running SGLang server. Both replay the exact prompts the built-in evaluator used.
"""
