"""K2 objective: value, gradient against the hand-derived form and finite differences, PTX, metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.rl import algo
from k2jax.rl.rollout_batch import RolloutBatch

B, T, S, G = 6, 5, 7, 2


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  logits_BTS = jnp.asarray(rng.normal(size=(B, T, S)), jnp.float32)
  tokens_BT = jnp.asarray(rng.integers(0, S, size=(B, T)), jnp.int32)
  mask_BT = jnp.asarray([[0, 1, 1, 1, 0]] * 3 + [[0, 0, 1, 1, 1]] * 3, jnp.float32)
  rewards_B = jnp.asarray([1.0, 0.0, 0.5, 2.0, -1.0, 0.0], jnp.float32)
  groups_B = jnp.asarray([0, 0, 0, 1, 1, 1], jnp.int32)
  return logits_BTS, tokens_BT, mask_BT, rewards_B, groups_B


def test_token_logprobs_shift():
  logits_BTS, tokens_BT, *_ = _inputs()
  lp_BT = algo.token_logprobs(logits_BTS, tokens_BT)
  ref = jax.nn.log_softmax(logits_BTS[1, 2])[tokens_BT[1, 3]]
  assert lp_BT[1, 3] == pytest.approx(float(ref), abs=1e-6) and float(lp_BT[0, 0]) == 0.0


def test_loss_value_matches_formula():
  logits_BTS, tokens_BT, mask_BT, r_B, g_B = _inputs()
  lp_BT = algo.token_logprobs(logits_BTS, tokens_BT)
  old_BT = lp_BT + 0.1 * jnp.arange(T, dtype=jnp.float32)
  tau = 0.3
  loss, _ = algo.k2_rl_loss(lp_BT, old_BT, mask_BT, r_B, g_B, tau=tau, num_groups=G)
  r, lp, old, m = map(np.asarray, (r_B, lp_BT, old_BT, mask_BT))
  expect = 0.0
  for idx in ([0, 1, 2], [3, 4, 5]):
    rbar = r[idx].mean()
    expect += np.mean([(r[i] - rbar - tau * ((lp[i] - old[i]) * m[i]).sum()) ** 2 for i in idx]) / 2
  assert float(loss) == pytest.approx(expect, rel=1e-5)


def test_gradient_matches_hand_derived_and_finite_differences():
  logits_BTS, tokens_BT, mask_BT, r_B, g_B = _inputs(1)
  tau = 0.5
  old_BT = algo.token_logprobs(logits_BTS, tokens_BT) - 0.05

  def loss_of_logprobs(lp_BT):
    return algo.k2_rl_loss(lp_BT, old_BT, mask_BT, r_B, g_B, tau=tau, num_groups=G)[0]

  lp_BT = algo.token_logprobs(logits_BTS, tokens_BT)
  grad_BT = jax.grad(loss_of_logprobs)(lp_BT)
  # dL/dlogpi[b,t] = -2 tau w_b (r_b - rbar_b - tau * logratio_b) m[b,t], w_b = 1/(K G) (K2 §3.2.3, derived)
  log_ratio = np.asarray(((lp_BT - old_BT) * mask_BT).sum(-1))
  r = np.asarray(r_B)
  rbar = np.repeat([r[:3].mean(), r[3:].mean()], 3)
  hand = -2 * tau / (3 * 2) * (r - rbar - tau * log_ratio)[:, None] * np.asarray(mask_BT)
  np.testing.assert_allclose(grad_BT, hand, rtol=1e-5, atol=1e-7)

  # Through the softmax into the logits: central differences on a few coordinates.
  def loss_of_logits(x):
    return loss_of_logprobs(algo.token_logprobs(x, tokens_BT))

  g = jax.grad(loss_of_logits)(logits_BTS)
  eps = 1e-2
  for idx in [(0, 1, 3), (4, 2, 0), (5, 3, 6), (2, 0, 1)]:
    e = jnp.zeros_like(logits_BTS).at[idx].set(eps)
    fd = (loss_of_logits(logits_BTS + e) - loss_of_logits(logits_BTS - e)) / (2 * eps)
    assert float(g[idx]) == pytest.approx(float(fd), rel=2e-2, abs=1e-5)


def test_at_old_policy_gradient_is_reinforce_with_mean_baseline():
  logits_BTS, tokens_BT, mask_BT, r_B, g_B = _inputs(2)
  tau = 2.0
  lp = algo.token_logprobs(logits_BTS, tokens_BT)
  grad = jax.grad(lambda x: algo.k2_rl_loss(x, lp, mask_BT, r_B, g_B, tau=tau, num_groups=G)[0])(lp)
  r = np.asarray(r_B)
  adv = r - np.repeat([r[:3].mean(), r[3:].mean()], 3)
  np.testing.assert_allclose(grad, -(2 * tau / 3 / 2) * adv[:, None] * np.asarray(mask_BT), rtol=1e-5)


def test_masked_samples_and_uneven_groups():
  _, _, mask_BT, r_B, g_B = _inputs()
  lp = jnp.zeros((B, T)) - 0.1
  sample_mask = jnp.asarray([1, 1, 0, 1, 1, 1], jnp.float32)
  loss, _ = algo.k2_rl_loss(lp, lp, mask_BT, r_B, g_B, tau=1.0, num_groups=3, sample_mask_B=sample_mask)
  # group 0 keeps samples 0,1 (mean 0.5), group 1 all three (mean 1/3); group 2 is empty and ignored
  r = np.asarray(r_B)
  expect = (np.mean((r[:2] - 0.5) ** 2) + np.mean((r[3:] - r[3:].mean()) ** 2)) / 2
  assert float(loss) == pytest.approx(expect, rel=1e-6)


def test_objective_with_ptx_and_old_logprob_source():
  _, _, mask_BT, r_B, g_B = _inputs()
  lp = jnp.full((B, T), -0.5)
  cfg = algo.K2LossConfig(tau=1.0, ptx_coef=0.1)
  loss, m = algo.k2_objective(cfg, lp, lp, mask_BT, r_B, g_B, num_groups=G, ptx_logprobs_BT=lp, ptx_mask_BT=mask_BT)
  assert float(m["ptx_loss"]) == pytest.approx(0.5) and float(loss) == pytest.approx(float(m["rl_loss"]) + 0.05)
  with pytest.raises(ValueError, match="ptx_logprobs_BT"):
    algo.k2_objective(cfg, lp, lp, mask_BT, r_B, g_B, num_groups=G)
  eng = jnp.ones((B, T))
  assert float(algo.select_old_logprobs(algo.K2LossConfig(old_logprobs="engine"), eng, lambda: 2 * eng).sum()) == B * T
  assert float(algo.select_old_logprobs(algo.K2LossConfig(), eng, lambda: 2 * eng).sum()) == 2 * B * T
  with pytest.raises(ValueError, match="old_logprobs"):
    algo.K2LossConfig(old_logprobs="both")


def test_rollout_metrics():
  z = np.zeros((4, 3), np.int32)
  batch = RolloutBatch(
    z,
    z,
    np.ones((4, 3), np.float32),
    z.astype(np.float32),
    z + 2,
    np.array([1, 1, 0, 1], np.float32),
    np.array([0, 0, 1, 1], np.int32),
    np.ones(4, np.int32),
    np.array([2, 4, 6, 8], np.int32),
    np.array([0, 0, 1, 0], bool),
    ("m",) * 4,
    0,
    1.0,
  )
  m = algo.rollout_metrics(batch)
  assert m["reward_mean"] == 0.75 and m["response_length_mean"] == 5 and m["truncation_rate"] == 0.25
  assert m["zero_std_group_frac"] == 0.5 and m["weight_version_min"] == 2
  with pytest.raises(ValueError, match="rewards_B"):
    RolloutBatch(z, z, z, z, z, np.ones(3), np.zeros(4), np.ones(4), np.ones(4), np.zeros(4, bool), ("m",) * 4, 0, 1.0)
