#!/usr/bin/env bash
# bash scripts/gpu_check_sglang.sh [pytest args]     (your GPU machine, with sglang==0.5.23 installed)
#
# The real-SGLang suite on GPUs, with SGLang's own kernels instead of the CPU stand-ins of tests/sglang_cpu:
# tests/test_sglang_real.py and tests/test_sglang_eval.py with EAGLE3_SGLANG_DEVICE=cuda (bf16), tiny models only
# (Llama, DeepseekV3 with MLA + MoE, Kimi-K2.5-shaped) at TP=1, TP=2 and TP=8 (as many as the GPUs allow):
# extraction through eagle3's capture plugin vs HF (verify-extraction), a SIGKILLed extraction resumed to the same
# bytes, online training, `eagle3 eval --engine sglang` against the built-in evaluator with an exact head and an
# off-by-one export. The SmolLM2 test (slow: it fetches a model from PyPI) is left out.
#
# Needs: a CUDA GPU, Python with sglang==0.5.23 (and its torch) installed; no network (eagle3 itself is installed
# from this checkout without its dependencies, so pip fetches nothing). Bound: ${EAGLE3_SGLANG_CHECK_TIMEOUT:-1800} s
# for the whole run (each server starts in well under a minute on a GPU; the CPU run of the same tests takes ~18 min).
# PASS = pytest exits 0. Record the result in BENCHMARKS.md ("SGLang on GPU") with the GPU and driver.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
"$PY" -c "import sglang, sys; sys.exit(0 if sglang.__version__ == '0.5.23' else f'sglang {sglang.__version__}: this check is written against 0.5.23')" \
    || { echo "FAIL: needs sglang==0.5.23 installed for $PY (pip install 'sglang==0.5.23')" >&2; exit 2; }
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'FAIL: no CUDA device visible')"
command -v nvidia-smi >/dev/null && nvidia-smi -L
# Always this checkout, always with its entry points: the capture plugin is found through eagle3's
# `sglang.srt.plugins` entry point, and without it every capture test fails with "no dump".
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
"$PY" -c "from importlib.metadata import entry_points as e; import sys; sys.exit(0 if any(p.name == 'eagle3_capture' for p in e(group='sglang.srt.plugins')) else 'FAIL: the eagle3_capture plugin is not registered')"
EAGLE3_SGLANG_DEVICE=cuda EAGLE3_SGLANG_PYTHON="$(command -v "$PY")" CI=true \
    timeout "${EAGLE3_SGLANG_CHECK_TIMEOUT:-1800}" \
    "$PY" -m pytest -q -m "sglang and not slow" tests/test_sglang_real.py tests/test_sglang_eval.py "$@"
