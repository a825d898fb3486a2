"""What the learner compiles, built from a `LearnerConfig` (`k2jax.rl.learner`) in one place, so that
`k2jax.rl.aot` compiles for a TPU slice exactly the programs `Learner` runs: the optimizer, the RL update
step, the trainer's mesh shape and the model as a colocated engine serves it."""

from __future__ import annotations

import optax

from k2jax.model.config import ConfigError, K2Config
from k2jax.optim import QKClipSpec, muonclip
from k2jax.rl import rl_step
from k2jax.train.config import mesh_shape


def serving_config(cfg: K2Config) -> K2Config:
  """The model as a colocated engine on a serving mesh serves it: weights in the compute dtype."""
  return cfg.replace(param_dtype=cfg.compute_dtype)


def rollout_model_config(lc) -> K2Config:
  """The model the embedded engine serves: the policy's, its routed experts held as INT4 (packed codes and
  scales, each push quantized on arrival) with `rollout.quantization='int4'`, whatever the trainer's QAT."""
  quantization = lc.spec.rollout.quantization if lc.spec is not None else ""
  return lc.model.replace(expert_storage="int4") if quantization == "int4" else lc.model


def make_optimizer(lc):
  """(MuonClip, schedule): the warm-start LR for the first warm_start_steps updates, then the RL LR."""
  schedule = optax.join_schedules(
    [optax.constant_schedule(lc.warm_start_lr), optax.constant_schedule(lc.lr)], [lc.warm_start_steps]
  )
  optimizer = muonclip(
    schedule,
    weight_decay=lc.weight_decay,
    momentum=lc.momentum,
    qk_clip_tau=lc.qk_clip_tau,
    qk_clip_spec=QKClipSpec.from_config(lc.model),
  )
  return optimizer, schedule


def make_update(lc, mdef, optimizer, schedule):
  """The RL update step (K2 objective + PTX, MuonClip with QK-Clip) the learner jits through its core;
  `k2jax.rl.aot` compiles the same function for a TPU slice."""
  return rl_step.make_rl_step(
    mdef,
    optimizer,
    schedule,
    lc.loss,
    num_groups=lc.rollout.target_groups,
    bias_update_rate=lc.bias_update_rate,
    qk_clip_tau=lc.qk_clip_tau,
    critic_coef=lc.critic.coef if lc.critic else 0.0,
  )


def trainer_mesh_shape(lc, num_devices: int) -> dict[str, int]:
  """The trainer's mesh shape on `num_devices` (the whole mesh: ICI x DCN per axis), checked against every batch
  it steps on. The RL update does not pipeline: a stage axis would only replicate the model over it."""
  if lc.mesh.stage != 1 or lc.mesh.dcn_stage != 1:
    raise ConfigError(
      f"mesh.stage / mesh.dcn_stage: {lc.mesh.stage} / {lc.mesh.dcn_stage}: the RL update runs the layer stack "
      "unpipelined (pipeline stages are launch/train.py's); set both to 1 and give the devices to fsdp, expert "
      "or data"
    )
  shape = mesh_shape(lc.mesh, lc.model, num_devices, rows=lc.rows, what="rollout.target_groups")
  if lc.ptx:
    mesh_shape(lc.mesh, lc.model, num_devices, rows=lc.ptx.batch_size, what="ptx.batch_size")
  if lc.critic:
    mesh_shape(lc.mesh, lc.model, num_devices, rows=lc.critic.batch_size, what="critic.batch_size")
    mesh_shape(lc.mesh, lc.model, num_devices, rows=lc.critic.eval_rows, what="critic.eval_pairs (4 rows each)")
  if lc.warm_start_steps:
    mesh_shape(lc.mesh, lc.model, num_devices, rows=lc.warm_start_batch_size, what="warm_start.batch_size")
  return shape
