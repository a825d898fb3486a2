"""An RL update whose gradient is provably zero is not applied (k2jax/rl/rl_step.py, train.step.apply_update).

Every group's rewards equal, no PTX and no critic rows, pi_old the trainer's own: the K2 objective is at its
minimum at pi_old and its gradient there is zero. MuonClip would still move the weights: Muon's update has a
fixed RMS whatever the gradient's size, so it steps along its (orthogonalised) stale momentum. The step keeps
params and optimizer state, reports `signal=0` and `dropped=1`, and still moves the balancing bias; one sample
off its group's mean reward, one critic row, or an engine's pi_old that differs from the trainer's is signal.
"""

import jax
import numpy as np
import optax
from flax import nnx

from k2jax.model import K2Model, presets
from k2jax.optim.build import muonclip
from k2jax.optim.qk_clip import QKClipSpec
from k2jax.rl import rl_step
from k2jax.rl.algo import K2LossConfig
from k2jax.train.step import ModelDef, apply_update, init_state

CFG = presets.get("tiny", num_hidden_layers=1)


def _setup():
  opt = muonclip(optax.constant_schedule(1e-2), qk_clip_spec=QKClipSpec.from_config(CFG))
  make = lambda: K2Model(CFG, rngs=nnx.Rngs(0))  # noqa: E731
  mdef = ModelDef.from_model(nnx.eval_shape(make))
  return mdef, opt, init_state(make(), opt)


def _batch(rewards, seed=0):
  rng = np.random.default_rng(seed)
  return {
    "tokens_BT": rng.integers(1, 100, (4, 8)).astype(np.int32),
    "segment_ids_BT": np.ones((4, 8), np.int32),
    "loss_mask_BT": (np.arange(8)[None] >= 4).repeat(4, 0).astype(np.float32),
    "rewards_B": np.asarray(rewards, np.float32),
    "group_ids_B": np.array([0, 0, 1, 1], np.int32),
    "sample_mask_B": np.ones(4, np.float32),
  }


def _same(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_equal_rewards_keep_the_state_and_unequal_ones_update():
  mdef, opt, state = _setup()
  step = jax.jit(
    rl_step.make_rl_step(
      mdef, opt, optax.constant_schedule(1e-2), K2LossConfig(), num_groups=2, bias_update_rate=1e-3, qk_clip_tau=None
    )
  )
  lp = jax.jit(rl_step.make_logprobs_fn(mdef))

  def run(state, batch):
    return step(state, batch, lp(state.params, state.bias, batch["tokens_BT"], batch["segment_ids_BT"]), None)

  # Two updates with signal: Muon's momentum is non-zero from here on.
  for seed in (1, 2):
    before = state.params
    state, m = run(state, _batch([1.0, 0.0, 0.0, 1.0], seed))
    assert int(m["signal"]) == 1 and int(m["signal_samples"]) == 4 and not _same(before, state.params)
  assert int(state.skipped_steps) == 0

  # Rewards equal within every group (0.1 x 2 need not average to 0.1 exactly in float32): no signal.
  flat = _batch([0.1, 0.1, 1.0, 1.0], 3)
  old_BT = lp(state.params, state.bias, flat["tokens_BT"], flat["segment_ids_BT"])
  new, m = step(state, flat, old_BT, None)
  assert int(m["signal"]) == 0 and int(m["signal_samples"]) == 0 and bool(m["finite"]) and int(m["dropped"]) == 1
  assert _same(state.params, new.params) and _same(state.opt_state, new.opt_state) and _same(state.bias, new.bias)
  assert int(new.skipped_steps) == 1 and int(new.step) == int(state.step) + 1

  # What the guard prevents: the same zero-signal update applied anyway moves every Muon matrix a full step.
  grads_fn = rl_step.make_rl_grads(mdef, K2LossConfig(), num_groups=2)
  loss, aux, grads = jax.jit(grads_fn)(state.params, state.bias, flat, old_BT, None)
  assert float(optax.tree.norm(grads)) < 1e-4
  unguarded, _ = apply_update(
    state, grads, loss, aux, opt, optax.constant_schedule(1e-2), bias_update_rate=0.0, qk_clip_tau=None
  )
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), unguarded.params, state.params)
  assert max(jax.tree.leaves(moved)) > 1e-3, moved

  # One sample off its group's mean is signal again.
  _, m = run(new, _batch([0.1, 0.1, 1.0, 0.0], 4))
  assert int(m["signal"]) == 1 and int(m["signal_samples"]) == 2


def test_critic_rows_are_signal_on_a_flat_batch():
  mdef, opt, state = _setup()
  step = jax.jit(
    rl_step.make_rl_step(
      mdef,
      opt,
      optax.constant_schedule(1e-2),
      K2LossConfig(),
      num_groups=2,
      bias_update_rate=0.0,
      qk_clip_tau=None,
      critic_coef=1.0,
    )
  )
  flat = _batch([1.0, 1.0, 0.0, 0.0])
  old = rl_step.make_logprobs_fn(mdef)(state.params, state.bias, flat["tokens_BT"], flat["segment_ids_BT"])
  rng = np.random.default_rng(5)
  rows = {
    "tokens_BT": rng.integers(1, 100, (2, 12)).astype(np.int32),
    "segment_ids_BT": np.ones((2, 12), np.int32),
    "loss_mask_BT": (np.arange(12)[None] >= 9).repeat(2, 0).astype(np.float32),
  }
  new, m = step(state, flat, old, None, rows)
  assert int(m["signal"]) == 1 and not _same(state.params, new.params)
  empty = {k: np.zeros_like(v) for k, v in rows.items()}  # the learner's padding when no pair is left
  new, m = step(state, flat, old, None, empty)
  assert int(m["signal"]) == 0 and _same(state.params, new.params)


def test_a_flat_batch_against_the_engines_logprobs_is_signal():
  """With `old_logprobs=engine` the trainer/engine gap is a non-zero log-ratio: its gradient is real, the
  update is applied. Only an exactly zero log-ratio (pi_old the same numbers) is dropped there."""
  mdef, opt, state = _setup()
  engine_loss = K2LossConfig(old_logprobs="engine")
  step = jax.jit(
    rl_step.make_rl_step(
      mdef, opt, optax.constant_schedule(1e-2), engine_loss, num_groups=2, bias_update_rate=0.0, qk_clip_tau=None
    )
  )
  flat = _batch([1.0, 1.0, 0.0, 0.0], 6)
  trainer_BT = np.asarray(
    rl_step.make_logprobs_fn(mdef)(state.params, state.bias, flat["tokens_BT"], flat["segment_ids_BT"])
  )
  engine_BT = trainer_BT + 0.01 * flat["loss_mask_BT"]  # an engine whose numbers differ a little (bf16, kernels)
  grads_fn = jax.jit(rl_step.make_rl_grads(mdef, engine_loss, num_groups=2))
  loss, aux, grads = grads_fn(state.params, state.bias, flat, engine_BT, None)
  assert int(aux["signal_samples"]) == 0 and float(aux["log_ratio_abs_max"]) > 0.03
  assert float(optax.tree.norm(grads)) > 1e-3  # the gap's gradient: what a drop would throw away
  new, m = step(state, flat, engine_BT, None)
  assert int(m["signal"]) == 1 and int(m["dropped"]) == 0 and not _same(state.params, new.params)
  assert int(new.skipped_steps) == 0
  # The same batch against the trainer's pi_old is dropped (its gradient is zero up to rounding).
  trainer_step = jax.jit(
    rl_step.make_rl_step(
      mdef, opt, optax.constant_schedule(1e-2), K2LossConfig(), num_groups=2, bias_update_rate=0.0, qk_clip_tau=None
    )
  )
  kept, m = trainer_step(state, flat, trainer_BT, None)
  assert int(m["dropped"]) == 1 and _same(state.params, kept.params)


def test_a_dropped_update_keeps_params_and_moves_the_balancing_bias():
  """The balancing bias learns the forward's expert load, not the objective: a dropped update moves it, a
  non-finite one does not; neither advances the LR schedule, which counts applied updates (a toy state: one
  weight, one MoE layer of 4 experts, SGD on a schedule 0.1 * (n + 1))."""
  import jax.numpy as jnp

  from k2jax.train.step import TrainState

  schedule = lambda n: 0.1 * (n + 1)  # noqa: E731
  opt = optax.sgd(schedule)
  params, bias = {"w": jnp.ones((2, 2))}, {"b": jnp.zeros((1, 4))}
  state = TrainState(jnp.zeros([], jnp.int32), params, bias, opt.init(params), jnp.zeros([], jnp.int32))
  aux = {"max_logits": jnp.zeros((1, 1)), "expert_counts": jnp.array([[1, 2, 3, 6]]), "tokens": jnp.ones([])}
  grads = {"w": jnp.full((2, 2), 0.5)}

  def update(state, loss, signal):
    kw = {"bias_update_rate": 0.1, "qk_clip_tau": None, "signal": jnp.array(signal)}
    return apply_update(state, grads, jnp.asarray(loss, jnp.float32), aux, opt, schedule, **kw)

  dropped, m = update(state, 1.0, False)
  assert int(m["dropped"]) == 1 and _same(dropped.params, params) and int(dropped.skipped_steps) == 1
  np.testing.assert_allclose(np.asarray(dropped.bias["b"]), [[0.1, 0.1, 0.0, -0.1]])  # mean load 3
  bad, m = update(state, np.nan, False)
  assert int(m["dropped"]) == 0 and not bool(m["finite"]) and _same(bad.bias, bias) and _same(bad.params, params)
  applied, m = update(dropped, 1.0, True)  # the first applied update: schedule index 0 (lr 0.1), not 1
  np.testing.assert_allclose(float(m["lr"]), 0.1, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(applied.params["w"]), 1 - 0.1 * 0.5, rtol=1e-6)
