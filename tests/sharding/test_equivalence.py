"""Every rules preset on 8 fake CPU devices equals the single-device forward and gradients.

Cases cover 1 and >1 experts per device, fsdp/data/expert/tensor axes, and a device that receives no
tokens for any of its experts. Each case compiles one fwd+bwd; the reference is compiled once per model.
"""

import functools
import re

import jax
import numpy as np
import pytest
from flax import nnx
from sharding_helpers import batch, loss_and_outputs, split_params, tiny_model_state

from k2jax import sharding

RTOL = 1e-5


@functools.cache
def _reference(n_experts, dead):
  graphdef, state = tiny_model_state(n_experts, dead)
  gd, params, rest = split_params(graphdef, state)
  ids, cot = batch()
  fn = jax.jit(jax.value_and_grad(functools.partial(loss_and_outputs, gd), has_aux=True))
  return jax.device_get(fn(params, rest, ids, cot))


def _sharded(n_experts, dead, preset, mesh_shape):
  graphdef, state = tiny_model_state(n_experts, dead)
  mesh = sharding.make_mesh(mesh_shape)
  state = jax.device_put(state, sharding.param_shardings(state, mesh, preset))
  gd, params, rest = split_params(graphdef, state)
  ids, cot = batch()
  ids = jax.device_put(ids, sharding.batch_sharding(mesh, preset))
  cot = jax.device_put(cot, sharding.batch_sharding(mesh, preset, ndim=3))
  with sharding.use(mesh, preset):
    fn = jax.jit(jax.value_and_grad(functools.partial(loss_and_outputs, gd), has_aux=True))
    (loss, out), grads = fn(params, rest, ids, cot)
  return params, jax.device_get(((loss, out), grads))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _check(n_experts, dead, preset, mesh_shape):
  (loss0, out0), g0 = _reference(n_experts, dead)
  params, ((loss1, out1), g1) = _sharded(n_experts, dead, preset, mesh_shape)
  assert _rel(out1.logits, out0.logits) <= RTOL
  assert _rel(out1.max_logits, out0.max_logits) <= RTOL  # global max over all batch shards
  np.testing.assert_array_equal(out1.expert_counts, out0.expert_counts)  # global counts
  assert out0.expert_counts.sum() == 2 * 8 * 16 * 2  # moe layers x tokens x k
  assert _rel(loss1, loss0) <= RTOL
  flat0 = dict(jax.tree_util.tree_flatten_with_path(g0)[0])
  flat1 = dict(jax.tree_util.tree_flatten_with_path(g1)[0])
  assert flat0.keys() == flat1.keys()
  for path, want in flat0.items():
    assert _rel(flat1[path], want) <= RTOL, jax.tree_util.keystr(path)
  # The sharded run really was sharded: expert weights live on their devices.
  w = params["moe_layers"]["moe"]["experts"]["w_gate"][...]
  return out0, w


def test_fsdp_matches_single_device():
  _, w = _check(8, (), "fsdp", {"fsdp": 8})
  assert w.addressable_shards[0].data.shape == (2, 8, 8, 32)  # embed over fsdp


def test_fsdp_ep_one_expert_per_device():
  _, w = _check(8, (), "fsdp_ep", {"expert": 8})
  assert w.addressable_shards[0].data.shape == (2, 1, 64, 32)


@pytest.mark.slow
def test_fsdp_ep_four_experts_per_device_and_an_idle_device():
  dead = (4, 5, 6, 7, 13)  # expert rank 1 holds experts 4..7: no tokens at all
  out0, w = _check(16, dead, "fsdp_ep", {"data": 2, "expert": 4})
  assert w.addressable_shards[0].data.shape == (2, 4, 64, 32)
  assert not out0.expert_counts[:, list(dead)].any()


@pytest.mark.slow
def test_fsdp_ep_tp_matches_single_device():
  _, w = _check(16, (), "fsdp_ep_tp", {"fsdp": 2, "expert": 2, "tensor": 2})
  assert w.addressable_shards[0].data.shape == (2, 8, 32, 16)


def test_ep_forward_hlo_has_all_to_all_and_no_expert_weight_gather():
  graphdef, state = tiny_model_state(8, ())
  mesh = sharding.make_mesh({"expert": 8})
  state = jax.device_put(state, sharding.param_shardings(state, mesh, "fsdp_ep"))
  ids = jax.device_put(batch()[0], sharding.batch_sharding(mesh, "fsdp_ep"))
  with sharding.use(mesh, "fsdp_ep"):
    hlo = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i).logits).lower(state, ids).compile().as_text()
  assert "all-to-all" in hlo
  # Expert weights: [L=2, E=8, D=64, F=32] / [2, 8, 32, 64], or one layer of them.
  expert_shape = re.compile(r"f32\[(2,)?8,(64,32|32,64)\]")
  gathers = [line for line in hlo.splitlines() if "all-gather" in line and "=" in line]
  assert not [g for g in gathers if expert_shape.search(g.split("=")[1])], gathers
