"""The fused CPU MoE (`moe_cpu.moe_swiglu`) equals sort -> ragged_dot SwiGLU -> unsort -> weighted sum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.model import expert_parallel, moe_cpu

N, K, E, D, F = 40, 2, 6, 16, 24


def _reference(x, w, idx, wg, wu, wd):
  """The unfused path with jax.lax.ragged_dot for every grouped matmul."""
  x_sorted, order, sizes = expert_parallel.sort_by_expert(x, idx, wg.shape[0])
  g = jax.lax.ragged_dot(x_sorted, wg, sizes)
  u = jax.lax.ragged_dot(x_sorted, wu, sizes)
  y = jax.lax.ragged_dot(jax.nn.silu(g) * u, wd, sizes)
  return expert_parallel.combine(y, order, w, *idx.shape)


def _operands(n, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  return f(n, D), jnp.asarray(rng.random((n, K)), jnp.float32), f(E, D, F) / 4, f(E, D, F) / 4, f(E, F, D) / 4, f(n, D)


def _value_and_grads(fn, idx, x, w, wg, wu, wd, dy):
  def loss(x, w, wg, wu, wd):
    return jnp.sum(fn(x, w, idx, wg, wu, wd) * dy)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x, w, wg, wu, wd)


def _routings():
  rng = np.random.default_rng(1)
  ar = np.arange(N)
  return {
    "random": rng.integers(0, E, (N, K)),
    "hot_expert": np.stack([np.zeros(N, int), 1 + rng.integers(0, E - 1, N)], 1),  # expert 0 gets every token
    "two_experts": np.stack([np.full(N, 3), np.full(N, 5)], 1),  # four experts empty, two take all
    "balanced": np.stack([ar % E, (ar + 1) % E], 1),
    "last_expert": np.stack([np.full(N, E - 1), ar % (E - 1)], 1),
  }


@pytest.mark.parametrize("routing", list(_routings()))
def test_values_and_gradients_match_ragged_dot(routing):
  idx = jnp.asarray(_routings()[routing], jnp.int32)
  x, w, wg, wu, wd, dy = _operands(N)
  got = _value_and_grads(moe_cpu.moe_swiglu, idx, x, w, wg, wu, wd, dy)
  want = _value_and_grads(_reference, idx, x, w, wg, wu, wd, dy)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  y = jax.jit(moe_cpu.moe_swiglu)(x, w, idx, wg, wu, wd)
  np.testing.assert_allclose(y, _reference(x, w, idx, wg, wu, wd), rtol=1e-5, atol=1e-5)


def test_fewer_copies_than_a_tile():
  """One token, two picks (decode): the overflow windows read past the copies and mask them off."""
  x, w, wg, wu, wd, dy = _operands(1)
  idx = jnp.asarray([[2, 4]], jnp.int32)
  got = _value_and_grads(moe_cpu.moe_swiglu, idx, x, w, wg, wu, wd, dy)
  want = _value_and_grads(_reference, idx, x, w, wg, wu, wd, dy)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_cpu_dispatch_takes_the_fused_path(monkeypatch):
  calls = []
  monkeypatch.setattr(moe_cpu, "moe_swiglu", lambda *a: calls.append(1) or _reference(*a))
  x, w, wg, wu, wd, _ = _operands(N)
  idx = jnp.asarray(_routings()["random"], jnp.int32)
  expert_parallel.dispatch_compute_combine(x, w, idx, wg, wu, wd)
  assert calls == [1]


def test_overflow_tile_is_a_bounded_power_of_two():
  assert moe_cpu.overflow_tile(4096 * 8, 64) == 128 and moe_cpu.overflow_tile(16384, 64) == 64
  assert moe_cpu.overflow_tile(2, 64) == 8 and moe_cpu.overflow_tile(10**7, 8) == 128
