#!/usr/bin/env bash
# bash scripts/setup_torchvision.sh [PYTHON] [DIR]      # defaults: .venv/bin/python, .torchvision (git-ignored)
#
# Vision-language targets' processors (Kimi-K2.5's, Qwen2.5-VL's) need torchvision: Kimi's image processor and both
# video processors are torchvision-only in transformers 5. A GPU machine installs the torchvision of its torch
# (`pip install torchvision`); a CPU user installs the CPU build (`pip install torchvision --index-url
# https://download.pytorch.org/whl/cpu`). This machine and CI reach only PyPI, whose torchvision is built against
# CUDA torch: its native library cannot load beside the CPU torch, and importing it then fails. This script puts
# the PyPI wheel that matches the venv's torch, without dependencies, into DIR (never into the venv: the project's
# venv holds no CUDA build), and the tests load it through tests/vision_cpu/torchvision_stand_in.py, which declares
# the two operators the missing native library would have (only the pure-torch transforms the processors use run).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"
DIR="${2:-$ROOT/.torchvision}"
# torchvision 0.N pairs with torch 2.(N-15): 2.13 -> 0.28
VERSION="$("$PY" -c 'import torch; m = int(torch.__version__.split(".")[1]); print(f"0.{m + 15}.*")')"
if [ -d "$DIR/torchvision" ]; then
    echo "torchvision already in $DIR"
else
    "$PY" -m pip install --quiet --no-deps --target "$DIR" "torchvision==$VERSION"
fi
"$PY" -c "import sys; sys.path.insert(0, '$ROOT/tests'); from vision_cpu.torchvision_stand_in import load; \
print('OK: torchvision', load('$DIR').__version__, 'from $DIR')"
