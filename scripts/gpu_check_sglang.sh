#!/usr/bin/env bash
# bash scripts/gpu_check_sglang.sh [pytest args]     (your GPU machine, with sglang==0.5.23 installed)
#
# The real-SGLang suite on GPUs, with SGLang's own kernels instead of the CPU stand-ins of tests/sglang_cpu:
# tests/test_sglang_real.py and tests/test_sglang_eval.py with EAGLE3_SGLANG_DEVICE=cuda (bf16), tiny models only
# (Llama, DeepseekV3 with MLA + MoE, Kimi-K2.5-shaped) at TP=1, TP=2 and TP=8 (as many as the GPUs allow):
# extraction through eagle3's capture plugin vs HF (verify-extraction), a SIGKILLed extraction resumed to the same
# bytes, fp8 extraction, online training, the Mooncake Store hand-over, `eagle3 eval --engine sglang` against the
# built-in evaluator with an exact head and an off-by-one export. The SmolLM2 test (slow: it fetches a model from
# PyPI) is left out.
#
# On CUDA the tiny targets take GPU shapes (tests/sglang_cpu/tiny_models.py `target_shape`): 8 attention heads (one
# a rank at TP 8), 2 KV heads for Llama (replicated at TP 8), Kimi-K2.5's own MLA dims (kv_lora 512 + rope 64, nope
# 128, v 128: the only latent SGLang's CUDA MLA kernels take) at hidden 256, widths and 8 experts that split 8 ways;
# tests/test_sglang_gpu_fixtures.py checks them against SGLang's rules on every CPU run.
#
# Needs: CUDA GPUs, Python with sglang==0.5.23 (and its torch) and the Mooncake Store client installed (the store
# tests: `bash scripts/setup_mooncake.sh $(command -v python)`); no network (eagle3 itself is installed from this
# checkout without its dependencies, so pip fetches nothing). Bound: ${EAGLE3_SGLANG_CHECK_TIMEOUT:-3600} s for the
# whole run. Expected (estimates, not yet measured: BENCHMARKS.md "The GPU checks"): 8 GPUs, 59 tests in
# ~25-40 min; 1 GPU, 23 tests (TP 1 only) in ~15-25 min; each SGLang start is most of a test's time.
# The last line is the verdict: `VERDICT: PASS: ...` (exit 0) or `VERDICT: FAIL: <the first reason>` (exit != 0).
# The log: ${OUT:-gpu-check-sglang}/pytest.log. Record the result in BENCHMARKS.md ("The GPU checks") with the GPU
# and driver.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
RESULTS="${OUT:-gpu-check-sglang}"
mkdir -p "$RESULTS"
fail() { echo "VERDICT: FAIL: $*"; exit 2; }
"$PY" -c "import sglang, sys; sys.exit(0 if sglang.__version__ == '0.5.23' else 1)" 2>/dev/null \
    || fail "needs sglang==0.5.23 for $PY (pip install 'sglang==0.5.23'; found: $("$PY" -c 'import sglang; print(sglang.__version__)' 2>&1 | tail -1))"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || fail "torch in $PY sees no CUDA device"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
command -v nvidia-smi >/dev/null && nvidia-smi -L
# Always this checkout, always with its entry points: the capture plugin is found through eagle3's
# `sglang.srt.plugins` entry point, and without it every capture test fails with "no dump".
"$PY" -m pip install -q --no-deps --no-build-isolation -e . || fail "pip install -e . (eagle3 from this checkout) failed"
"$PY" -c "from importlib.metadata import entry_points as e; import sys; sys.exit(0 if any(p.name == 'eagle3_capture' for p in e(group='sglang.srt.plugins')) else 1)" \
    || fail "the eagle3_capture plugin is not registered in $PY's sglang.srt.plugins entry points"
"$PY" -c "from eagle3.targets.mooncake import store_module; store_module()" 2>"$RESULTS/mooncake.err" \
    || fail "$(tail -1 "$RESULTS/mooncake.err") (the store tests need it: bash scripts/setup_mooncake.sh $(command -v "$PY"))"

EAGLE3_SGLANG_DEVICE=cuda EAGLE3_SGLANG_PYTHON="$(command -v "$PY")" CI=true \
    timeout "${EAGLE3_SGLANG_CHECK_TIMEOUT:-3600}" \
    "$PY" -m pytest -q -rfEs -p no:cacheprovider -m "sglang and not slow" --junitxml="$RESULTS/junit.xml" \
    tests/test_sglang_real.py tests/test_sglang_eval.py "$@" 2>&1 | tee "$RESULTS/pytest.log"
RC=${PIPESTATUS[0]}
"$PY" - "$RESULTS" "$RC" "$GPUS" "${EAGLE3_SGLANG_CHECK_TIMEOUT:-3600}" <<'VERDICT'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

results, rc, gpus, limit = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tps = [tp for tp in (1, 2, 8) if tp <= gpus]
log = results / "pytest.log"
if rc == 124:
    print(f"VERDICT: FAIL: the suite ran past {limit} s (EAGLE3_SGLANG_CHECK_TIMEOUT); {log} shows where")
    sys.exit(1)
xml = results / "junit.xml"
if not xml.is_file():
    print(f"VERDICT: FAIL: pytest exited {rc} before it wrote a report: {log}")
    sys.exit(1)
suite = ET.parse(xml).getroot()
suite = suite if suite.tag == "testsuite" else suite[0]
cases = list(suite.iter("testcase"))


def first(kind):
    for c in cases:
        e = c.find(kind)
        if e is not None:
            msg = (e.get("message") or e.text or "").strip().splitlines()
            return f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}: {msg[0][:300] if msg else kind}"
    return None


bad = first("failure") or first("error")
if bad or rc:
    print(f"VERDICT: FAIL: {bad or f'pytest exited {rc}'} ({log})")
    sys.exit(1)
skip = first("skipped")
if skip or not cases:
    print(f"VERDICT: FAIL: {'a test skipped where it should run: ' + skip if skip else 'no test ran'} ({log})")
    sys.exit(1)
missing = [f"TP {tp} needs {tp} GPUs" for tp in (2, 8) if tp > gpus]
print(f"VERDICT: PASS: {len(cases)} tests on {gpus} GPU(s), Llama / DeepseekV3 / Kimi-K2.5 at TP "
      f"{'/'.join(map(str, tps))}" + (f" ({', '.join(missing)}: not run)" if missing else ""))
VERDICT
