"""`scored.max_argmax`: the blocked (max, argmax) the scored prefill uses equals jnp.max / jnp.argmax."""

import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.engine.scored import max_argmax


@pytest.mark.parametrize("V", [4096, 200, 64, 100])
def test_max_argmax_equals_jnp(V):
  rng = np.random.RandomState(0)
  x = rng.randn(3, 5, V).astype(np.float32)
  x[0, 0, [7, V - 1]] = 50.0  # a tie: the first index wins, as jnp.argmax picks
  x[1, 2, :] = 1.0  # all equal: index 0
  x[2, 4, V - 1] = 99.0  # the last entry of the last block
  m, a = max_argmax(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(m), x.max(-1))
  np.testing.assert_array_equal(np.asarray(a), x.argmax(-1))
  assert a.dtype == jnp.int32
  assert int(a[0, 0]) == 7 and int(a[1, 2]) == 0 and int(a[2, 4]) == V - 1
