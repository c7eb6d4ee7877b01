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
source recipes/smollm2-135m/common.sh
OUT=$(output_dir "$CONFIG" output_dir=runs/smollm2-135m-sd "$SAMPLES" "$@")
REGEN="$OUT/regenerated.jsonl"
OV=("output_dir=$OUT" "$SAMPLES" "data.sources=[{path: $REGEN}]" train.max_steps=294 "$@")
mkdir -p "$OUT/logs"

serve_smollm2 "$OUT/logs/vllm-server.log"

# Answers are capped at 512 tokens: data.max_length is 512, so prepare would cut anything longer.
eagle3 regenerate --config "$CONFIG" "output_dir=$OUT" "$SAMPLES" "${BACKEND[@]}" regenerate.max_tokens=512 "$@" \
    2>&1 | tee "$OUT/logs/regenerate.log"
stop_smollm2

CONFIG="$CONFIG" STAGES="${STAGES:-prepare extract train export eval eval_tree}" \
    bash recipes/smollm2-135m/run.sh "${OV[@]}"
