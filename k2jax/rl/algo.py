"""The K2 RL objective (K2 §3.2.3, the K1.5 algorithm) and rollout metrics, as pure JAX functions.

For each prompt x with K responses y_i sampled from pi_old:

    L_RL = E_x [ 1/K sum_i ( r(x, y_i) - rbar(x) - tau * log(pi_theta(y_i|x) / pi_old(y_i|x)) )^2 ]

a squared regression of the group-centred reward onto tau times the *sequence* log-ratio (sum over response
tokens; no per-token normalisation, no clipping, no value function; reference §1.3). pi_old is the only
anchor: recomputed by the trainer at the start of the step (default, robust to train/inference mismatch) or
the engine's sampling logprobs. The PTX term is InstructGPT's token-level NLL on curated samples.

Shapes: B samples, T tokens, S vocab, G groups. Position t of a logprob array holds log p(x_t | x_<t).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from k2jax.rl.rollout_batch import RolloutBatch


REWARD_EPS = 1e-6  # rewards closer than this are equal (a group mean of equal float32 rewards may round)


@dataclasses.dataclass(frozen=True)
class K2LossConfig:
  tau: float = 1.0  # regulariser; also sets the step size (grad ~ 2 tau/K)
  ptx_coef: float = 0.0  # weight of the auxiliary PTX NLL
  old_logprobs: Literal["trainer", "engine"] = "trainer"

  def __post_init__(self):
    if self.tau <= 0:
      raise ValueError(f"K2LossConfig.tau must be > 0, got {self.tau}")
    if self.old_logprobs not in ("trainer", "engine"):
      raise ValueError(f"K2LossConfig.old_logprobs must be 'trainer' or 'engine', got {self.old_logprobs!r}")


def token_logprobs(logits_BTS: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """log p(tokens[:, t] | tokens[:, :t]) from next-token logits; 0 at t = 0 (nothing predicts it)."""
  logp_BTS = jax.nn.log_softmax(logits_BTS[:, :-1].astype(jnp.float32), axis=-1)
  picked_BT = jnp.take_along_axis(logp_BTS, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(picked_BT, ((0, 0), (1, 0)))


def select_old_logprobs(
  config: K2LossConfig, engine_logprobs_BT: jax.Array, recompute: Callable[[], jax.Array]
) -> jax.Array:
  """pi_old per token: the trainer's recomputation (calls `recompute`) or the engine's, per the config."""
  old_BT = recompute() if config.old_logprobs == "trainer" else jnp.asarray(engine_logprobs_BT)
  return jax.lax.stop_gradient(old_BT)


def sequence_logprobs(logprobs_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """log pi(y|x) = sum of response-token logprobs (K2 uses sequence probabilities; no length normalisation)."""
  return jnp.sum(logprobs_BT * mask_BT.astype(logprobs_BT.dtype), axis=-1)


def group_mean(
  values_B: jax.Array, group_ids_B: jax.Array, num_groups: int, sample_mask_B: jax.Array | None = None
) -> jax.Array:
  """Mean of `values_B` over each sample's group (masked samples excluded), broadcast back to [B]."""
  w_B = jnp.ones_like(values_B) if sample_mask_B is None else sample_mask_B.astype(values_B.dtype)
  sum_G = jax.ops.segment_sum(values_B * w_B, group_ids_B, num_groups)
  count_G = jax.ops.segment_sum(w_B, group_ids_B, num_groups)
  return (sum_G / jnp.maximum(count_G, 1.0))[group_ids_B]


def k2_rl_loss(
  logprobs_BT: jax.Array,
  old_logprobs_BT: jax.Array,
  mask_BT: jax.Array,
  rewards_B: jax.Array,
  group_ids_B: jax.Array,
  *,
  tau: float,
  num_groups: int,
  sample_mask_B: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """L_RL above, averaged over present groups and over the samples of each group (groups may differ in K)."""
  mask_BT = mask_BT.astype(jnp.float32)
  valid_B = jnp.ones_like(rewards_B, jnp.float32) if sample_mask_B is None else sample_mask_B.astype(jnp.float32)
  log_ratio_B = sequence_logprobs(logprobs_BT - jax.lax.stop_gradient(old_logprobs_BT), mask_BT)
  centred_B = rewards_B - group_mean(rewards_B, group_ids_B, num_groups, valid_B)
  residual_B = centred_B - tau * log_ratio_B
  count_G = jax.ops.segment_sum(valid_B, group_ids_B, num_groups)
  groups_present = jnp.maximum(jnp.sum(count_G > 0), 1)
  weight_B = valid_B / (jnp.maximum(count_G[group_ids_B], 1.0) * groups_present)
  loss = jnp.sum(weight_B * residual_B**2)
  aux = {
    "rl_loss": loss,
    "log_ratio_mean": jnp.sum(weight_B * log_ratio_B),
    "log_ratio_abs_max": jnp.max(jnp.abs(log_ratio_B) * valid_B),
    "centred_reward_abs_mean": jnp.sum(weight_B * jnp.abs(centred_B)),
    # samples whose reward differs from their group's mean: with none, the gradient at pi_old is zero
    "signal_samples": jnp.sum(valid_B * (jnp.abs(centred_B) > REWARD_EPS)).astype(jnp.int32),
  }
  return loss, aux


def ptx_loss(logprobs_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """Mean token NLL on the curated PTX samples (InstructGPT's auxiliary term)."""
  mask_BT = mask_BT.astype(jnp.float32)
  return -jnp.sum(logprobs_BT * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0)


def k2_objective(
  config: K2LossConfig,
  logprobs_BT,
  old_logprobs_BT,
  mask_BT,
  rewards_B,
  group_ids_B,
  *,
  num_groups: int,
  sample_mask_B=None,
  ptx_logprobs_BT=None,
  ptx_mask_BT=None,
):
  """L_RL + ptx_coef * L_PTX; returns (loss, metrics). PTX arrays are required iff ptx_coef > 0."""
  loss, aux = k2_rl_loss(
    logprobs_BT,
    old_logprobs_BT,
    mask_BT,
    rewards_B,
    group_ids_B,
    tau=config.tau,
    num_groups=num_groups,
    sample_mask_B=sample_mask_B,
  )
  if config.ptx_coef > 0:
    if ptx_logprobs_BT is None or ptx_mask_BT is None:
      raise ValueError("k2_objective: ptx_coef > 0 needs ptx_logprobs_BT and ptx_mask_BT")
    aux["ptx_loss"] = ptx_loss(ptx_logprobs_BT, ptx_mask_BT)
    loss = loss + config.ptx_coef * aux["ptx_loss"]
  aux["loss"] = loss
  return loss, aux


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
  """Host-side batch statistics for logging (numpy; no device work)."""
  r_B, len_B = batch.rewards_B.astype(np.float64), batch.response_lengths_B
  G = batch.num_groups
  std_G = np.array([r_B[batch.group_ids_B == g].std() for g in range(G)])
  versions = batch.weight_versions_BT[batch.loss_mask_BT > 0]
  tasks_B = np.array(batch.tasks)
  per_task = {f"reward_mean/{t}": float(r_B[tasks_B == t].mean()) for t in sorted(set(batch.tasks))}
  per_task.update({f"num_samples/{t}": float(np.sum(tasks_B == t)) for t in sorted(set(batch.tasks))})
  return {
    **per_task,
    "reward_mean": float(r_B.mean()),
    "reward_std": float(r_B.std()),
    "response_length_mean": float(len_B.mean()),
    "response_length_max": float(len_B.max()),
    "truncation_rate": float(batch.truncated_B.mean()),
    "zero_std_group_frac": float(np.mean(std_G < 1e-8)) if G else 0.0,
    "weight_version_min": float(versions.min()) if versions.size else -1.0,
    "num_samples": float(len(r_B)),
    "num_groups": float(G),
  }
