#!/usr/bin/env bash
# bash scripts/gpu_check.sh [--cpu] [--tiny] [--budget-s 480]     (results: $OUT, else ./gpu-check)
#
# eagle3 on a GPU (or a node: the NCCL part takes 2 of its GPUs) in one call; scripts/gpu_check.py says what it runs
# and measures. On a machine without network, the packages eagle3 needs beyond torch/transformers/accelerate/pyarrow
# travel as wheels in .whl/ (bash scripts/gpu_wheels.sh fetches them here); they are installed into /tmp/site, never
# over the machine's own. The lent GPU (device tool), from the repository root here:
#     bash scripts/gpu_wheels.sh
#     run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=570)
# and the figures come back in $OUT/gpu_check.json and $OUT/summary.txt. The last line printed is the verdict,
# `VERDICT: PASS: ...` (exit 0) or `VERDICT: FAIL: <the first reason>` (exit 1); what to expect on 8 x H200 and on
# 1 x H100: BENCHMARKS.md "The GPU checks" (estimates until a GPU runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
# Only where eagle3's own needs are missing (the device): a development venv keeps its packages.
if ! "$PY" -c "import datasets, pydantic" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L || true
exec "$PY" scripts/gpu_check.py "$@"
