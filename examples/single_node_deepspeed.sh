#!/usr/bin/env bash
# One node, 8 GPUs, tensor parallel 8, launched with the deepspeed launcher.
# Written from the documented interfaces; not run here (no GPU on the development machine).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/model_gpt2_1.3b.sh
deepspeed --num_gpus 8 pretrain_gpt.py \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 \
    "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}"
