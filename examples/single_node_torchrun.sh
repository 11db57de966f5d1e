#!/usr/bin/env bash
# One node, 8 GPUs: TP=2, PP=2, DP=2, launched with torchrun (same flags as the deepspeed launcher).
# Written from the documented interfaces; not run here (no GPU on the development machine).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/model_gpt2_1.3b.sh
torchrun --standalone --nproc_per_node 8 pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}"
