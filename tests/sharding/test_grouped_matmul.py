"""The CPU grouped-matmul kernel has ragged_dot's semantics and gradients (EP and 1-device path)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.model.grouped_matmul import default_tile, grouped_matmul


@pytest.mark.parametrize("tile", [8, 32])
def test_matches_ragged_dot_values_and_gradients(tile):
  rng = np.random.default_rng(0)
  M, D, F = 100, 16, 24
  sizes = jnp.array([10, 0, 37, 3, 0, 41], jnp.int32)  # empty groups; rows 91..99 in no group
  x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((6, D, F)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((M, F)), jnp.float32)
  want = jax.lax.ragged_dot(x, w, sizes)
  got = jax.jit(grouped_matmul, static_argnums=3)(x, w, sizes, tile)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
  assert not np.asarray(got[91:]).any()
  loss = lambda mm: lambda a, b: jnp.sum(mm(a, b) * dy)  # noqa: E731
  g_want = jax.grad(loss(lambda a, b: jax.lax.ragged_dot(a, b, sizes)), (0, 1))(x, w)
  g_got = jax.jit(jax.grad(loss(lambda a, b: grouped_matmul(a, b, sizes, tile)), (0, 1)))(x, w)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-5)
  assert not np.asarray(g_got[1])[[1, 4]].any()  # experts with no rows: zero grad


def test_default_tile_is_a_bounded_power_of_two():
  assert default_tile(4096, 64) == 32 and default_tile(10, 64) == 8 and default_tile(10**6, 8) == 128
