"""The fused CPU MoE (`moe_cpu.moe_swiglu`) equals sort -> ragged_dot SwiGLU -> unsort -> weighted sum, on
both of its paths: tile loops (wide experts) and batched tiles (narrow experts, F <= BATCHED_TILE)."""

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


@pytest.fixture(params=["loops", "batched"])
def path(request, monkeypatch):
  """Either path whatever the shapes: the loops, or batched tiles of 16 rows."""
  monkeypatch.setattr(moe_cpu, "batched_tile", lambda width, sizes: 0 if request.param == "loops" else 16)
  return request.param


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
def test_values_and_gradients_match_ragged_dot(routing, path):
  idx = jnp.asarray(_routings()[routing], jnp.int32)
  x, w, wg, wu, wd, dy = _operands(N)
  got = _value_and_grads(moe_cpu.moe_swiglu, idx, x, w, wg, wu, wd, dy)
  want = _value_and_grads(_reference, idx, x, w, wg, wu, wd, dy)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  y = jax.jit(moe_cpu.moe_swiglu)(x, w, idx, wg, wu, wd)
  np.testing.assert_allclose(y, _reference(x, w, idx, wg, wu, wd), rtol=1e-5, atol=1e-5)


def test_one_token(path):
  """One token, two picks (decode): two groups of one copy, each padded to a whole tile."""
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


def test_narrow_experts_take_batched_tiles():
  assert moe_cpu.batched_tile(32, moe_cpu.tile_sizes(4096, 8)) == 128  # bench/moe.py tiny
  assert moe_cpu.batched_tile(512, moe_cpu.tile_sizes(16384, 64)) == 0  # small: the loops
  assert moe_cpu.batched_tile(32, moe_cpu.tile_sizes(2, 8)) == 0  # one token: 8-row tiles, F > 8


def test_tile_sizes_halve_from_the_mean_group():
  assert moe_cpu.tile_sizes(16384, 64) == (256, 128, 64, 32)  # bench/moe.py small: mean group 256
  assert moe_cpu.tile_sizes(4096, 8) == (256, 128, 64, 32)  # tiny: mean 512, capped at MAX_TILE
  assert moe_cpu.tile_sizes(2, 64) == (8,) and moe_cpu.tile_sizes(40, 2) == (16, 8)


@pytest.mark.parametrize("routing", ["random", "one_expert", "skewed"])
def test_every_tile_size_matches_ragged_dot(routing, path):
  """512 copies over 4 experts: tiles of 128, 64, 32 and 16 rows, groups of every remainder."""
  n, e = 256, 4
  rng = np.random.default_rng(2)
  idx = {
    "random": rng.integers(0, e, (n, K)),
    "one_expert": np.full((n, K), 1),  # every copy in one expert, three experts empty
    "skewed": np.minimum(rng.geometric(0.45, (n, K)) - 1, e - 1),  # 1, 2, 3 copies of ~60%, 25%, ...
  }[routing]
  assert moe_cpu.tile_sizes(n * K, e) == (128, 64, 32, 16)
  rng = np.random.default_rng(3)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  x, w, dy = f(n, D), jnp.asarray(rng.random((n, K)), jnp.float32), f(n, D)
  wg, wu, wd = f(e, D, F) / 4, f(e, D, F) / 4, f(e, F, D) / 4
  idx = jnp.asarray(idx, jnp.int32)
  got = _value_and_grads(moe_cpu.moe_swiglu, idx, x, w, wg, wu, wd, dy)
  want = _value_and_grads(_reference, idx, x, w, wg, wu, wd, dy)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_tiles_cover_each_padded_group_exactly_once(seed):
  """The plan: every copy has its own padded row inside its expert's group; the tile loops cover each
  group's rows exactly once and nothing else; batched tiles name the group they lie in."""
  rng = np.random.default_rng(seed)
  n, k, e = 300, 3, 7
  sizes = moe_cpu.tile_sizes(n * k, e)
  idx = np.minimum(rng.geometric(0.3, (n, k)) - 1, e - 1) if seed % 2 else rng.integers(0, e, (n, k))
  plan = jax.jit(lambda i: moe_cpu._plan(i, e, sizes))(jnp.asarray(idx, jnp.int32))
  slot, copy = np.asarray(plan.slot_Nk).reshape(-1), np.asarray(plan.copy_P)
  P = moe_cpu.padded_rows(n * k, e, sizes)
  assert len(copy) == P
  assert np.array_equal(copy[slot], np.arange(n * k)) and np.sum(copy < n * k) == n * k

  @jax.jit
  def coverage(first_E, rows_E):
    def expert(x, c):  # c: (times each row is computed, sum of the experts that computed it)
      def tile(T, r, c):
        cut = lambda a: jax.lax.dynamic_slice_in_dim(a, r, T)  # noqa: E731
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, cut(a) + v, r, 0) for a, v in zip(c, (1, x)))

      return moe_cpu._expert_tiles(sizes, first_E[x], rows_E[x], tile, c)

    return jax.lax.fori_loop(0, e, expert, (jnp.zeros(P, jnp.int32), jnp.zeros(P, jnp.int32)))

  times, owner = (np.asarray(a) for a in coverage(plan.first_E, plan.rows_E))
  counts = np.bincount(idx.reshape(-1), minlength=e)
  assert np.array_equal(np.asarray(plan.rows_E), -(-counts // sizes[-1]) * sizes[-1])  # padded to q only
  assert np.array_equal(times, (np.arange(P) < np.sum(plan.rows_E)).astype(int))  # each group row once
  real = copy < n * k
  assert np.array_equal(owner[real], idx.reshape(-1)[copy[real]])  # each copy computed by its expert
  T = sizes[-1]
  e_T = np.asarray(moe_cpu._tile_experts(plan, T))
  assert len(e_T) == P // T and np.array_equal(np.repeat(e_T, T)[real], idx.reshape(-1)[copy[real]])
