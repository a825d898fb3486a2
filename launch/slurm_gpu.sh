#!/usr/bin/env bash
# GPU cluster training under SLURM: one JAX process per node (it drives all the node's GPUs).
#
#   python3 -m venv .venv && .venv/bin/pip install -e '.[gpu]'      # once, on the shared filesystem
#   CONFIG=configs/k2.py:small WORKDIR=/shared/k2small sbatch --nodes=4 launch/slurm_gpu.sh [--config.x=y ...]
#   BENCH=1 sbatch --nodes=1 launch/slurm_gpu.sh                       # bench/gpu.py on one GPU instead
#
# The train launcher sets XLA's GPU flags (k2jax/accel.py, printed first) and picks the GPU kernels
# (model.moe_gemm / model.attention = auto). Untested: no GPU cluster ran it.
# Process 0's host is the coordinator; every task runs the same train command with its own
# --process_id. The workdir must be on a filesystem all nodes share. SLURM sends SIGTERM 120 s before
# the time limit (--signal); JAX's preemption sync turns it into a checkpoint on every host, and a
# resubmitted job resumes from it.
#SBATCH --job-name=k2jax
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --signal=TERM@120
set -euo pipefail
CONFIG=${CONFIG:-configs/k2.py:small}
PORT=${PORT:-12355}
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}     # the venv docs/install.md creates on the shared filesystem
# sed (not head) reads all of scontrol's output: no SIGPIPE under pipefail.
coordinator="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p):$PORT"
if [ "${BENCH:-0}" = 1 ]; then
  cd "$REPO" && CUDA_VISIBLE_DEVICES=0 exec "$PYTHON" bench/gpu.py
fi
: "${WORKDIR:?set WORKDIR to a directory shared by all nodes}"
export CONFIG WORKDIR REPO PYTHON coordinator
# Single quotes: SLURM_PROCID is expanded by each task, not here.
srun --kill-on-bad-exit=1 bash -c 'cd "$REPO" && exec "$PYTHON" launch/train.py \
  --config="$CONFIG" --workdir="$WORKDIR" --coordinator_address="$coordinator" \
  --num_processes="$SLURM_NTASKS" --process_id="$SLURM_PROCID" "$@"' k2jax "$@"
