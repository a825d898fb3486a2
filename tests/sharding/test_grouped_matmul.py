"""The CPU grouped-matmul kernel has ragged_dot's semantics and gradients (EP and 1-device path)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k2jax.model import expert_parallel, moe_gemm, presets
from k2jax.model.block import MoE
from k2jax.model.grouped_matmul import capacities, choose_capacity, default_tile, grouped_matmul
from k2jax.model.transformer import K2Model

TOL = dict(rtol=1e-5, atol=1e-5)


def _operands(M, E, D=16, F=24, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((E, D, F)) / np.sqrt(D), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((M, F)), jnp.float32)
  return x, w, dy


def _value_and_grads(mm, tile):
  """jit(value, (dx, dw)) of sum(mm(x, w, sizes) * dy): sizes traced, so one compile per shape."""

  def f(x, w, sizes, dy):
    y, vjp = jax.vjp(lambda a, b: mm(a, b, sizes, tile), x, w)
    return y, vjp(dy)

  return jax.jit(f)


_KERNEL = _value_and_grads(grouped_matmul, 8)
_REFERENCE = _value_and_grads(lambda a, b, s, _: jax.lax.ragged_dot(a, b, s), 8)


def _assert_matches(x, w, sizes, dy):
  y, (dx, dw) = _KERNEL(x, w, sizes, dy)
  y_ref, (dx_ref, dw_ref) = _REFERENCE(x, w, sizes, dy)
  for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
    np.testing.assert_allclose(got, want, **TOL)
  n = int(np.sum(sizes))
  assert not np.asarray(y[n:]).any() and not np.asarray(dx[n:]).any()  # rows in no group: zeros
  assert not np.asarray(dw)[np.asarray(sizes) == 0].any()  # experts with no rows: zero grad


@pytest.mark.parametrize(
  "sizes",
  [
    [10, 0, 37, 3, 0, 41],  # empty experts, rows 91..99 in no group
    [100, 0, 0, 0, 0, 0],  # all rows in the first expert
    [0, 0, 0, 0, 0, 100],  # all rows in the last expert
    [0, 0, 0, 0, 0, 0],  # no rows at all
    [17, 16, 17, 16, 17, 17],  # balanced: the bulk stack takes (almost) everything
    [1, 1, 1, 1, 1, 95],  # one hot expert: overflow tiles
    [0, 1, 0, 0, 0, 0],  # one row
  ],
)
def test_matches_ragged_dot_values_and_gradients(sizes):
  x, w, dy = _operands(100, 6)
  _assert_matches(x, w, jnp.asarray(sizes, jnp.int32), dy)


def test_every_group_size_from_zero_to_all_rows():
  """Expert 1 takes g rows for every g in 0..M, the rest spread over the others (one compile)."""
  M, E = 40, 4
  x, w, dy = _operands(M, E, seed=1)
  for g in range(M + 1):
    rest = M - g
    sizes = np.array([rest // 3, g, rest // 3, rest - 2 * (rest // 3)], np.int32)
    _assert_matches(x, w, jnp.asarray(sizes), dy)


def test_random_group_sizes_and_every_capacity_branch():
  """Random routings from balanced to skewed, and one balanced routing per rung of the ladder."""
  M, E = 256, 4
  x, w, dy = _operands(M, E, seed=2)
  rng = np.random.default_rng(3)
  for alpha in (100.0, 10.0, 1.0, 0.3, 0.1, 0.03) * 3:
    n = int(rng.integers(0, M + 1))
    sizes = np.bincount(rng.choice(E, n, p=rng.dirichlet(alpha * np.ones(E))), minlength=E).astype(np.int32)
    _assert_matches(x, w, jnp.asarray(sizes), dy)
  caps = capacities(M, E)
  assert caps == (0, 8, 16, 32, 64, 72)
  for i, c in enumerate(caps):
    sizes = jnp.asarray([c, c, c, min(c, M - 3 * c)] if c else [M, 0, 0, 0], jnp.int32)
    assert int(choose_capacity(sizes, M, 8)) == i, (c, sizes)
    _assert_matches(x, w, sizes, dy)


def test_capacity_follows_the_real_groups():
  caps = capacities(16384, 64)
  balanced = jnp.full((64,), 256, jnp.int32)
  assert caps[int(choose_capacity(balanced, 16384, 64))] == 256
  hot = jnp.zeros((64,), jnp.int32).at[5].set(16384)
  assert caps[int(choose_capacity(hot, 16384, 64))] == 0  # all rows in one expert: tiles only
  ep_like = jnp.full((8,), 256, jnp.int32)  # 2048 real rows in a 16384-row receive buffer
  caps_ep = capacities(16384, 8)
  assert caps_ep[int(choose_capacity(ep_like, 16384, 64))] == 256


def test_default_tile_is_a_bounded_power_of_two():
  assert default_tile(16384, 64) == 32 and default_tile(8192, 64) == 16 and default_tile(10, 64) == 8
  assert default_tile(10**6, 8) == 32


def _with_ragged_dot(monkeypatch):
  """The reference: the unfused CPU path (sort, grouped matmuls, unsort) with ragged_dot's matmuls."""
  monkeypatch.setattr(expert_parallel, "FUSED_CPU", False)
  monkeypatch.setattr(moe_gemm, "AUTO", {**moe_gemm.AUTO, "cpu": "ragged_dot"})


def test_moe_layer_output_and_grads_equal_ragged_dot(monkeypatch):
  cfg = presets.get("tiny")
  moe = MoE(cfg, stack=None, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(moe)
  x = jax.random.normal(jax.random.key(1), (4, 32, cfg.hidden_size), jnp.float32)
  cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)

  def loss(state, x):
    out = nnx.merge(graphdef, state)(x, jnp.ones(x.shape[:2], bool))[0]
    return jnp.sum(out * cot), out

  run = lambda: jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)  # noqa: E731
  (_, out), grads = run()
  _with_ragged_dot(monkeypatch)
  (_, out_ref), grads_ref = run()
  np.testing.assert_allclose(out, out_ref, **TOL)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_scanned_model_logits_and_grads_equal_ragged_dot(monkeypatch):
  cfg = presets.get("tiny", num_hidden_layers=3)  # one dense layer, a scan over two MoE layers
  model = K2Model(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  ids = jax.random.randint(jax.random.key(3), (2, 32), 0, cfg.vocab_size)

  def loss(state):
    logits = nnx.merge(graphdef, state)(ids).logits
    return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

  run = lambda: jax.jit(jax.value_and_grad(loss, has_aux=True))(state)  # noqa: E731
  (_, logits), grads = run()
  _with_ragged_dot(monkeypatch)
  (_, logits_ref), grads_ref = run()
  np.testing.assert_allclose(logits, logits_ref, **TOL)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
