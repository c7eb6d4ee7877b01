#!/usr/bin/env bash
# MODEL=/models/Kimi-K2.5 MASTER=10.0.0.1:50051 SERVERS=http://10.0.0.1:30000,http://10.0.0.2:30000 \
#     TRAINER_NODES=2 bash recipes/kimi-k2.5-8xh200/online.sh ROLE
#   ROLE, on each machine (docs/scale-out.md "Online across machines" has the topology and the arithmetic):
#     master   the Mooncake master (one, on any machine every other reaches; here the first inference node)
#     server   this inference node's SGLang capture server at TP=8, joined to the store (one per inference node)
#     prepare  the prepared data (once, on a machine that sees output_dir; the trainers read it)
#     check    a probe through every server and the store, from a trainer node (what every run's preflight does)
#     train    this trainer node's 8 processes (NODE_RANK=0..TRAINER_NODES-1, MASTER_ADDR=trainer node 0's address)
#
# Kimi-K2.5 serves on all 8 GPUs of a node, so online training puts the trainers on other nodes and the states cross
# the network through a Mooncake Store: nothing is written to disk, and a head can see the published heads' ~6B
# tokens (~340 TB as an offline cache). Every machine reads the same configs/kimi-k2.5.yaml with the overrides below;
# output_dir (prepared data, checkpoints) on a filesystem the trainer nodes share; the model folder on every machine
# (the trainers read its config.json, tokenizer, and the embeddings and lm_head alone).
# The master has no authentication: MASTER and SERVERS on the cluster's private network only.
# NOT YET RUN on GPUs: on CPU, tests/test_sglang_mooncake.py runs this topology with two real SGLang servers, a real
# master and two trainer "machines" (gloo); scripts/gpu_check.sh measures the capture rate when a GPU is lent.
set -euo pipefail
cd "$(dirname "$0")/../.."

ROLE="${1:?usage: online.sh master|server|prepare|check|train}"
MODEL="${MODEL:-/models/Kimi-K2.5}"
MASTER="${MASTER:?MASTER=host:port of the Mooncake master}"
SERVERS="${SERVERS:?SERVERS=http://host:port,... of the capture servers}"
TRAINER_NODES="${TRAINER_NODES:-1}"
STORAGE="${STORAGE:-exact}"   # fp8: half the bytes on the wire (28.7 instead of 57.4 KB a token)
CFG=configs/kimi-k2.5.yaml
OV=("target.path=$MODEL" extract.mode=online extract.storage="$STORAGE" target.sglang.transport=mooncake
    "target.sglang.url=[${SERVERS}]" "target.sglang.mooncake.master=$MASTER"
    "target.sglang.mooncake.clients=$((8 * TRAINER_NODES))" ${EXTRA:-})

case "$ROLE" in
    master)
        eagle3 mooncake master --config "$CFG" "${OV[@]}" ;;
    server)
        # This node's address as the trainers reach it (its segment of the store is read from there).
        HOST_IP="${HOST_IP:-$(hostname -I | awk '{print $1}')}"
        EAGLE3_MOONCAKE_HOSTNAME="$HOST_IP" eagle3 sglang serve --config "$CFG" "${OV[@]}" --host 0.0.0.0 \
            --port "${PORT:-30000}" ;;
    prepare)
        eagle3 prepare --config "$CFG" "${OV[@]}" ;;
    check)
        eagle3 mooncake check --config "$CFG" "${OV[@]}" ;;
    train)
        LAUNCHER=recipes/accelerate/fsdp-8gpu.yaml
        [ "$TRAINER_NODES" -gt 1 ] && LAUNCHER=recipes/accelerate/fsdp-2x8gpu.yaml
        accelerate launch --config_file "$LAUNCHER" --num_machines "$TRAINER_NODES" \
            --num_processes $((8 * TRAINER_NODES)) --machine_rank "${NODE_RANK:-0}" \
            --main_process_ip "${MASTER_ADDR:-127.0.0.1}" --main_process_port "${MAIN_PORT:-29500}" \
            train.py --config "$CFG" "${OV[@]}" ;;
    *)
        echo "unknown role $ROLE: master|server|prepare|check|train" >&2; exit 2 ;;
esac
