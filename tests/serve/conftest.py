"""One tiny served model shared by all serve tests (compiles are the cost: build them once)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import k2jax
from k2jax.model import K2Model, presets
from k2jax.engine import EngineConfig
from k2jax.httpservice import HttpLimits
from k2jax.serve import Server

MAX_LEN = 128


@dataclasses.dataclass
class Served:
  server: Server
  model: K2Model  # the same weights, for full-forward references
  hf_dir: str
  weights_root: str  # where tests write weights for /update_weights_from_disk

  @property
  def engine(self):
    return self.server.engine

  @property
  def tok(self):
    return self.server.tokenizer

  def forward_logprobs(self, ids):
    """log-softmax of the full (uncached) forward pass: [T, S]."""
    return jax.nn.log_softmax(self.model(jnp.asarray([ids], jnp.int32)).logits[0], axis=-1)


@pytest.fixture(scope="session")
def served(tmp_path_factory):
  cfg = presets.get("tiny", max_position_embeddings=MAX_LEN)
  model = K2Model(cfg, rngs=nnx.Rngs(0))
  hf_dir = str(tmp_path_factory.mktemp("tiny_hf"))
  k2jax.save_hf(model, hf_dir)
  weights_root = str(tmp_path_factory.mktemp("weights_root"))
  server = Server(
    hf_dir,
    engine_config=EngineConfig(max_slots=4, max_seq_len=MAX_LEN, prefix_cache_entries=8, precompile=True),
    port=0,
    limits=HttpLimits(read_timeout_s=2.0, max_body_bytes=1 << 20, header_timeout_s=1.0, keep_alive_timeout_s=2.0),
    weights_root=weights_root,
  ).start()
  yield Served(server, model, hf_dir, weights_root)
  server.close()
