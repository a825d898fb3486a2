#!/usr/bin/env bash
# docs/pretraining.md "The whole recipe": pretrain the tiny K2 briefly, SFT it on "max of four digits",
# evaluate it on the held-out split, RL it on the train split, evaluate again, draw the curves.
#
#   bash scripts/recipe.sh [WORKDIR]          (default WORKDIR: /tmp/k2jax_recipe; a rerun resumes every stage)
#
# Extra config flags per stage (the test shortens the run with them): RECIPE_PRETRAIN_ARGS, RECIPE_SFT_ARGS,
# RECIPE_RL_ARGS. Writes WORKDIR/{pretrain,sft,rl} (workdirs), WORKDIR/eval_{pretrain,sft,rl} (launch/eval.py
# reports on data/recipe/heldout.jsonl, greedy and sampled), WORKDIR/{sft,rl}/curves.png and WORKDIR/summary.json, and prints
# `heldout_pass@1_{greedy,sampled}_<stage>=` and `wall_s_<stage>=` lines.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/k2jax_recipe}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
PY=${PYTHON:-python}
HELD=data/recipe/heldout.jsonl
mkdir -p "$W"
: >"$W/times.txt"

timed() { # NAME CMD...: runs CMD, appends "NAME START END" (epoch seconds) to times.txt
  local name=$1 t0
  shift
  t0=$EPOCHREALTIME
  "$@"
  echo "$name $t0 $EPOCHREALTIME" >>"$W/times.txt"
}

evaluate() { # STAGE MODEL_DIR: the held-out split in the K2 chat template (as SFT and RL render it), greedy
  # (task heldout) and 8 samples per prompt at temperature 1, RL's sampling (task heldout_sampled: pass@1 =
  # mean@8), in one launch/eval.py run (one model load); the same two tasks as RL's in-loop evaluation, on an
  # engine of the RL engine's shape (configs/rl.py: 32 slots of 64 positions, all 32 busy)
  "$PY" launch/eval.py --model="$2" --tasks_file="$W/eval_tasks.json" --chat --max_tokens=3 \
    --out="$W/eval_$1" --progress=false --max_running_requests=32 --concurrency=32 --max_seq_len=64
}
cat >"$W/eval_tasks.json" <<JSON
[{"name": "heldout", "path": "$HELD", "format": "answer.exact"},
 {"name": "heldout_sampled", "path": "$HELD", "format": "answer.exact", "n": 8, "ks": [1, 8], "temperature": 1.0}]
JSON

"$PY" scripts/recipe_data.py --check # the shipped splits are the generator's (disjoint by construction)
# shellcheck disable=SC2086
timed pretrain "$PY" launch/train.py --config=configs/k2.py:recipe_pretrain --workdir="$W/pretrain" \
  ${RECIPE_PRETRAIN_ARGS:-}
# shellcheck disable=SC2086
timed sft "$PY" launch/train.py --config=configs/k2.py:recipe_sft --workdir="$W/sft" \
  --config.checkpoint.init_from="$W/pretrain" ${RECIPE_SFT_ARGS:-}
timed eval_pretrain evaluate pretrain "$W/pretrain"
timed eval_sft evaluate sft "$W/sft"
# shellcheck disable=SC2086
timed rl "$PY" launch/rl.py --config=configs/rl.py:recipe --workdir="$W/rl" --config.model.init_from="$W/sft" \
  ${RECIPE_RL_ARGS:-}
timed eval_rl evaluate rl "$W/rl"
ITERS=$(tail -n 1 "$W/rl/metrics.jsonl" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["step"])')
"$PY" launch/plot.py --workdir="$W/sft"
"$PY" launch/plot.py --workdir="$W/rl" --keys='reward_mean,eval/heldout*/pass@1,eval/maxdigit/pass@1,rl_loss' \
  --report=0="$W/eval_sft/report.json" --report="$ITERS=$W/eval_rl/report.json"

"$PY" - "$W" <<'PY'
import json, os, sys
w = sys.argv[1]
out = {}
for stage in ("pretrain", "sft", "rl"):
  with open(os.path.join(w, f"eval_{stage}", "report.json")) as f:
    tasks = json.load(f)["tasks"]
  for kind, task in (("greedy", "heldout"), ("sampled", "heldout_sampled")):
    out[f"heldout_pass@1_{kind}_{stage}"] = tasks[task]["metrics"]["pass@1"]
for line in open(os.path.join(w, "times.txt")):
  name, start, end = line.split()
  out[f"wall_s_{name}"] = round(float(end) - float(start), 1)
json.dump(out, open(os.path.join(w, "summary.json"), "w"), indent=1)
print("\n".join(f"{k}={v}" for k, v in out.items()))
PY
