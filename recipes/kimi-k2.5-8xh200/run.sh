#!/usr/bin/env bash
# MODEL=/models/Kimi-K2.5 bash recipes/kimi-k2.5-8xh200/run.sh [stage ...]
#   stages (default: all, in order): check regenerate prepare extract verify train export eval
#
# Kimi-K2.5 EAGLE-3 drafter on ONE node with 8x H200 (141 GB each), >= 1.5 TB NVMe, >= 4 GB /dev/shm.
# Time: ~30-60 min model load per SGLang start, regenerate 2-6 h (optional), extract 1-3 h, train 1-2 h (3 epochs),
# eval 30 min. Every stage resumes when re-run. Read README.md beside this file (and docs/kimi-k2.5.md) first.
# NOT YET RUN on GPUs: on CPU the real SGLang runs a tiny Kimi-shaped target (tests/test_sglang_*.py) and
# tests/test_kimi_recipe.py runs these stages; run scripts/gpu_check_sglang.sh on the node first.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL="${MODEL:-/models/Kimi-K2.5}"
CFG=configs/kimi-k2.5.yaml
OUT=runs/kimi-k2.5
PORT="${PORT:-30000}"
DRAFT="$OUT/export/sglang"
# Every eagle3 command gets the model path; add more dotted overrides through EXTRA (e.g. EXTRA="data.max_samples=2000").
OV=("target.path=$MODEL" ${EXTRA:-})
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(check regenerate prepare extract verify train export eval)
log() { echo "[$(date +%H:%M:%S)] $*"; }

wait_health() {  # wait_health PID: until the server on $PORT answers /health, or its process dies
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
        kill -0 "$1" 2>/dev/null || { log "server exited; see $OUT/logs/"; exit 1; }
        sleep 10
    done
}
stop_server() { kill -TERM -- "-$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

stage_check() {
    log "check: config, GPUs, disk, /dev/shm"
    eagle3 config show --config "$CFG" "${OV[@]}" >/dev/null
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    python -c "import sglang; print('sglang', sglang.__version__)"
    df -h "$OUT" 2>/dev/null || df -h .
    df -h /dev/shm   # needs >= 2 x (extract.batch_tokens x 57 KB) = ~4 GB for batch_tokens 32768
}

stage_regenerate() {
    # Optional but recommended: answers written by K2.5 itself (lightseekorg's K2.5 drafter: MT-Bench 2.69 vs 2.39
    # for a K2 drafter on the original answers). Plain SGLang here: the radix cache helps, no capture needed.
    # The parsers turn K2.5's call markers into tool_calls for conversations that carry tools (README "Agentic
    # data") and the think text into reasoning_content (regenerate reads the answer the same either way).
    mkdir -p "$OUT/logs"
    log "regenerate: starting SGLang (TP=8) on :$PORT"
    setsid python -m sglang.launch_server --model-path "$MODEL" --tp-size 8 --trust-remote-code \
        --tool-call-parser kimi_k2 --reasoning-parser kimi_k2 \
        --port "$PORT" --mem-fraction-static 0.85 >"$OUT/logs/sglang-regenerate.log" 2>&1 &
    local pid=$!
    trap "stop_server $pid" EXIT
    wait_health "$pid"
    eagle3 regenerate --config "$CFG" "${OV[@]}" "regenerate.endpoints=[http://127.0.0.1:$PORT/v1]"
    stop_server "$pid"; trap - EXIT
}

data_override() {  # train on the regenerated answers when they exist
    if [ -s "$OUT/regenerated.jsonl" ]; then echo "data.sources=[{path: $OUT/regenerated.jsonl}]"; fi
}

stage_prepare() {
    log "prepare: Kimi chat template (no newlines between turns), loss on answers + <|im_end|>, draft vocab 32000"
    local d; d=$(data_override)
    eagle3 prepare --config "$CFG" "${OV[@]}" ${d:+"$d"}
    python -c "import json; m = json.load(open('$OUT/prepared/meta.json')); print(json.dumps(m.get('summary'), indent=1)[:2000])"
}

stage_extract() {
    # The backend launches SGLang itself (target.sglang.url: null) with --disable-radix-cache and
    # --chunked-prefill-size -1, runs the preflight (disk for ~57 KB/token, layer ids vs 61 layers, a probe prompt
    # sent twice must come back whole), extracts, and stops the server on exit. Re-running resumes by shard.
    log "extract: ~1.2 TB for 10K samples x 2.1K tokens; watch the rate/ETA lines"
    eagle3 extract --config "$CFG" "${OV[@]}"
    eagle3 cache info "$OUT/cache"
}

stage_verify() {
    # Compare a few cached samples with an HF forward of the same model (per-layer cosine, token counts).
    # eagle3 reads the INT4 checkpoint itself (eagle3/targets/quantized.py, no compressed-tensors package): routed
    # experts stay packed, ~74 GB per GPU over all 8 (device_map auto), so run it with no server up.
    log "verify: cached states vs HF reference (slow: reads the 554 GB checkpoint)"
    eagle3 verify-extraction --config "$CFG" "${OV[@]}" target.device=auto --source "$OUT/cache" --num-samples 2
}

stage_train() {
    log "train: FSDP2 over 8 GPUs, TTT 4 steps, ~240 steps; acc_0 should rise through the first epoch (~80 steps)"
    accelerate launch --config_file recipes/accelerate/fsdp-8gpu.yaml train.py --config "$CFG" "${OV[@]}"
}

stage_export() {
    log "export: SGLang and vLLM formats; both spell the aux layers [2, 30, 58] for Kimi"
    eagle3 export --to sglang "$OUT/checkpoints/best" "$DRAFT"
    eagle3 export --to vllm "$OUT/checkpoints/best" "$OUT/export/vllm"
    python -c "import json; c = json.load(open('$DRAFT/config.json')); print({k: c.get(k) for k in ('architectures', 'draft_vocab_size', 'vocab_size', 'eagle_config')})"
}

stage_eval() {
    # eagle3 starts SGLang (TP=8) with the exported head as its EAGLE-3 draft and stops it after; SGLang alone
    # decodes every turn (eval.builtin: false in the config).
    log "eval: SGLang EAGLE-3, steps 3 / topk 1 / 4 draft tokens, on MT-bench (and GSM8K-style prompts if given)"
    eagle3 eval --config "$CFG" "${OV[@]}" --engine sglang "eval.checkpoint=$DRAFT"
}

for s in "${STAGES[@]}"; do "stage_$s"; done
log "done: ${STAGES[*]}"
