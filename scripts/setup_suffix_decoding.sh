#!/usr/bin/env bash
# PYTHON=.venv-vllm/bin/python bash scripts/setup_suffix_decoding.sh [DIR]   # DIR: .vllm-suffix (git-ignored)
#
# vLLM's suffix decoding (speculative_config method "suffix") needs arctic-inference's suffix tree, and PyPI has
# arctic-inference 0.3.0 only as a source distribution whose full build wants CUDA kernels and a torch of its own.
# The suffix tree alone is a small C++ extension (nanobind): this script downloads the sdist, builds just that
# module in a throwaway venv (nanobind, cmake, ninja from PyPI) for the Python vLLM runs on ($PYTHON), and lays out
#   DIR/arctic_inference/__init__.py               (empty: nothing else of the package is imported)
#   DIR/arctic_inference/suffix_decoding/*.py + _C.*.so
# Put DIR on vLLM's PYTHONPATH (benchmarks/bench_vs_ngram.py does): nothing is installed into the vLLM venv, and
# arctic-inference's vLLM plugin (which patches vLLM when it is installed) stays out.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.vllm-suffix}"
PY="${PYTHON:-python3}"
VERSION="0.3.0"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# The sdist itself, not `pip download`: that prepares the package's metadata, building its CUDA-minded build
# dependencies from source on the way.
"$PY" - "$VERSION" "$WORK" <<'PYEOF'
import json, sys, urllib.request
version, work = sys.argv[1], sys.argv[2]
req = urllib.request.Request("https://pypi.org/simple/arctic-inference/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
name = f"arctic_inference-{version}.tar.gz"
sdist = next(f for f in files if f["filename"] == name)
urllib.request.urlretrieve(sdist["url"], f"{work}/{name}")
PYEOF
tar xzf "$WORK"/arctic_inference-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/arctic_inference-$VERSION"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q nanobind==2.9.2 cmake ninja
"$WORK/venv/bin/cmake" -S "$SRC/csrc/suffix_decoding" -B "$WORK/build" -G Ninja \
    -DPython_EXECUTABLE="$WORK/venv/bin/python" >"$WORK/cmake.log"
"$WORK/venv/bin/cmake" --build "$WORK/build" >"$WORK/build.log"
rm -rf "$DIR"
mkdir -p "$DIR/arctic_inference/suffix_decoding"
: >"$DIR/arctic_inference/__init__.py"
cp "$SRC"/arctic_inference/suffix_decoding/*.py "$WORK"/build/_C*.so "$DIR/arctic_inference/suffix_decoding/"
PYTHONPATH="$DIR" "$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache as C; C(max_tree_depth=8, max_cached_requests=1)"
echo "OK: arctic-inference $VERSION suffix tree in $DIR (PYTHONPATH=$DIR for vLLM's method=suffix)"
