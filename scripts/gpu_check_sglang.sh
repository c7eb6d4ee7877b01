#!/usr/bin/env bash
# bash scripts/gpu_check_sglang.sh [pytest args]     (a GPU machine; sglang==0.5.23 installed beside eagle3)
#
# The real-SGLang test suite on GPUs, with SGLang's real kernels instead of the CPU stand-ins of tests/sglang_cpu:
# tests/test_sglang_real.py and tests/test_sglang_eval.py with EAGLE3_SGLANG_DEVICE=cuda (bf16). Tiny Llama,
# DeepseekV3 (MLA + MoE) and Kimi-K2.5-shaped targets at TP=1, TP=2 and TP=8 (as many as the GPUs allow):
# extraction through eagle3's capture plugin vs HF (verify-extraction), a SIGKILLed extraction resumed to the same
# bytes, online training, `eagle3 eval --engine sglang` vs the built-in evaluator with an exact head and a
# wrong-ids export, and the real SmolLM2 with a quickstart head (trained at a tiny budget when none is on disk).
# PASS = pytest exits 0. Expected: ~10 minutes on one node (each server starts in well under a minute).
#
# Run once on every new SGLang version and record the result in BENCHMARKS.md ("SGLang on GPU").
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python -c "import sglang" 2>/dev/null; then
    echo "sglang is not installed: pip install -e '.[sglang,dev]' (sglang==0.5.23)"
    pip install -e '.[sglang,dev]'
fi
nvidia-smi -L
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'FAIL: no CUDA device visible')"
EAGLE3_SGLANG_DEVICE=cuda EAGLE3_SGLANG_PYTHON="$(command -v python)" \
    python -m pytest -q -m sglang tests/test_sglang_real.py tests/test_sglang_eval.py "$@"
