"""The decode step updates the slot cache in place: XLA's own memory analysis of the compiled step shows the
cache aliased from input to output and temporaries of about one layer's slice, not a second whole cache
(the cache once rode through the layer scan as xs/ys: 1.1x the cache in temporaries)."""

import jax
import numpy as np
from flax import nnx

from k2jax.engine.runner import ModelRunner, _greedy
from k2jax.model import K2Model, presets


def test_decode_temporaries_are_not_a_second_cache():
  cfg = presets.get("tiny")
  runner = ModelRunner(K2Model(cfg, rngs=nnx.Rngs(0)), num_slots=16, max_len=4096, num_top=1)
  n = runner.num_slots
  cache = sum(x.nbytes for x in jax.tree.leaves(runner.cache))
  args = (np.zeros((n, 1), np.int32), np.full((n, 1), 5, np.int32), np.zeros(n, np.int32), _greedy(n))
  m = runner._decode.lower(runner._state, runner.cache, *args).compile().memory_analysis()
  assert m.alias_size_in_bytes == cache  # the donated cache is the output cache
  # The biggest stack's one-layer slice is a third of this cache (layers 1 + 2); the rest is activations.
  assert m.temp_size_in_bytes < 0.5 * cache, (m.temp_size_in_bytes, cache)
