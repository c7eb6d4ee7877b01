# source recipes/smollm2-135m/common.sh     (the pieces agentic.sh, code.sh, edits.sh and self_distill.sh share)

log() { echo "[$(date +%H:%M:%S)] $*"; }

# output_dir CONFIG [key=value ...]: the run's output_dir, the config validated with the overrides (a typo fails here,
# before any stage runs).
output_dir() {
    python -c 'import sys; from eagle3.config import load_config; print(load_config(sys.argv[1], sys.argv[2:]).output_dir)' "$@"
}

# source_path SUFFIX CONFIG [key=value ...]: the path of the config's data source whose file ends with SUFFIX (empty
# when none): the recipes regenerate exactly where the mixture reads, whatever output_dir and data.sources say.
source_path() {
    local suffix=$1; shift
    python -c 'import sys; from eagle3.config import load_config; print(next((s.path for s in load_config(sys.argv[2], sys.argv[3:]).data.sources if s.path.endswith(sys.argv[1])), ""))' \
        "$suffix" "$@"
}

# serve_smollm2 <log file> starts SmolLM2-135M-Instruct behind vLLM's OpenAI-compatible server on a free loopback
# port ($VLLM_PYTHON: a python with vllm, bash scripts/setup_vllm_cpu.sh makes one) and sets BACKEND to the regenerate
# overrides that use it (~170 generated tokens/s on a 2-core CPU, 6x the in-process HF backend: BENCHMARKS.md "Regeneration"). The
# server stops when the calling script exits, or at stop_smollm2. Without $VLLM_PYTHON, BACKEND is the HF backend.
# enforce-eager: vllm-cpu's compiled mode decoded wrong greedy text on this CPU. The context (2048) bounds the
# prompts: a conversation whose first prompt is longer fails and is listed in <output>.failed.jsonl.
serve_smollm2() {
    local server_log=$1
    if [ -z "${VLLM_PYTHON:-}" ]; then
        log "regenerate: VLLM_PYTHON not set, using the in-process HF backend (slow on a CPU)"
        BACKEND=(regenerate.backend=hf)
        return
    fi
    local model port
    model=$(python -c 'from eagle3.bundled import resolve_target_path as r; print(r("bundled:smollm2-135m-instruct"))')
    port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    log "regenerate: starting vLLM on 127.0.0.1:$port (log: $server_log)"
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
        --model "$model" --served-model-name smollm2 --host 127.0.0.1 --port "$port" --dtype bfloat16 \
        --max-model-len 2048 --enforce-eager >"$server_log" 2>&1 &
    SERVER=$!
    trap 'stop_smollm2' EXIT
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
        kill -0 "$SERVER" 2>/dev/null || { tail -20 "$server_log" >&2; exit 1; }
        sleep 2
    done
    BACKEND=(regenerate.backend=openai "regenerate.endpoints=[http://127.0.0.1:$port/v1]" regenerate.model=smollm2
             regenerate.concurrency=16)
}

stop_smollm2() {
    if [ -n "${SERVER:-}" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
    SERVER=
    trap - EXIT
}

# regenerate_served SOURCE COUNT OUTPUT LOG [key=value ...]: SmolLM2 answers the first COUNT records of the data source
# SOURCE into OUTPUT (the file the mixture reads) behind serve_smollm2's server, then stops it; $CONFIG and the
# overrides set the rest (the server's settings win over them). The command's output is teed to LOG, the server's
# log is vllm-server.log beside it.
regenerate_served() {
    local source=$1 count=$2 output=$3 log_file=$4; shift 4
    serve_smollm2 "$(dirname "$log_file")/vllm-server.log"
    eagle3 regenerate --config "$CONFIG" "$@" "${BACKEND[@]}" \
        "data.sources=[{path: $source, max_records: $count}]" "regenerate.output=$output" 2>&1 | tee "$log_file"
    stop_smollm2
}
