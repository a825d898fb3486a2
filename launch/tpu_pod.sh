#!/usr/bin/env bash
# Cloud TPU VM slices: create, set up, run the same command on every worker, ssh, delete.
#
#   bash launch/tpu_pod.sh create NAME ZONE ACCELERATOR [RUNTIME]  # e.g. k2 us-east5-a v5p-1024 v2-alpha-tpuv5
#   bash launch/tpu_pod.sh setup  NAME ZONE                         # copy this checkout, venv, jax[tpu]
#   bash launch/tpu_pod.sh run    NAME ZONE -- python launch/train.py --config=configs/k2.py:1t --workdir=/mnt/ckpt/k2
#   bash launch/tpu_pod.sh ssh    NAME ZONE [WORKER]
#   bash launch/tpu_pod.sh delete NAME ZONE
#
# `run` executes the command on all workers at once (gcloud ... ssh --worker=all); jax detects the slice
# and forms one multi-host runtime, so the train command is identical on every host. The workdir must
# be one directory shared by all hosts (e.g. a GCS bucket mounted with gcsfuse, or Filestore/NFS).
# TPU_POD_DRY_RUN=1 prints the gcloud commands instead of running them. PROJECT (optional) is passed
# as --project. REMOTE_DIR (default ~/k2jax) is where the checkout lives on the workers.
set -euo pipefail

REMOTE_DIR=${REMOTE_DIR:-\~/k2jax}
gcloud_() {
  local cmd=(gcloud compute tpus tpu-vm "$@")
  [ -n "${PROJECT:-}" ] && cmd+=(--project="$PROJECT")
  if [ -n "${TPU_POD_DRY_RUN:-}" ]; then printf '%q ' "${cmd[@]}"; echo; else "${cmd[@]}"; fi
}
usage() { sed -n '2,9p' "$0" >&2; exit 2; }

[ $# -ge 3 ] || usage
action=$1 name=$2 zone=$3
shift 3
case "$action" in
  create)
    [ $# -ge 1 ] || usage
    gcloud_ create "$name" --zone="$zone" --accelerator-type="$1" --version="${2:-v2-alpha-tpuv5}"
    ;;
  setup)
    repo=$(cd "$(dirname "$0")/.." && pwd)
    tarball=$(mktemp -d)/k2jax.tar.gz
    tar -C "$repo" --exclude=.venv --exclude=.git -czf "$tarball" .
    gcloud_ scp "$tarball" "$name:/tmp/k2jax.tar.gz" --zone="$zone" --worker=all
    gcloud_ ssh "$name" --zone="$zone" --worker=all --command="mkdir -p $REMOTE_DIR && \
tar -xzf /tmp/k2jax.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR && python3 -m venv .venv && \
. .venv/bin/activate && pip install -q -U pip && pip install -q -e . && pip install -q -U 'jax[tpu]'"
    ;;
  run)
    [ "${1:-}" = "--" ] && shift
    [ $# -ge 1 ] || usage
    printf -v remote '%q ' "$@"
    gcloud_ ssh "$name" --zone="$zone" --worker=all \
      --command="cd $REMOTE_DIR && . .venv/bin/activate && $remote"
    ;;
  ssh)
    gcloud_ ssh "$name" --zone="$zone" --worker="${1:-0}"
    ;;
  delete)
    gcloud_ delete "$name" --zone="$zone" --quiet
    ;;
  *) usage ;;
esac
