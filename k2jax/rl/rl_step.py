"""Pure RL train-step functions over `k2jax.train.step.TrainState`; the learner jits them.

  logprobs_fn(params, bias, tokens_BT, segment_ids_BT) -> logprobs_BT   pi_old recomputed by the trainer
  rl_grads(params, bias, batch, old_logprobs_BT, ptx, critic) -> (loss, aux, grads)   the K2 objective
      (+ PTX, + critic_coef * the verdict NLL of the critic rows, k2jax/rl/critic.py)
  rl_step(state, batch, old_logprobs_BT, ptx, critic) -> (state, m)   rl_grads, then `k2jax.train.apply_update`
  sft_step(state, tokens_BT, segment_ids_BT, mask_BT) -> (state, m)   NLL (warm start)

The learner jits them through the training core (`k2jax.train.core`), sharded as pretraining. Each
update feeds QK-Clip the max pre-softmax logits of every forward pass it ran (RL batch and PTX
batch), updates the MoE balancing bias from their expert counts, and drops the whole update (params,
optimizer state, bias) when the loss or gradients are not finite (metric `nonfinite`). It also drops an
update whose gradient is provably zero: every group's rewards equal (no sample's centred reward above
`algo.REWARD_EPS`), no PTX and no critic rows, and pi_old the trainer's own recomputation at these params
(`loss.old_logprobs=trainer`), so every residual of the K2 objective is zero in exact arithmetic. A Muon step
on that zero (or rounding-level) gradient would still move the weights a full step along stale momentum,
once per update of the batch (`train.step.apply_update`; metrics `signal`, `dropped`). With
`loss.old_logprobs=engine` pi_old is the engine's sampling logprobs: the trainer/engine gap is a non-zero
log-ratio whose gradient pulls the policy back to pi_old, so a flat batch is signal there unless every
log-ratio is exactly 0. A dropped update keeps params and optimizer state (no weight decay; the LR schedule's
count, kept in the optimizer state, does not advance: it counts applied updates) and still moves the
balancing bias, which learns from the forward's expert load, not from rewards.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from k2jax.rl.algo import K2LossConfig, k2_objective, ptx_loss, token_logprobs
from k2jax.train.step import ModelDef, TrainState, apply_update


def forward_logprobs(mdef: ModelDef, params: dict, bias: dict, tokens_BT, segment_ids_BT):
  """(log p(x_t | x_<t) [B, T] (0 at t = 0), ModelOutput) for right-padded, unpacked rows."""
  model = mdef.bind(params, bias)
  positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
  out = model(tokens_BT, segment_ids_BT, positions_BT)
  return token_logprobs(out.logits, tokens_BT), out


def make_logprobs_fn(mdef: ModelDef) -> Callable:
  def logprobs_fn(params, bias, tokens_BT, segment_ids_BT):
    return forward_logprobs(mdef, params, bias, tokens_BT, segment_ids_BT)[0]

  return logprobs_fn


def make_rl_step(
  mdef: ModelDef,
  optimizer: optax.GradientTransformationExtraArgs,
  schedule: optax.Schedule,
  loss_config: K2LossConfig,
  *,
  num_groups: int,
  bias_update_rate: float,
  qk_clip_tau: float | None,
  critic_coef: float = 0.0,
) -> Callable:
  """rl_step(state, batch, old_logprobs_BT, ptx, critic) with `ptx` None iff loss_config.ptx_coef == 0 and
  `critic` (rows: tokens_BT, segment_ids_BT, loss_mask_BT) None iff critic_coef == 0."""
  rl_grads = make_rl_grads(mdef, loss_config, num_groups=num_groups, critic_coef=critic_coef)

  def rl_step(state: TrainState, batch: dict, old_logprobs_BT, ptx: dict | None, critic: dict | None = None):
    loss, aux, grads = rl_grads(state.params, state.bias, batch, old_logprobs_BT, ptx, critic)
    state, metrics = apply_update(
      state,
      grads,
      loss,
      aux,
      optimizer,
      schedule,
      bias_update_rate=bias_update_rate,
      qk_clip_tau=qk_clip_tau,
      signal=aux["signal"],
    )
    metrics.update(
      {
        k: aux[k]
        for k in (
          "rl_loss",
          "log_ratio_mean",
          "log_ratio_abs_max",
          "centred_reward_abs_mean",
          "ptx_loss",
          "critic_loss",
          "signal_samples",
        )
        if k in aux
      }
    )
    metrics["samples_trained"] = jnp.sum(batch["sample_mask_B"])
    return state, metrics

  return rl_step


def make_rl_grads(mdef: ModelDef, loss_config: K2LossConfig, *, num_groups: int, critic_coef: float = 0.0) -> Callable:
  """rl_grads(params, bias, batch, old_logprobs_BT, ptx, critic) -> (loss, aux, grads) of the K2 objective
  (+ PTX, + critic_coef * the token-mean NLL of the critic rows' verdicts)."""

  def loss_fn(params, bias, batch, old_BT, ptx, critic):
    lp_BT, out = forward_logprobs(mdef, params, bias, batch["tokens_BT"], batch["segment_ids_BT"])
    max_logits, counts = out.max_logits, out.expert_counts
    ptx_lp_BT = ptx_mask_BT = None
    if ptx is not None:
      ptx_lp_BT, ptx_out = forward_logprobs(mdef, params, bias, ptx["tokens_BT"], ptx["segment_ids_BT"])
      max_logits = jnp.maximum(max_logits, ptx_out.max_logits)
      counts = counts + ptx_out.expert_counts
      ptx_mask_BT = ptx["loss_mask_BT"]
    loss, aux = k2_objective(
      loss_config,
      lp_BT,
      old_BT,
      batch["loss_mask_BT"],
      batch["rewards_B"],
      batch["group_ids_B"],
      num_groups=num_groups,
      sample_mask_B=batch["sample_mask_B"],
      ptx_logprobs_BT=ptx_lp_BT,
      ptx_mask_BT=ptx_mask_BT,
    )
    if (critic is None) != (critic_coef == 0):
      raise ValueError(f"rl_step: critic rows are required iff critic_coef > 0 (critic_coef={critic_coef})")
    if critic is not None:  # closed-loop critic refinement: one more forward, an SFT term like PTX
      critic_lp_BT, critic_out = forward_logprobs(mdef, params, bias, critic["tokens_BT"], critic["segment_ids_BT"])
      max_logits = jnp.maximum(max_logits, critic_out.max_logits)
      counts = counts + critic_out.expert_counts
      aux["critic_loss"] = ptx_loss(critic_lp_BT, critic["loss_mask_BT"])
      loss = loss + critic_coef * aux["critic_loss"]
      aux["loss"] = loss
    signal = aux["signal_samples"] > 0
    if loss_config.old_logprobs == "engine":  # the anchor is not this policy: any non-zero log-ratio has a gradient
      signal = signal | (aux["log_ratio_abs_max"] > 0)
    for rows in (ptx, critic):  # an SFT-style term learns from any row it has
      if rows is not None:
        signal = signal | (jnp.sum(rows["loss_mask_BT"]) > 0)
    aux.update(
      max_logits=max_logits,
      expert_counts=counts,
      tokens=jnp.sum(batch["loss_mask_BT"] * batch["sample_mask_B"][:, None]),
      signal=signal,
    )
    return loss, aux

  def rl_grads(params, bias, batch, old_BT, ptx, critic=None):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, bias, batch, old_BT, ptx, critic)
    return loss, aux, grads

  return rl_grads


def make_sft_step(
  mdef: ModelDef,
  optimizer: optax.GradientTransformationExtraArgs,
  schedule: optax.Schedule,
  *,
  qk_clip_tau: float | None,
) -> Callable:
  """Token-mean NLL over mask_BT (the warm start teaching the task's output format)."""

  def loss_fn(params, bias, tokens_BT, segment_ids_BT, mask_BT):
    lp_BT, out = forward_logprobs(mdef, params, bias, tokens_BT, segment_ids_BT)
    return ptx_loss(lp_BT, mask_BT), {
      "max_logits": out.max_logits,
      "expert_counts": out.expert_counts,
      "tokens": jnp.sum(mask_BT),
    }

  def sft_step(state: TrainState, tokens_BT, segment_ids_BT, mask_BT):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params, state.bias, tokens_BT, segment_ids_BT, mask_BT
    )
    return apply_update(state, grads, loss, aux, optimizer, schedule, bias_update_rate=0.0, qk_clip_tau=qk_clip_tau)

  return sft_step
