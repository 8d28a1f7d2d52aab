#!/bin/bash
# Multi-node training under Slurm: one torchrun per node, torchrun starts one process per GPU.
#
#   sbatch --nodes=2 recipes/slurm.sh recipes/configs/llama3_70b_2x8gpu.toml [--table.key value ...]
#
#SBATCH --job-name=fsdp2kit
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
set -euo pipefail

CONFIG=${1:?usage: sbatch --nodes=N recipes/slurm.sh CONFIG [overrides...]}
shift

# The first node of the allocation hosts the rendezvous; every node's torchrun meets there.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
gpus_per_node=${SLURM_GPUS_ON_NODE:-8}

srun --kill-on-bad-exit=1 torchrun \
  --nnodes="$SLURM_NNODES" \
  --nproc_per_node="$gpus_per_node" \
  --rdzv_id="$SLURM_JOB_ID" \
  --rdzv_backend=c10d \
  --rdzv_endpoint="$head_node:29500" \
  --max-restarts=3 \
  recipes/train.py --config "$CONFIG" "$@"
