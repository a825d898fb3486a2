"""Offload and restore between colocated phases are bitwise and free the buffers they leave (8 fake CPU
devices; XLA:CPU has a pinned_host memory kind, so the real path runs, though there it saves no memory)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from k2jax import sharding
from k2jax.model import presets
from k2jax.optim import muonclip
from k2jax.rl import phases
from k2jax.train import core
from k2jax.train.step import init_state


def _state():
  lay = core.layout(
    presets.get("tiny", num_hidden_layers=2),
    muonclip(optax.constant_schedule(0.01), qk_clip_tau=None),
    mesh=sharding.make_mesh({"fsdp": 2, "expert": 4}),
    preset="fsdp_ep",
    seed=0,
  )
  with lay.use():
    state = jax.jit(lambda: init_state(lay.make(), lay.optimizer), out_shardings=lay.shardings)()
  # Distinct values in every floating leaf (a fresh optimizer state is zeros).
  bump = lambda x: (
    x + jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) / 7 if jnp.issubdtype(x.dtype, jnp.floating) else x
  )  # noqa: E731
  return jax.tree.map(bump, state)


def test_offload_and_restore_are_bitwise_and_free_the_buffers_left():
  state = _state()
  holder = {"state": state}
  ph = phases.Phases(
    None,
    phases.ColocateConfig(offload_opt_state=True, offload_params=True),
    lambda: holder["state"],
    lambda s: holder.update(state=s),
  )
  want = jax.tree.map(np.asarray, state)
  on_device = jax.tree.leaves((state.opt_state, state.params))
  ph._move(phases.to_host)
  host = holder["state"]
  assert all(x.is_deleted() for x in on_device)  # freed now, not at garbage collection
  assert {x.sharding.memory_kind for x in jax.tree.leaves((host.opt_state, host.params))} == {"pinned_host"}
  assert host.bias is state.bias and host.step is state.step  # what stays on device is untouched
  in_host = jax.tree.leaves((host.opt_state, host.params))
  ph._move(phases.to_device)
  back = holder["state"]
  assert all(x.is_deleted() for x in in_host)
  for got, ref, dev in zip(jax.tree.leaves(back), jax.tree.leaves(want), jax.tree.leaves(state)):
    assert got.sharding.memory_kind == "device" and got.sharding.spec == dev.sharding.spec
    assert got.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(got), ref)  # bitwise
