#!/usr/bin/env bash
# bash recipes/smollm2-135m/ablations.sh [variant ...]    (after run.sh; variants: top ttt1 vocab4096 vocab16384)
#
# Ablations of the full CPU run at the same budget (configs/smollm2-135m.yaml: same data, steps, lr, eval), all on
# ONE extraction cache (runs/smollm2-135m/cache), each into runs/smollm2-135m/abl/<variant>:
#   top        draft.features=top: only the high aux state reaches fc (EAGLE-1/2 style), in training and eval
#   ttt1       train.ttt_steps=1: no training-time test (the head never sees its own outputs)
#   vocabN     draft.vocab_size=N: a real `eagle3 prepare` with that vocab (seconds) into its own folder; the
#              cache is the same one (its fingerprint follows the prepared samples, not the draft vocab)
# Each variant trains (train stage of run.sh) and runs the chain eval (steps 3 / topk 1 / 4 draft tokens).
# Extra key=value overrides for every variant: EXTRA="train.max_steps=10 ...", or EXTRA="output_dir=<run> data.max_samples=N"
# for the ablations of another base run (its cache and prepared data; the variants go to <run>/abl/<variant>).
set -euo pipefail
cd "$(dirname "$0")/../.."

CONFIG="${CONFIG:-configs/smollm2-135m.yaml}"
read -r -a EXTRA_OV <<<"${EXTRA:-}"
BASE=$(python -c 'import sys; from eagle3.config import load_config; print(load_config(sys.argv[1], sys.argv[2:]).output_dir)' \
       "$CONFIG" "${EXTRA_OV[@]}")
VARIANTS=("$@")
[ ${#VARIANTS[@]} -eq 0 ] && VARIANTS=(top ttt1 vocab4096)
[ -f "$BASE/cache/meta.json" ] || { echo "no cache at $BASE/cache: run recipes/smollm2-135m/run.sh first" >&2; exit 1; }

for v in "${VARIANTS[@]}"; do
    out="$BASE/abl/$v"
    # EXTRA first: it may move the base run (output_dir=...), but each variant's own folders must win.
    shared=("${EXTRA_OV[@]}" "output_dir=$out" "data.output_dir=$BASE/prepared" "extract.cache_dir=$BASE/cache")
    case "$v" in
        top)   ov=(draft.features=top) ;;
        ttt*)  ov=("train.ttt_steps=${v#ttt}") ;;
        vocab*)
            n=${v#vocab}
            shared=("${EXTRA_OV[@]}" "output_dir=$out" "data.output_dir=$BASE/abl/prepared-v$n"
                    "extract.cache_dir=$BASE/cache")
            ov=("draft.vocab_size=$n")
            CONFIG="$CONFIG" STAGES=prepare bash recipes/smollm2-135m/run.sh "${shared[@]}" "${ov[@]}"
            ;;
        *) echo "unknown variant $v (top, ttt<k>, vocab<N>)" >&2; exit 2 ;;
    esac
    echo "[$(date +%H:%M:%S)] ablation $v: ${ov[*]} -> $out"
    CONFIG="$CONFIG" STAGES="train eval" bash recipes/smollm2-135m/run.sh "${shared[@]}" "${ov[@]}"
done
