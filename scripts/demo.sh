#!/usr/bin/env bash
# The README's main job: install (into .venv if needed), pretrain the tiny K2 on the bundled corpus on
# CPU (300 steps, a few minutes), show the loss fall, export to W/hf and generate with transformers.
#
#   bash scripts/demo.sh [WORKDIR] [extra --config.* flags]      (default WORKDIR: /tmp/k2jax_demo)
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/k2jax_demo}
shift || true
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -c "import k2jax, transformers, torch" 2>/dev/null || pip install -q -e '.[torch]'
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}

python launch/train.py --config=configs/k2.py:tiny --workdir="$W" "$@"
python - "$W" <<'PY'
import json, sys
import numpy as np
from k2jax.data import BUNDLED_CORPUS, load_tokenizer
tok = load_tokenizer()
counts = np.zeros(tok.vocab_size)
for line in open(BUNDLED_CORPUS):
  np.add.at(counts, tok.encode(json.loads(line)["text"]) + [tok.eos_id], 1)
p = counts[counts > 0] / counts.sum()
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
first, last = rows[0], rows[-1]
print(f"loss {first['loss']:.3f} at step {first['step']} -> {last['loss']:.3f} at step {last['step']}; "
      f"unigram entropy of the corpus {-(p * np.log(p)).sum():.3f} nats")
PY
ls "$W/checkpoints"
python launch/convert.py --src="$W" --dst="$W/hf"
python scripts/hf_generate.py "$W/hf" "The Python language"
