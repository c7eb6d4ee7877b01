#!/usr/bin/env bash
# bash benchmarks/fresh_clone.sh NAME [native|avx2] [tests]     -> /tmp/fresh-NAME/{log,time,tests.log}
# README command 1 as a new user runs it, timed: a fresh clone of this repository's HEAD, an empty pip cache (pip
# still finds the torch wheel where the machine's pip config points) and an empty EAGLE3_HOME (the SmolLM2 GGUF is
# fetched at first use). `time` gets the wall time, whether anything but eagle3 was built from source, and the
# lines that say what precision and threads each stage chose. `tests` then runs README command 2 in the same clone.
# avx2 holds torch, oneDNN and MKL to their AVX2 kernels and pins the bf16 detection to "absent": a CPU without
# AVX-512 BF16, emulated on one that has it (BENCHMARKS.md "Quickstart").
set -u
NAME=$1; MODE=${2:-native}
REPO=$(cd "$(dirname "$0")/.." && pwd)
D=/tmp/fresh-$NAME; rm -rf "$D"; mkdir -p "$D"
git clone -q "$REPO" "$D/eagle3"
cd "$D/eagle3"
export PIP_CACHE_DIR=$D/pipcache EAGLE3_HOME=$D/home
if [ "$MODE" = avx2 ]; then
    export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 EAGLE3_NATIVE_BF16=0
fi
unset OMP_NUM_THREADS EAGLE3_CPU_THREADS
START=$(date +%s)
( python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e '.[gguf,data]' \
  && bash recipes/smollm2-135m/quickstart.sh ) >"$D/log" 2>&1
RC=$?
echo "rc $RC wall $(($(date +%s) - START)) s; built: $(grep 'Building wheels for' "$D/log" | tr '\n' ' ')" >"$D/time"
grep -E "τ on|stage times|: done in|dtype=auto|mixed_precision=auto|cpu_threads" "$D/log" >>"$D/time"
if [ "${3:-}" = tests ]; then
    ( . .venv/bin/activate && pip install -e '.[dev]' && T0=$(date +%s) && python -m pytest -q 2>&1 | tail -3 \
      && echo "pytest wall $(($(date +%s) - T0)) s" ) >"$D/tests.log" 2>&1
    echo "tests: $(grep 'Building wheels for' "$D/tests.log" | tr '\n' ' ') $(tail -2 "$D/tests.log" | tr '\n' ' ')" >>"$D/time"
fi
cat "$D/time"
