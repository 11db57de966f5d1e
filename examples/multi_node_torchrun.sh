#!/usr/bin/env bash
# N nodes x 8 GPUs with torchrun and a c10d rendezvous. Run this same script on every node:
#   NNODES=2 RDZV_HOST=node001 bash examples/multi_node_torchrun.sh
# --max-restarts makes the job elastic: if a rank dies, all restart and resume from the latest
# complete checkpoint in --load. Written from the documented interfaces; not run here.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/model_gpt2_1.3b.sh
torchrun --nnodes "${NNODES:-2}" --nproc_per_node 8 \
    --rdzv_backend c10d --rdzv_endpoint "${RDZV_HOST:?set RDZV_HOST}:29400" --rdzv_id "${JOB_ID:-gpt}" \
    --max-restarts 3 \
    pretrain_gpt.py --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 \
    "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}"
