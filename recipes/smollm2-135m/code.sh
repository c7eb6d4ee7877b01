#!/usr/bin/env bash
# VLLM_PYTHON=.venv-vllm/bin/python bash recipes/smollm2-135m/code.sh [key=value ...]
#                                   (configs/smollm2-135m-code.yaml; time and figures: BENCHMARKS.md "Code and edits")
#
# A head for code, edits and tools on a CPU: SmolLM2-135M-Instruct answers ShareGPT's first CODE_PROMPTS code
# conversations (default 400; sampled at regenerate.temperature 0.7, through a vLLM server on loopback when
# VLLM_PYTHON is set, else in process) and TOOL_PROMPTS BFCL live tool prompts (default 300; greedy, in process with
# the chatml-tools template, as agentic.sh does: the same file), then run.sh trains a head on those answers mixed
# with ShareGPT's code and chats at the full recipe's budget, and evaluates it on MT-bench, HumanEval and code-edit
# with n-gram drafting beside it. Against vLLM's n-gram and suffix decoding on 80 prompts per set:
#   EAGLE3_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/bench_vs_ngram.py --config configs/smollm2-135m-code.yaml \
#       --checkpoint runs/smollm2-135m-code/checkpoints/best --engine-only
#   STAGES        passed to run.sh (default: prepare extract train export eval)
#   key=value     overrides for every stage (the regenerate stages read their own data.sources)
# Regeneration resumes where a killed run stopped (a finished file is skipped whole); every later stage reuses
# what is on disk.
set -euo pipefail
cd "$(dirname "$0")/../.."

CONFIG=configs/smollm2-135m-code.yaml
source recipes/smollm2-135m/common.sh
OUT=$(output_dir "$CONFIG" "$@")
mkdir -p "$OUT/logs"
# The mixture reads the answers from the sources whose files are named regenerated-code.jsonl and
# regenerated-tools.jsonl: regenerate writes exactly there, whatever output_dir is.
CODE=$(source_path /regenerated-code.jsonl "$CONFIG" "$@")
TOOLS=$(source_path /regenerated-tools.jsonl "$CONFIG" "$@")

if [ -n "$CODE" ]; then
    log "regenerate: SmolLM2 answers ${CODE_PROMPTS:-400} ShareGPT code conversations -> $CODE"
    regenerate_served bundled:sharegpt-code "${CODE_PROMPTS:-400}" "$CODE" "$OUT/logs/regenerate-code.log" "$@"
fi
if [ -n "$TOOLS" ]; then
    log "regenerate: SmolLM2 answers ${TOOL_PROMPTS:-300} BFCL live tool prompts with chatml-tools -> $TOOLS"
    eagle3 regenerate --config "$CONFIG" "$@" regenerate.backend=hf regenerate.temperature=0 regenerate.max_tokens=192 \
        "data.sources=[{path: bundled:bfcl-live, max_records: ${TOOL_PROMPTS:-300}}]" "regenerate.output=$TOOLS" \
        2>&1 | tee "$OUT/logs/regenerate-tools.log"
fi
CONFIG="$CONFIG" STAGES="${STAGES:-prepare extract train export eval}" exec bash recipes/smollm2-135m/run.sh "$@"
