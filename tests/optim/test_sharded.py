"""MuonClip on 8 fake devices: state keeps dtype/shape/sharding, result equals single device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import SPEC, synthetic_params
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from k2jax import sharding
from k2jax.optim import OwnerSharding, muonclip
from k2jax.model.transformer import param_logical_axes
from k2jax.optim.muon import layout_newton_schulz, newton_schulz


def _spec(path, x):
  """FSDP on the first matrix axis divisible by 4; experts live on the 'expert' axis."""
  if "experts" in jax.tree_util.keystr(path):
    return P(None, "expert", None, None)
  for ax in range(max(x.ndim - 2, 0), x.ndim):
    if x.shape[ax] % 4 == 0:
      return P(*[("fsdp" if i == ax else None) for i in range(x.ndim)])
  return P()


def _run(opt, params, n_steps=2):
  state = opt.init(params)
  update = jax.jit(opt.update)
  rng = np.random.default_rng(7)
  states = [state]
  for _ in range(n_steps):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
    grads = jax.tree.map(lambda g, x: jax.device_put(g, x.sharding), grads, params)
    max_logits = jnp.asarray([[30.0, 5.0], [12.0, 2.0], [1.0, 40.0]])
    updates, state = update(grads, state, params, max_logits=max_logits)
    params = optax.apply_updates(params, updates)
    states.append(state)
  return params, states


@pytest.mark.slow
@pytest.mark.parametrize("axis_type,use_owners", [(AxisType.Auto, True), (AxisType.Explicit, False)])
def test_sharded_equals_single_device(axis_type, use_owners):
  host = synthetic_params(0)
  make = lambda owners: muonclip(1e-2, qk_clip_tau=10.0, qk_clip_spec=SPEC, owners=owners)
  single, _ = _run(make(None), jax.tree.map(jnp.asarray, host))

  mesh = jax.make_mesh((4, 2), ("fsdp", "expert"), axis_types=(axis_type,) * 2)
  shardings = jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, _spec(p, x)), host)
  with jax.set_mesh(mesh) if axis_type == AxisType.Explicit else _null():
    params = jax.device_put(host, shardings)
    owners = OwnerSharding(mesh, ("fsdp", "expert")) if use_owners else None
    sharded, states = _run(make(owners), params)

  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(params)):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
  first = jax.tree.leaves(states[0])
  for later in states[1:]:
    for s0, s1 in zip(first, jax.tree.leaves(later)):
      assert (s0.shape, s0.dtype) == (s1.shape, s1.dtype)
      if s0.ndim:
        assert s1.sharding.is_equivalent_to(s0.sharding, s0.ndim), (s0.sharding, s1.sharding)
  mu = states[-1].inner.inner_states["muon"].inner_state[0].mu
  assert mu["moe_layers"]["attn"]["w_q_b"].sharding.is_equivalent_to(params["moe_layers"]["attn"]["w_q_b"].sharding, 3)


@pytest.mark.slow
def test_expert_matrices_are_not_gathered():
  """Expert stacks sharded on E: NS runs where each expert lives, no collective in the update."""
  mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
  x = np.random.default_rng(0).standard_normal((2, 8, 16, 8)).astype(np.float32)
  params = {
    "moe_layers": {"moe": {"experts": {"w_up": jax.device_put(x, NamedSharding(mesh, P(None, "expert", None, None)))}}}
  }
  opt = muonclip(1e-2, qk_clip_tau=None)
  state = opt.init(params)
  hlo = jax.jit(opt.update).lower(params, state, params).compile().as_text()
  collectives = [
    l
    for l in hlo.splitlines()
    if any(
      f"{op}(" in l or f"{op}-start(" in l
      for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
    )
  ]
  # Only the scalar finiteness flag is reduced across devices; no weight data moves.
  assert collectives and all(" pred[] " in l for l in collectives), collectives


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


@pytest.mark.parametrize(
  "name,shape",
  [
    ("moe_layers.moe.experts.w_up", (3, 8, 16, 8)),  # [L, E, D, F]: D over fsdp, E over expert
    ("moe_layers.moe.experts.w_down", (3, 8, 8, 16)),  # [L, E, F, D]
    ("moe_layers.attn.w_o", (3, 8, 16)),  # [L, H*V, D]: 3 matrices padded to 4 for fsdp 4
  ],
)
def test_layout_newton_schulz_on_whole_matrices_equals_per_matrix_ns(name, shape):
  """FSDP-sharded stacks: an all-to-all gives each device whole matrices; the same NS result."""
  mesh = sharding.make_mesh({"fsdp": 4, "expert": 2})
  x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
  spec = sharding.logical_to_spec(param_logical_axes()[name], "fsdp_ep")
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  with sharding.use(mesh, "fsdp_ep"):
    fn = jax.jit(lambda a: layout_newton_schulz(a, name))
    hlo = fn.lower(xs).compile().as_text()
    got = fn(xs)
  assert "all-to-all" in hlo and "all-reduce" not in hlo  # whole matrices moved, no partial Gram reduced
  np.testing.assert_allclose(np.asarray(got), np.asarray(newton_schulz(jnp.asarray(x))), rtol=1e-5, atol=1e-6)
