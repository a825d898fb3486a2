#!/usr/bin/env bash
# Serve an exported K2 checkpoint (HF layout, `python launch/convert.py --src=W --dst=HF`) with SGLang on
# GPU nodes or sglang-jax on TPU (or CPU), as the rollout engine of `launch/rl.py`. See docs/rl.md
# "Rollouts on SGLang servers".
#
#   launch/sglang_server.sh --model=HF_DIR [--engine=sglang|sglang-jax] [--tp=8] [--ep=1] [--dp=1]
#       [--dp-attention] [--replicas=1] [--gpus-per-replica=TP] [--device=tpu|cpu|gpu] [--deterministic]
#       [--host=0.0.0.0] [--port=30000] [--router-port=30000] [--nnodes=1] [--node-rank=0]
#       [--dist-init-addr=HOST:PORT] [--mem-fraction=0.85] [--dtype=bfloat16] [--tokenizer=PATH|none]
#       [--router-only --worker-urls=URL,URL] [--dry-run] [-- EXTRA SERVER ARGS]
#
# --engine=sglang (default): `python -m sglang.launch_server` with --tp-size/--ep-size, DP attention
#   (--dp-size --enable-dp-attention) and `--tool-call-parser kimi_k2`; --deterministic adds
#   --enable-deterministic-inference (sampling_seed then makes samples reproducible).
# --engine=sglang-jax: `python -m sgl_jax.launch_server` with its mesh flags --tp-size/--ep-size/--dp-size and
#   --device (default tpu); it has no DP attention and no kimi_k2 tool-call parser (both refused here), and
#   no weight-update route: the learner refuses it for RL with weight sync (rollouts only: evaluation,
#   synthesis, a fixed policy). For RL on sglang-jax serve it with
#   `python launch/serve.py --backend=sglang_jax` instead (k2jax's routes in front of sglang-jax's engine:
#   /update_weights_from_disk swaps weights on device, replies carry meta_info.weight_version).
#   --deterministic adds --enable-deterministic-sampling (seeded sampling keyed by (seed, position)).
# $PYTHON (default: python on PATH) runs the servers and the router: the interpreter that has SGLang or
#   sgl_jax installed (e.g. PYTHON=.venv312/bin/python), no venv activation needed.
# One replica: a single server on --port (multi-node: run the same command on every node
#   with --nnodes/--node-rank/--dist-init-addr; node 0 serves HTTP).
# --replicas=N (N > 1, one node): N servers on ports port+1..port+N, each on its own accelerator slice
#   (SGLang: CUDA_VISIBLE_DEVICES; sglang-jax: --device-indexes), plus `sglang_router.launch_router` on
#   --router-port in front of them.
# --router-only: just the router, for replicas started on other nodes (--worker-urls).
# The router serves /generate only; the learner sends /update_weights_from_disk and /abort_request to every
# worker itself (`--config.rollout.worker_urls`), which this script prints at the end.
# --dry-run prints the commands (one per line) and starts nothing.
set -euo pipefail

MODEL="" ENGINE=sglang DEVICE="" DETERMINISTIC=0
TP=8 EP=1 DP=1 DP_ATTENTION=0 REPLICAS=1 GPUS_PER_REPLICA="" HOST=0.0.0.0 PORT=30000
ROUTER_PORT="" NNODES=1 NODE_RANK=0 DIST_INIT_ADDR="" MEM_FRACTION=0.85 DTYPE=bfloat16 TOKENIZER=none
ROUTER_ONLY=0 WORKER_URLS="" DRY_RUN=0 EXTRA=()
PY="${PYTHON:-python}"

die() { echo "sglang_server.sh: $*" >&2; exit 2; }
int() { [[ "$2" =~ ^[0-9]+$ ]] && (( $2 >= ${3:-1} )) || die "--$1 must be an integer >= ${3:-1}, got '$2'"; }

for arg in "$@"; do
  if [[ ${#EXTRA[@]} -gt 0 || "$arg" == "--" ]]; then EXTRA+=("$arg"); continue; fi
  case "$arg" in
    --model=*) MODEL="${arg#*=}" ;;
    --engine=*) ENGINE="${arg#*=}" ;;
    --device=*) DEVICE="${arg#*=}" ;;
    --deterministic) DETERMINISTIC=1 ;;
    --tp=*) TP="${arg#*=}" ;;
    --ep=*) EP="${arg#*=}" ;;
    --dp=*) DP="${arg#*=}" ;;
    --dp-attention) DP_ATTENTION=1 ;;
    --replicas=*) REPLICAS="${arg#*=}" ;;
    --gpus-per-replica=*) GPUS_PER_REPLICA="${arg#*=}" ;;
    --host=*) HOST="${arg#*=}" ;;
    --port=*) PORT="${arg#*=}" ;;
    --router-port=*) ROUTER_PORT="${arg#*=}" ;;
    --nnodes=*) NNODES="${arg#*=}" ;;
    --node-rank=*) NODE_RANK="${arg#*=}" ;;
    --dist-init-addr=*) DIST_INIT_ADDR="${arg#*=}" ;;
    --mem-fraction=*) MEM_FRACTION="${arg#*=}" ;;
    --dtype=*) DTYPE="${arg#*=}" ;;
    --tokenizer=*) TOKENIZER="${arg#*=}" ;;
    --router-only) ROUTER_ONLY=1 ;;
    --worker-urls=*) WORKER_URLS="${arg#*=}" ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done
if [[ ${#EXTRA[@]} -gt 0 ]]; then EXTRA=("${EXTRA[@]:1}"); fi  # drop the "--" separator
for v in TP EP DP REPLICAS NNODES PORT; do int "${v,,}" "${!v}"; done
int node-rank "$NODE_RANK" 0
GPUS_PER_REPLICA="${GPUS_PER_REPLICA:-$TP}"
int gpus-per-replica "$GPUS_PER_REPLICA"
ROUTER_PORT="${ROUTER_PORT:-$PORT}"
(( NODE_RANK < NNODES )) || die "--node-rank=$NODE_RANK must be < --nnodes=$NNODES"
case "$ENGINE" in
  sglang)
    [[ -z "$DEVICE" ]] || die "--device is for --engine=sglang-jax (SGLang here runs on the node's GPUs)"
    (( TP % EP == 0 )) || die "--ep=$EP must divide --tp=$TP (SGLang's expert parallelism runs inside the TP group)"
    (( DP == 1 || DP_ATTENTION == 1 )) || die "--dp=$DP needs --dp-attention (separate replicas: use --replicas)" ;;
  sglang-jax)
    DEVICE="${DEVICE:-tpu}"
    [[ "$DEVICE" =~ ^(tpu|cpu|gpu)$ ]] || die "--device must be tpu, cpu or gpu for sglang-jax, got '$DEVICE'"
    (( DP_ATTENTION == 0 )) || die "--dp-attention is SGLang's; sglang-jax has plain --dp (data-parallel replicas in one mesh)"
    (( TP % NNODES == 0 )) || die "--tp=$TP must be divisible by --nnodes=$NNODES (sglang-jax check_server_args)" ;;
  *) die "--engine must be sglang or sglang-jax, got '$ENGINE'" ;;
esac
(( NNODES == 1 || REPLICAS == 1 )) || die "--replicas > 1 is for one node; start multi-node replicas one by one and use --router-only"
(( NNODES == 1 )) || [[ -n "$DIST_INIT_ADDR" ]] || die "--nnodes=$NNODES needs --dist-init-addr=HOST:PORT (node 0)"

run() {  # print (dry run) or start one command in the background; $1 = env prefix or ""
  local env="$1"; shift
  if (( DRY_RUN )); then echo "${env:+$env }$*"; return; fi
  if [[ -n "$env" ]]; then env $env "$@" & else "$@" & fi
  PIDS+=($!)
}

server_cmd() {  # $1 = port, $2 = sglang-jax device indexes ("" = all); fills the array CMD
  if [[ "$ENGINE" == sglang ]]; then
    CMD=("$PY" -m sglang.launch_server --model-path "$MODEL" --host "$HOST" --port "$1"
               --tp-size "$TP" --ep-size "$EP" --dtype "$DTYPE" --mem-fraction-static "$MEM_FRACTION"
               --trust-remote-code --tool-call-parser kimi_k2)
  else  # flag names from sglang-jax's python/sgl_jax/srt/server_args.py (commit cddbf6f)
    CMD=("$PY" -m sgl_jax.launch_server --model-path "$MODEL" --host "$HOST" --port "$1"
               --device "$DEVICE" --tp-size "$TP" --ep-size "$EP" --dp-size "$DP" --dtype "$DTYPE"
               --mem-fraction-static "$MEM_FRACTION" --trust-remote-code)
  fi
  if [[ "$TOKENIZER" == none ]]; then
    CMD+=(--skip-tokenizer-init)   # token-in/token-out RL needs no tokenizer (chat endpoints do)
  else
    CMD+=(--tokenizer-path "$TOKENIZER")
  fi
  if [[ "$ENGINE" == sglang ]]; then
    if (( DP_ATTENTION )); then CMD+=(--dp-size "$DP" --enable-dp-attention); fi
    if (( DETERMINISTIC )); then CMD+=(--enable-deterministic-inference); fi
  else
    if [[ -n "$2" ]]; then CMD+=(--device-indexes ${2//,/ }); fi
    if (( DETERMINISTIC )); then CMD+=(--enable-deterministic-sampling); fi
    # On CPU its default `fa` falls back to native attention after the absorbed-MLA path was already chosen,
    # and native attention cannot write the MLA cache; `native` up front picks the decompressed (MHA) path.
    if [[ "$DEVICE" == cpu ]]; then CMD+=(--attention-backend native); fi
  fi
  if (( NNODES > 1 )); then CMD+=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --dist-init-addr "$DIST_INIT_ADDR"); fi
  CMD+=("${EXTRA[@]}")
}

url_host() { [[ "$HOST" == 0.0.0.0 ]] && hostname -f 2>/dev/null || echo "$HOST"; }

PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT INT TERM

if (( ROUTER_ONLY )); then
  [[ -n "$WORKER_URLS" ]] || die "--router-only needs --worker-urls=http://host:port,..."
  URLS="$WORKER_URLS"
elif (( REPLICAS == 1 )); then
  [[ -n "$MODEL" ]] || die "--model=HF_DIR is required"
  (( DRY_RUN )) || [[ -f "$MODEL/config.json" ]] || die "$MODEL/config.json not found (export with launch/convert.py)"
  server_cmd "$PORT" ""
  run "" "${CMD[@]}"
  URLS="http://$(url_host):$PORT"
else
  [[ -n "$MODEL" ]] || die "--model=HF_DIR is required"
  (( DRY_RUN )) || [[ -f "$MODEL/config.json" ]] || die "$MODEL/config.json not found (export with launch/convert.py)"
  URLS=""
  for ((i = 0; i < REPLICAS; i++)); do
    first=$((i * GPUS_PER_REPLICA))
    gpus=$(seq -s, "$first" $((first + GPUS_PER_REPLICA - 1)))
    if [[ "$ENGINE" == sglang ]]; then
      server_cmd $((PORT + 1 + i)) ""
      run "CUDA_VISIBLE_DEVICES=$gpus" "${CMD[@]}"
    else
      server_cmd $((PORT + 1 + i)) "$gpus"
      run "" "${CMD[@]}"
    fi
    URLS+="${URLS:+,}http://$(url_host):$((PORT + 1 + i))"
  done
fi

if (( ROUTER_ONLY || REPLICAS > 1 )); then
  IFS=, read -r -a WORKERS <<< "$URLS"
  run "" "$PY" -m sglang_router.launch_router --worker-urls "${WORKERS[@]}" --policy cache_aware \
      --host "$HOST" --port "$ROUTER_PORT"
  ENGINE="http://$(url_host):$ROUTER_PORT"
  echo "# learner: --config.rollout.engine_url=$ENGINE --config.rollout.worker_urls=$URLS" >&2
else
  echo "# learner: --config.rollout.engine_url=$URLS" >&2
fi
(( DRY_RUN )) && exit 0
(( NODE_RANK == 0 )) || echo "# node $NODE_RANK of $NNODES: serving; node 0 answers HTTP" >&2
wait -n "${PIDS[@]}"   # one process exiting (a crash) stops the whole group via the EXIT trap
