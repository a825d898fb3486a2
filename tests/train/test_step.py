"""The pure train step: accumulation equals one big batch, the bias update's sign, the skip guard."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k2jax.data import PretrainDataConfig, make_pretrain_iter
from k2jax.model import K2Model, presets
from k2jax.optim import QKClipSpec, muonclip
from k2jax.train.step import ModelDef, accumulate_grads, init_state, make_train_step, update_bias

CFG = presets.get("tiny", num_hidden_layers=2)  # one dense + one MoE layer: half the compile


def _batch(rows=8, seq_len=32):
  it = make_pretrain_iter(PretrainDataConfig(seq_len=seq_len, batch_size=rows, seed=3))
  return {k: jnp.asarray(v) for k, v in next(it).items()}


def _setup():
  model = K2Model(CFG, rngs=nnx.Rngs(0))
  opt = muonclip(1e-2, qk_clip_spec=QKClipSpec.from_config(CFG))
  return ModelDef.from_model(model), init_state(model, opt), opt


def test_microbatches_equal_one_big_batch():
  mdef, state, _ = _setup()
  batch = _batch()
  grads = lambda m: jax.jit(functools.partial(accumulate_grads, mdef, num_microbatches=m))
  g1, loss1, aux1 = grads(1)(state.params, state.bias, batch)
  g4, loss4, aux4 = grads(4)(state.params, state.bias, batch)
  assert abs(float(loss1) - float(loss4)) <= 1e-5
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), g1, g4)
  assert max(jax.tree.leaves(diff)) <= 1e-5, diff
  assert float(optax.tree.norm(g1)) > 0.1  # a real gradient, not two zeros
  np.testing.assert_allclose(aux1["max_logits"], aux4["max_logits"], rtol=1e-5)  # max over microbatches
  np.testing.assert_array_equal(aux1["expert_counts"], aux4["expert_counts"])  # summed
  assert float(aux1["tokens"]) == float(jnp.sum(batch["loss_mask"]))


def test_bias_update_lowers_overloaded_experts():
  bias = {"moe_layers": {"moe": {"router": {"bias": jnp.zeros((2, 4))}}}}
  counts = jnp.array([[10, 2, 2, 2], [4, 4, 4, 4]], jnp.int32)
  out = update_bias(bias, counts, 1e-3)["moe_layers"]["moe"]["router"]["bias"]
  np.testing.assert_allclose(out, [[-1e-3, 1e-3, 1e-3, 1e-3], [0, 0, 0, 0]])
  assert update_bias(bias, counts, 0.0) is bias


def test_step_updates_and_skips_non_finite():
  mdef, state, opt = _setup()
  step = jax.jit(
    make_train_step(
      mdef, opt, optax.constant_schedule(1e-2), num_microbatches=2, bias_update_rate=1e-3, qk_clip_tau=100.0
    )
  )
  batch = _batch()
  before = jax.tree.map(np.asarray, state)
  new, m = step(state, batch)
  assert int(new.step) == 1 and int(new.skipped_steps) == 0 and bool(m["finite"])
  assert float(m["update_norm"]) > 0 and float(m["param_norm"]) > 0
  moved = new.bias["moe_layers"]["moe"]["router"]["bias"]
  assert np.all(np.abs(np.asarray(moved)) == 1e-3) or np.any(np.asarray(moved) == 0)
  assert not np.array_equal(np.asarray(new.params["lm_head"]["w"]), before.params["lm_head"]["w"])
  # A NaN weight makes the loss non-finite: the update is skipped and counted, nothing changes.
  bad = state._replace(params=jax.tree.map(lambda x: x, before.params))
  bad.params["embed"]["embedding"] = np.full_like(before.params["embed"]["embedding"], np.nan)
  bad = jax.tree.map(jnp.asarray, bad)
  out, m = step(bad, batch)
  assert int(out.skipped_steps) == 1 and not bool(m["finite"]) and int(out.step) == 1
  assert float(m["update_norm"]) == 0.0  # the optimizer's branch did not run
  np.testing.assert_array_equal(np.asarray(out.params["lm_head"]["w"]), before.params["lm_head"]["w"])
  np.testing.assert_array_equal(
    np.asarray(out.bias["moe_layers"]["moe"]["router"]["bias"]), before.bias["moe_layers"]["moe"]["router"]["bias"]
  )
  for a, b in zip(jax.tree.leaves(out.opt_state), jax.tree.leaves(state.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_offloading_the_optimizer_state_changes_nothing_on_cpu():
  # On CPU the device memory is host memory: the layout keeps every leaf in device memory (offloading to
  # TPU/GPU host memory is compiled by tests/train/test_aot.py).
  from k2jax import sharding  # noqa: PLC0415
  from k2jax.train import core  # noqa: PLC0415

  opt = muonclip(1e-2, qk_clip_spec=QKClipSpec.from_config(CFG))
  mesh = sharding.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
  lay = core.layout(CFG, opt, mesh=mesh, preset="fsdp", seed=0, offload_opt_state=True)
  kinds = {s.memory_kind for s in jax.tree.leaves(lay.shardings)}
  assert kinds <= {None, "device"}, kinds
  assert lay.device_shardings == lay.shardings


def test_offloaded_optimizer_state_places_saves_and_restores(tmp_path):
  # The pieces of an offloaded run that CPU can run (a jitted step with host-memory arguments cannot: jax
  # 0.10's CPU client aborts): `Layout.place` moves the optimizer state to pinned host memory, and a
  # checkpoint of it restores, onto device memory (what `core.build` does before placing) or host memory.
  import dataclasses  # noqa: PLC0415

  from k2jax import sharding  # noqa: PLC0415
  from k2jax.train import core  # noqa: PLC0415
  from k2jax.train.checkpoint import Checkpointer, abstract_like  # noqa: PLC0415
  from k2jax.train.init_from import initial_state  # noqa: PLC0415

  opt = muonclip(1e-2, qk_clip_spec=QKClipSpec.from_config(CFG))
  mesh = sharding.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
  lay = core.layout(CFG, opt, mesh=mesh, preset="fsdp", seed=0)
  host = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), lay.shardings.opt_state)
  off = dataclasses.replace(lay, shardings=lay.shardings._replace(opt_state=host))
  assert off.device_shardings == lay.shardings
  state = initial_state(CFG, "", lay.make, opt, lay.shardings)
  state = jax.tree.map(lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x, state)  # non-zero moments
  want = jax.tree.map(np.asarray, state)
  placed = off.place(state)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(placed.opt_state)} == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(placed.params)} == {"device"}
  ckpt = Checkpointer(str(tmp_path), keep=1, async_save=False)
  ckpt.save(3, placed, None, {})
  ckpt.wait()
  for shardings, kind in ((off.device_shardings, "device"), (off.shardings, "pinned_host")):
    back = ckpt.restore_latest(abstract_like(lay.abstract_state, shardings), on_unreadable="error").state
    assert {x.sharding.memory_kind for x in jax.tree.leaves(back.opt_state)} == {kind}
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), b)
  ckpt.close()
