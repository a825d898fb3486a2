"""One tiny model served over HTTP for the agentic tests (compiles are the cost: build them once)."""

import pytest
from flax import nnx

import k2jax
from k2jax.model import K2Model, presets
from k2jax.engine import EngineConfig
from k2jax.serve import Server

MAX_LEN = 1024


@pytest.fixture(scope="session")
def tiny_model():
  return K2Model(presets.get("tiny", max_position_embeddings=MAX_LEN), rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_model):
  hf_dir = str(tmp_path_factory.mktemp("agentic_tiny_hf"))
  k2jax.save_hf(tiny_model, hf_dir)
  server = Server(
    hf_dir,
    engine_config=EngineConfig(max_slots=8, max_seq_len=MAX_LEN, min_prefill_bucket=64, prefix_cache_entries=16),
    port=0,
  ).start()
  yield server
  server.close()
