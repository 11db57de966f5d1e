#!/usr/bin/env bash
# N nodes x 8 GPUs with torchrun and a c10d rendezvous. Run this same script on every node:
#   NNODES=2 MASTER_ADDR=node001 bash examples/multi_node_torchrun.sh
# or let Slurm start it on every node: LAUNCHER=torchrun sbatch examples/slurm_multi_node.sbatch.
# Sizes from the environment: NNODES (2), NPROC_PER_NODE (ranks per node, 8), TP (8), PP (2);
# the rendezvous: MASTER_ADDR (its host, any node; required) and MASTER_PORT (29500), RDZV_ID (the
# same on every node: the Slurm job id, else "gpt"); MAX_RESTARTS (0): restarts of all ranks after
# a failure (each restart resumes from the last committed checkpoint; under Slurm the job's
# requeue does this instead). Model, data and schedule: examples/model_gpt2_1.3b.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/model_gpt2_1.3b.sh
exec torchrun --nnodes "${NNODES:-2}" --nproc-per-node "${NPROC_PER_NODE:-8}" \
    --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}" \
    --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-gpt}}" --max-restarts "${MAX_RESTARTS:-0}" \
    pretrain_gpt.py --tensor-model-parallel-size "${TP:-8}" --pipeline-model-parallel-size "${PP:-2}" \
    "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}"
