#!/usr/bin/env bash
# bash recipes/smollm2-135m/agentic.sh [key=value ...]     (configs/smollm2-135m-agentic.yaml; time: BENCHMARKS.md "Agentic data")
#
# A head for agentic traffic on a CPU: SmolLM2-135M-Instruct answers 300 tool prompts (BFCL's live questions,
# `bundled:bfcl-live`, rendered with their tools through the `chatml-tools` template), then run.sh trains a head on
# those answers mixed with 700 ShareGPT chats and measures it on MT-bench and on every BFCL category.
#   TOOL_PROMPTS  how many tool prompts SmolLM2 answers (default 300)
#   STAGES        passed to run.sh (default: prepare extract train export eval)
#   key=value     overrides for every stage (yours win, but for the regenerate stage's data.sources: the tool prompts)
# The head of the same budget and seed on ShareGPT alone (BENCHMARKS.md "Agentic data"):
#   bash recipes/smollm2-135m/agentic.sh output_dir=runs/smollm2-135m-sharegpt-1000 \
#       'data.sources=[{path: bundled:sharegpt, max_records: 1000}]'    # (its regenerate stage is skipped)
# Regeneration resumes where a killed run stopped; every later stage reuses what is on disk.
set -euo pipefail
cd "$(dirname "$0")/../.."

CONFIG=configs/smollm2-135m-agentic.yaml
source recipes/smollm2-135m/common.sh
OUT=$(output_dir "$CONFIG" "$@")
mkdir -p "$OUT/logs"

# The mixture reads the regenerated answers from the source whose file is named regenerated.jsonl: regenerate writes
# exactly there (whatever output_dir is), answering the tool prompts whatever data.sources the overrides give the
# later stages. A run whose data.sources has no such file (the ShareGPT-only comparison) regenerates nothing.
REGEN=$(source_path /regenerated.jsonl "$CONFIG" "$@")
if [ -n "$REGEN" ]; then
    log "regenerate: SmolLM2 answers ${TOOL_PROMPTS:-300} BFCL live tool prompts with chatml-tools -> $REGEN"
    eagle3 regenerate --config "$CONFIG" "$@" "data.sources=[{path: bundled:bfcl-live, max_records: ${TOOL_PROMPTS:-300}}]" \
        "regenerate.output=$REGEN" 2>&1 | tee "$OUT/logs/regenerate.log"
fi
CONFIG="$CONFIG" STAGES="${STAGES:-prepare extract train export eval}" exec bash recipes/smollm2-135m/run.sh "$@"
