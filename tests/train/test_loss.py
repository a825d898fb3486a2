"""The README demo's training: the tiny config on the bundled corpus ends well below the corpus's
unigram entropy (what a model that ignores context can reach) within the demo's steps."""

import json

import numpy as np
import pytest

from k2jax.data import BUNDLED_CORPUS, load_tokenizer
from tests.train import _util


def unigram_entropy() -> float:
  """Entropy (nats) of the corpus's token frequencies, EOS included as the pipeline appends it."""
  tok = load_tokenizer()
  counts = np.zeros(tok.vocab_size)
  with open(BUNDLED_CORPUS) as f:
    for line in f:
      np.add.at(counts, tok.encode(json.loads(line)["text"]) + [tok.eos_id], 1)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


@pytest.mark.slow
def test_tiny_demo_loss_falls_below_unigram_entropy(tmp_path):
  workdir = str(tmp_path / "w")
  steps = _util.k2.get_config("tiny").steps  # the demo trains the config as is
  # One device at the optimised level, as scripts/demo.sh runs it (300 steps: execution-bound; tests/xla_flags.py).
  _util.run_train(workdir, "--config.log.progress=False", "--config.log.tensorboard=False", devices=1, optimize=True)
  rows = _util.metrics(workdir)
  assert rows[-1]["step"] == steps
  h = unigram_entropy()
  assert 6.0 < h < 8.0  # sanity: a 4k BPE on English prose
  final = float(np.mean([r["loss"] for r in rows[-3:]]))  # logged every 10 steps: a 30-step mean
  assert rows[0]["loss"] > h  # starts above (near log(vocab))
  assert final < h - 1.0, (final, h)
  assert all(r["skipped_steps"] == 0 for r in rows)
