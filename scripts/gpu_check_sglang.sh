#!/usr/bin/env bash
# bash scripts/gpu_check_sglang.sh [MODEL_PATH]
#
# One-GPU check of the SGLang extraction backend against the HF backend, on a small Llama-family model that is
# available offline (default: the bundled SmolLM2-135M-Instruct, materialised as safetensors by eagle3).
# It launches SGLang through eagle3's capture patch (eagle3/targets/sglang_server.py), captures a few prompts
# (one ~1.5K tokens long, one repeated), compares every token's aux (low/mid/high) and final states with an HF
# forward (per-layer cosine >= 0.99, equal token counts), then runs
# `eagle3 verify-extraction --source backend` when that command exists. Prints PASS or FAIL; exits non-zero on FAIL.
#
# Expected runtime on one H100/H200: ~2-4 min (server start ~1 min, checks < 1 min), plus the sglang install if
# it is missing (several minutes, and it needs PyPI: on an offline box install `.[sglang]` beforehand).
#
# NOT YET RUN ON A GPU: it was written in a task without a device, from SGLang 0.5.23's sources; the CPU tests
# (tests/test_sglang_backend.py) exercise everything except SGLang itself. Run it before trusting a Kimi cache.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python -c "import sglang" 2>/dev/null; then
    echo "sglang is not installed: pip install -e '.[sglang]' (sglang==0.5.23)"
    pip install -e '.[sglang]'
fi
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'FAIL: no CUDA device visible')"

MODEL="${1:-$(python -c 'from eagle3.bundled import materialise_smollm2; print(materialise_smollm2())')}"
exec python scripts/gpu_check_sglang.py --model "$MODEL" --out "${EAGLE3_GPU_CHECK_OUT:-runs/gpu-check-sglang}"
