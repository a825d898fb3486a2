"""`EngineScorer` hands every pair to the engine at once: the engine batches them into scored prefills (a
batch of slots per program), and the scores equal those of scoring one pair at a time and of the model's
own forward pass."""

import time

import numpy as np
import pytest
from flax import nnx

from k2jax.engine import EngineConfig, InferenceEngine
from k2jax.engine.base import Engine
from k2jax.eval.scoring import EngineScorer, ForwardScorer
from k2jax.model import K2Model, presets


class GenerateOnly(Engine):
  """The engine behind `generate` alone (no `submit_many`): the scorer asks one request at a time."""

  def __init__(self, engine):
    self.engine = engine

  def generate(self, request):
    return self.engine.generate(request)

  def abort(self, rids):
    return self.engine.abort(rids)

  def update_weights(self, model_path, weight_version=None):
    raise AssertionError("scoring never updates weights")


@pytest.fixture(scope="module")
def tiny():
  model = K2Model(presets.get("tiny", max_position_embeddings=64), rngs=nnx.Rngs(0))
  engine = InferenceEngine(model, EngineConfig(max_slots=4, max_seq_len=64, prefix_cache_entries=0))
  yield model, engine
  engine.close()


def _pairs(n):
  rng = np.random.RandomState(7)
  return [(rng.randint(0, 3800, 3 + i).tolist(), rng.randint(0, 3800, 1 + i % 4).tolist()) for i in range(n)]


def test_engine_scorer_batches_the_pairs_and_scores_them_as_one_at_a_time(tiny, monkeypatch):
  model, engine = tiny
  calls = []
  scored = engine._runner.prefill_scored

  def counting(slots, prompts, sampling, **kw):
    calls.append(len(slots))
    return scored(slots, prompts, sampling, **kw)

  monkeypatch.setattr(engine._runner, "prefill_scored", counting)
  pairs = _pairs(6)
  serial = EngineScorer(GenerateOnly(engine)).score_many(pairs)
  assert calls == [1] * 6
  calls.clear()
  batched = EngineScorer(engine).score_many(pairs[:4])
  assert calls == [4]  # every pair in one program (4 slots)
  calls.clear()
  scorer = EngineScorer(engine)
  every = scorer.score_many(pairs)
  assert calls == [4, 2]  # a batch of slots per program
  np.testing.assert_allclose(batched, serial[:4], atol=1e-5, rtol=0)
  np.testing.assert_allclose(every, serial, atol=1e-5, rtol=0)
  np.testing.assert_allclose(every, ForwardScorer(model).score_many(pairs), atol=1e-4, rtol=0)
  assert scorer.score_many(pairs[:2]) == every[:2]  # a second call of the same scorer: its own request ids


def test_engine_scorer_refused_pair_raises_and_leaves_nothing_running(tiny):
  _, engine = tiny
  too_long = ([1] * 60, [2] * 10)  # 70 tokens: beyond the engine's 64
  with pytest.raises(Exception, match="too long"):
    EngineScorer(engine).score_many(_pairs(2) + [too_long])
  deadline = time.monotonic() + 60  # the aborted ones leave at the engine's next step
  while engine.num_running() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert engine.num_running() == 0
  with pytest.raises(ValueError, match="continuation is empty"):
    EngineScorer(engine).score_many([([1, 2], [])])
