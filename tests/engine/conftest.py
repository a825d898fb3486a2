"""One tiny in-process engine shared by the engine tests (compiles are the cost: build them once)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from k2jax.engine import EngineConfig, InferenceEngine
from k2jax.model import K2Model, presets

MAX_LEN = 128


@dataclasses.dataclass
class Local:
  engine: InferenceEngine
  model: K2Model  # the same weights, for full-forward references

  def forward_logprobs(self, ids):
    """log-softmax of the full (uncached) forward pass: [T, S]."""
    return jax.nn.log_softmax(self.model(jnp.asarray([ids], jnp.int32)).logits[0], axis=-1)


@pytest.fixture(scope="session")
def local():
  model = K2Model(presets.get("tiny", max_position_embeddings=MAX_LEN), rngs=nnx.Rngs(0))
  engine = InferenceEngine(model, EngineConfig(max_slots=4, max_seq_len=MAX_LEN, prefix_cache_entries=8))
  yield Local(engine, model)
  engine.close()
