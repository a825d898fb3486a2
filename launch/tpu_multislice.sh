#!/usr/bin/env bash
# Multislice Cloud TPU jobs: N slices joined over the data-center network (DCN), one JAX runtime.
#
#   bash launch/tpu_multislice.sh create NAME ZONE ACCELERATOR NUM_SLICES [RUNTIME]  # queued resource, N slices
#   bash launch/tpu_multislice.sh setup  NAME ZONE NUM_SLICES                          # tpu_pod.sh setup per slice
#   bash launch/tpu_multislice.sh run    NAME ZONE NUM_SLICES -- python launch/train.py --config=configs/k2.py:1t \
#        --config.mesh.dcn_data=NUM_SLICES --workdir=gs://bucket/k2      # the same command on every host of every slice
#   bash launch/tpu_multislice.sh delete NAME ZONE
#
# Slices are NAME-0 ... NAME-(N-1) (one queued resource, `--node-count N`). `run` starts the command on all
# workers of all slices at once and gives each host the TPU runtime's multislice environment before jax starts:
# MEGASCALE_COORDINATOR_ADDRESS (worker 0 of slice 0), MEGASCALE_PORT (8081), MEGASCALE_NUM_SLICES,
# MEGASCALE_SLICE_ID (k2jax.distributed.megascale_env). The config's DCN product (mesh.dcn_*) must equal
# NUM_SLICES: launch/train.py refuses a mismatch before compiling. On GKE use launch/multislice_jobset.yaml (or
# `xpk workload create --num-slices N`) instead. TPU_POD_DRY_RUN=1 prints the gcloud commands; PROJECT and
# REMOTE_DIR as in launch/tpu_pod.sh.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
REMOTE_DIR=${REMOTE_DIR:-\~/k2jax}
run_() {
  local cmd=(gcloud compute tpus "$@")
  [ -n "${PROJECT:-}" ] && cmd+=(--project="$PROJECT")
  if [ -n "${TPU_POD_DRY_RUN:-}" ]; then printf '%q ' "${cmd[@]}"; echo; else "${cmd[@]}"; fi
}
usage() { sed -n '2,9p' "$0" >&2; exit 2; }

[ $# -ge 3 ] || usage
action=$1 name=$2 zone=$3
shift 3
case "$action" in
  create)
    [ $# -ge 2 ] || usage
    run_ queued-resources create "$name" --zone="$zone" --accelerator-type="$1" --node-count="$2" \
      --node-prefix="$name" --runtime-version="${3:-v2-alpha-tpuv5}"
    ;;
  setup)
    [ $# -ge 1 ] || usage
    for ((i = 0; i < $1; i++)); do bash "$here/tpu_pod.sh" setup "$name-$i" "$zone"; done
    ;;
  run)
    [ $# -ge 1 ] || usage
    slices=$1
    shift
    [ "${1:-}" = "--" ] && shift
    [ $# -ge 1 ] || usage
    if [ -n "${TPU_POD_DRY_RUN:-}" ]; then
      coordinator=SLICE0_WORKER0_IP
    else
      coordinator=$(gcloud compute tpus tpu-vm describe "$name-0" --zone="$zone" \
        ${PROJECT:+--project="$PROJECT"} --format='value(networkEndpoints[0].ipAddress)')
    fi
    printf -v remote '%q ' "$@"
    pids=()
    for ((i = 0; i < slices; i++)); do
      env="MEGASCALE_COORDINATOR_ADDRESS=$coordinator MEGASCALE_PORT=8081 MEGASCALE_NUM_SLICES=$slices"
      env+=" MEGASCALE_SLICE_ID=$i"
      run_ tpu-vm ssh "$name-$i" --zone="$zone" --worker=all \
        --command="cd $REMOTE_DIR && . .venv/bin/activate && export $env && $remote" &
      pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    exit "$status"
    ;;
  delete)
    run_ queued-resources delete "$name" --zone="$zone" --force --quiet
    ;;
  *) usage ;;
esac
