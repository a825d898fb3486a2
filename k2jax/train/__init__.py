"""The training core and its loops: pretraining / SFT (`run(config, workdir)`) here, RL in `k2jax.rl`.

What every loop uses: the mesh and sharded state (`core.build`, `state_shardings`), the one guarded
update (`apply_update`: non-finite skip, bias balancing, QK-Clip), the `Checkpointer`, the model-source
resolver (`resolve_model`, `source_config`, `source_state`: workdir | HF dir | preset) and the typed
config boundary (`from_config_dict`, `mesh_spec`, `mesh_shape`).
"""

from k2jax.train.checkpoint import Checkpointer
from k2jax.train.config import TrainConfig, check_runtime, from_config_dict, mesh_shape, mesh_spec
from k2jax.train.core import Core, build
from k2jax.train.counting import ParamCounts, count_params, flops_per_token
from k2jax.train.init_from import resolve_model, source_config, source_state
from k2jax.train.loop import run
from k2jax.train.partition import state_shardings
from k2jax.train.step import ModelDef, TrainState, accumulate_grads, apply_update, init_state, make_train_step

__all__ = [
  "Checkpointer",
  "Core",
  "ModelDef",
  "ParamCounts",
  "TrainConfig",
  "TrainState",
  "accumulate_grads",
  "apply_update",
  "build",
  "check_runtime",
  "count_params",
  "flops_per_token",
  "from_config_dict",
  "init_state",
  "make_train_step",
  "mesh_shape",
  "mesh_spec",
  "resolve_model",
  "run",
  "source_config",
  "source_state",
  "state_shardings",
]
