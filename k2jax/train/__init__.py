"""Pretraining and SFT: `run(config, workdir)`, the pure train step, checkpoints, metrics, counts."""

from k2jax.train.checkpoint import Checkpointer
from k2jax.train.config import TrainConfig, check_runtime, from_config_dict
from k2jax.train.counting import ParamCounts, count_params, flops_per_token
from k2jax.train.loop import run
from k2jax.train.step import ModelDef, TrainState, accumulate_grads, init_state, make_train_step

__all__ = [
  "Checkpointer",
  "TrainConfig",
  "check_runtime",
  "from_config_dict",
  "ParamCounts",
  "count_params",
  "flops_per_token",
  "run",
  "ModelDef",
  "TrainState",
  "accumulate_grads",
  "init_state",
  "make_train_step",
]
