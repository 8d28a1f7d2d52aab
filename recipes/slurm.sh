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
# Preemption and time limits: SIGUSR1 five minutes before the end (Slurm signals every process of
# the job step); each rank finishes its step, all agree, a checkpoint is saved, rank 0 runs
# `scontrol requeue $SLURM_JOB_ID` and the workers exit with status 75. The requeued job resumes.
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

CONFIG=${1:?usage: sbatch --nodes=N recipes/slurm.sh CONFIG [overrides...]}
shift

# The first node of the allocation hosts the rendezvous; every node's torchrun meets there.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
gpus_per_node=${SLURM_GPUS_ON_NODE:-8}

# torchrun forwards SIGUSR1 to its workers (without it in --signals-to-handle, USR1 would end torchrun
# itself) and then gives them --shutdown-timeout seconds to save before it kills them.
srun --kill-on-bad-exit=1 torchrun \
  --nnodes="$SLURM_NNODES" \
  --nproc_per_node="$gpus_per_node" \
  --rdzv_id="$SLURM_JOB_ID" \
  --rdzv_backend=c10d \
  --rdzv_endpoint="$head_node:29500" \
  --max-restarts=3 \
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
  --shutdown-timeout=240 \
  recipes/train.py --config "$CONFIG" "$@"
