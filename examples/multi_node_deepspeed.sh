#!/usr/bin/env bash
# Two nodes x 8 GPUs with the deepspeed launcher and a hostfile: TP=8 inside a node, PP=2 across nodes.
# Run on the first node listed in examples/hostfile. Written from the documented interfaces; not run here.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/model_gpt2_1.3b.sh
deepspeed --hostfile examples/hostfile --master_addr node001 --master_port 29500 pretrain_gpt.py \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 \
    "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}"
