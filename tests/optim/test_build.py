"""muonclip as a whole: labels, nnx.State trees, non-finite handling, convergence, schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import SPEC, synthetic_params
from flax import nnx

from k2jax.optim import describe_param_groups, label_params, muonclip, muonclip_metrics, wsd_schedule


def test_labels_by_path_not_ndim():
  labels = label_params(synthetic_params(0))
  assert labels["embed"]["embedding"] == "adamw" and labels["lm_head"]["w"] == "adamw"
  assert labels["moe_layers"]["attn_norm"]["scale"] == "adamw"  # stacked [L, D] gain
  assert labels["moe_layers"]["attn"]["w_q_b"] == "muon"  # [L, Rq, H*K]
  assert labels["moe_layers"]["moe"]["router"]["w"] == "muon"
  assert labels["moe_layers"]["moe"]["experts"]["w_up"] == "muon_expert"
  table = describe_param_groups(synthetic_params(0))
  assert "moe_layers.moe.experts.w_down    (2, 4, 8, 16)  muon_expert  8x16    8      0.80" in table


def test_bad_trees_are_named():
  params = synthetic_params(0)
  params["moe_layers"]["moe"]["router"]["bias"] = np.zeros((2, 4), np.float32)
  with pytest.raises(ValueError, match="moe_layers.moe.router.bias"):
    label_params(params)
  with pytest.raises(ValueError, match="foo.w: shape \\(3,\\)"):
    label_params({"foo": {"w": np.zeros(3)}})
  with pytest.raises(ValueError, match="qk_clip_spec"):
    muonclip(1e-3)


def test_nnx_state_labels_match_dict_paths():
  class Attn(nnx.Module):
    def __init__(self):
      self.w_q_b = nnx.Param(jnp.ones((2, 4, 6)))
      self.q_norm = nnx.RMSNorm(4, rngs=nnx.Rngs(0))

  class Tiny(nnx.Module):
    def __init__(self):
      self.attn = Attn()
      self.lm_head = nnx.Linear(4, 8, use_bias=False, rngs=nnx.Rngs(0))

  state = nnx.state(Tiny(), nnx.Param)
  flat = {jax.tree_util.keystr(p): lab for p, lab in jax.tree_util.tree_flatten_with_path(label_params(state))[0]}
  assert sorted(flat.values()) == ["adamw", "adamw", "muon"], flat


def _loss(params, x_BD, y_BD):
  """A toy regression through the param tree's matrices, gains and embedding rows."""
  h = x_BD * params["final_norm"]["scale"] + params["embed"]["embedding"][: x_BD.shape[0]]
  h = jnp.tanh(h @ params["dense_layers"]["mlp"]["w_gate"][0]) @ params["dense_layers"]["mlp"]["w_down"][0]
  return jnp.mean(jnp.square(h - y_BD))


def test_converges_on_toy_objective():
  params = jax.tree.map(jnp.asarray, synthetic_params(0))
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
  y = jnp.asarray(np.tanh(rng.standard_normal((32, 16))), jnp.float32)
  opt = muonclip(wsd_schedule(0.02, warmup_steps=5, stable_steps=60, decay_steps=35, final_lr=0.002), qk_clip_spec=SPEC)
  state = opt.init(params)
  max_logits = jnp.zeros((3, 2))

  @jax.jit
  def step(params, state):
    loss, g = jax.value_and_grad(_loss)(params, x, y)
    updates, state = opt.update(g, state, params, max_logits=max_logits)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(100):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
  assert all(np.isfinite(losses))


def test_nonfinite_skip_and_error():
  params = jax.tree.map(jnp.asarray, synthetic_params(0))
  grads = jax.tree.map(jnp.ones_like, params)
  grads["moe_layers"]["attn"]["w_o"] = grads["moe_layers"]["attn"]["w_o"].at[0, 0, 0].set(jnp.nan)
  ml = jnp.zeros((3, 2))
  skip = muonclip(1e-2, qk_clip_spec=SPEC, on_nonfinite="skip")
  state0 = skip.init(params)
  updates, state = jax.jit(skip.update)(grads, state0, params, max_logits=ml)
  assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
  assert int(muonclip_metrics(state)["optim_skipped_steps"]) == 1
  for a, b in zip(jax.tree.leaves(state.inner), jax.tree.leaves(state0.inner)):
    np.testing.assert_array_equal(a, b)
  # A NaN max logit would turn gamma into NaN: it is skipped too.
  ok_grads = jax.tree.map(jnp.ones_like, params)
  _, state = jax.jit(skip.update)(ok_grads, state0, params, max_logits=ml.at[1, 1].set(jnp.inf))
  assert int(state.skipped_steps) == 1

  err = muonclip(1e-2, qk_clip_spec=SPEC, on_nonfinite="error")
  with pytest.raises(Exception, match="moe_layers.attn.w_o"):
    out = jax.jit(err.update)(grads, err.init(params), params, max_logits=ml)
    jax.block_until_ready(out)


def test_wsd_schedule_shape():
  s = wsd_schedule(1.0, warmup_steps=10, stable_steps=20, decay_steps=10, final_lr=0.1)
  np.testing.assert_allclose(
    [s(0), s(5), s(10), s(29), s(35), s(40), s(100)],
    [0.0, 0.5, 1.0, 1.0, 0.5 * (1 + np.cos(np.pi / 2)) * 0.9 + 0.1, 0.1, 0.1],
    rtol=1e-6,
    atol=1e-7,
  )
  with pytest.raises(ValueError, match="final_lr"):
    wsd_schedule(1.0, warmup_steps=1, stable_steps=1, decay_steps=1, final_lr=2.0)
