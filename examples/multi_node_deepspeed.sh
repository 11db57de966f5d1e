#!/usr/bin/env bash
# N nodes x 8 GPUs with the deepspeed launcher, started on every node (no ssh, no pdsh):
#   NODE_RANK=0 MASTER_ADDR=node001 bash examples/multi_node_deepspeed.sh   # on node001
#   NODE_RANK=1 MASTER_ADDR=node001 bash examples/multi_node_deepspeed.sh   # on node002
# or let Slurm start it on every node: LAUNCHER=deepspeed sbatch examples/slurm_multi_node.sbatch.
# Sizes from the environment: NNODES (2), NPROC_PER_NODE (ranks per node, 8), TP (8), PP (2);
# NODE_RANK (this node's place in HOSTFILE; $SLURM_NODEID under srun), MASTER_ADDR (the first
# node of HOSTFILE; required), MASTER_PORT (29500), HOSTFILE (examples/hostfile: one line per node,
# `slots` = ranks per node; the same file on every node). Model, data and schedule:
# examples/model_gpt2_1.3b.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/model_gpt2_1.3b.sh
exec deepspeed --hostfile "${HOSTFILE:-examples/hostfile}" --no_ssh \
    --num_nodes "${NNODES:-2}" --num_gpus "${NPROC_PER_NODE:-8}" \
    --node_rank "${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK}}" \
    --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py --tensor-model-parallel-size "${TP:-8}" --pipeline-model-parallel-size "${PP:-2}" \
    "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}"
