#!/usr/bin/env bash
# VLLM_PYTHON=.venv-vllm/bin/python bash recipes/smollm2-135m/edits.sh [key=value ...]
#                                   (configs/smollm2-135m-edits.yaml; time and figures: BENCHMARKS.md "Code and edits")
#
# The full recipe's chats plus edit requests: SmolLM2-135M-Instruct answers the first EDIT_PROMPTS (default 600)
# `bundled:code-edits` prompts greedily (through a vLLM server on loopback when VLLM_PYTHON is set, else in process),
# then run.sh trains a head on those answers beside the recipe's ShareGPT chats at the full recipe's budget.
# Against vLLM's n-gram on 80 prompts per set:
#   EAGLE3_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/bench_vs_ngram.py --config configs/smollm2-135m-edits.yaml \
#       --checkpoint runs/smollm2-135m-edits/checkpoints/best --engine-only --suffix none
#   STAGES        passed to run.sh (default: prepare extract train export eval)
#   key=value     overrides for every stage (the regenerate stage reads its own data.sources)
# Regeneration resumes where a killed run stopped (a finished file is skipped whole); every later stage reuses what
# is on disk.
set -euo pipefail
cd "$(dirname "$0")/../.."

CONFIG=configs/smollm2-135m-edits.yaml
source recipes/smollm2-135m/common.sh
OUT=$(output_dir "$CONFIG" "$@")
mkdir -p "$OUT/logs"
# The mixture reads the answers from the source whose file is named regenerated-edits.jsonl: regenerate writes
# exactly there, whatever output_dir is.
EDITS=$(source_path /regenerated-edits.jsonl "$CONFIG" "$@")

if [ -n "$EDITS" ]; then
    log "regenerate: SmolLM2 answers ${EDIT_PROMPTS:-600} edit requests -> $EDITS"
    regenerate_served bundled:code-edits "${EDIT_PROMPTS:-600}" "$EDITS" "$OUT/logs/regenerate-edits.log" "$@"
fi
CONFIG="$CONFIG" STAGES="${STAGES:-prepare extract train export eval}" exec bash recipes/smollm2-135m/run.sh "$@"
