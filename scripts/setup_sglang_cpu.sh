#!/usr/bin/env bash
# bash scripts/setup_sglang_cpu.sh [VENV_DIR]        # default VENV_DIR=.venv-sglang (in the repository)
#
# Creates a SEPARATE virtualenv with the real SGLang 0.5.23 for the CPU tests against the engine:
#   bash scripts/setup_sglang_cpu.sh && pytest -m sglang
# (the tests find the venv at .venv-sglang, or at $EAGLE3_SGLANG_PYTHON). Kept apart from eagle3's .venv because
# SGLang pins its own torch (2.14.1), transformers and tokenizers. eagle3 itself is installed there too, without
# dependencies (editable), because the SGLang server processes import eagle3's capture plugin.
#
# What makes SGLang run on a CPU-only machine (facts from ../shared/SGLANG-CPU.md, verified by this script's
# final import check and by the tests):
#   - torch 2.14.1 (the CUDA build: the CPU torch 2.13 does not work, SGLang imports torchvision, and PyPI's
#     torchvision needs the CUDA torch); it imports and runs on a CPU with the nvidia-* libraries present;
#   - `sglang==0.5.23 --no-deps`, then its requirements without the CUDA-only kernels (sglang-kernel, flashinfer,
#     flash-attn, deep-ep, deep-gemm, flash-mla, tilelang, cutlass-dsl, nvshmem, torch_memory_saver,
#     torchaudio, torchcodec, quack, humming);
#   - the GPU kernels SGLang calls on its CPU path come from stand-ins under tests/sglang_cpu/ (a pure-PyTorch
#     `sgl_kernel`, and patches loaded by `sitecustomize`); the tests put that folder on PYTHONPATH. They are
#     test support only: nothing under eagle3/ imports them.
#
# Idempotent: an existing venv whose sglang imports (at the pinned version) is left alone; eagle3 is re-linked.
# ~6 GB on disk; a few minutes on a fresh box (needs PyPI, or this machine's wheel mirror).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
SGLANG_VERSION="0.5.23"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $($PY --version)"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if "$VENV/bin/python" -c "import sglang, soundfile, sys; sys.exit(sglang.__version__ != '$SGLANG_VERSION')" 2>/dev/null; then
    echo "sglang $SGLANG_VERSION already importable in $VENV"
else
    "${PIP[@]}" install -q --upgrade pip
    "${PIP[@]}" install -q torch==2.14.1 torchvision==0.29.1
    "${PIP[@]}" install -q --no-deps "sglang==$SGLANG_VERSION"
    # SGLang's own requirements, less the CUDA-only kernels (its METADATA pins kept where it pins them).
    "${PIP[@]}" install -q \
        "transformers==5.19.0" "tokenizers==0.23.2" "compressed-tensors==0.18.0" "numba==0.65.1" \
        "outlines==0.1.11" "xgrammar==0.2.7" "sentencepiece==0.2.1" "openai==2.8.0" "openai-harmony==0.0.4" \
        "timm==1.0.25" "blobfile==3.0.0" "llguidance>=1.7.6,<2" "soundfile==0.13.1" "python-dateutil<3" \
        "apache-tvm-ffi==0.1.11" \
        aiohttp anthropic datasets distro easydict einops fastapi gguf interegular IPython msgspec ninja numpy \
        nvidia-ml-py orjson packaging partial_json_parser pillow "prometheus-client>=0.20" psutil pybase64 \
        pydantic python-dateutil python-multipart "pyzmq>=25.1.2" regex requests scipy setproctitle tiktoken tqdm \
        "uvicorn>=0.51" uvloop watchfiles xxhash zstandard safetensors pyyaml accelerate
fi

# eagle3 itself (its capture plugin is imported by every SGLang scheduler process), without its dependencies:
# the SGLang venv keeps SGLang's pins.
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$ROOT" 2>/dev/null \
    || "${PIP[@]}" install -q --no-deps -e "$ROOT"

# The Mooncake Store client (the `mooncake` transport: the capture plugin puts states into the store), and the
# libibverbs it links.
bash "$ROOT/scripts/setup_mooncake.sh" "$VENV/bin/python"

PYTHONPATH="$ROOT/tests/sglang_cpu${PYTHONPATH:+:$PYTHONPATH}" SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" - <<'EOF'
import sglang, torch, transformers
import sgl_kernel  # the stand-in from tests/sglang_cpu
from sglang.srt.layers.logits_processor import LogitsProcessor  # noqa: F401 - the import the server needs
import eagle3
import mooncake.store  # noqa: F401 - the `mooncake` transport's client
print(f"OK: sglang {sglang.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"sgl_kernel stand-in {sgl_kernel.__file__}")
EOF
echo "use: pytest -m sglang   (or EAGLE3_SGLANG_PYTHON=$VENV/bin/python pytest -m sglang)"
