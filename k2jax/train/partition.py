"""Shardings of the whole TrainState from the model's logical axes (k2jax.sharding presets).

Params and the balancing bias take their preset sharding; every optimizer-state leaf whose key path
ends with a parameter's path and has that parameter's shape (Muon momentum, Adam moments) takes that
parameter's sharding; everything else (counters, scalars) is replicated. With `offload_opt_state` the
optimizer state's shardings name pinned host memory (`step.apply_update` brings it to HBM for the update).

With a pipeline whose stack is wholly pipelined, that stack's `layers` dimension is also sharded over the `stage`
mesh axis (contiguous blocks, layers kept in their natural order: a checkpoint restores under any layout). With
one repeat a block is exactly its stage's layers; with `v` repeats a stage's layers are strided (r*p*k + s*k + i),
so the step moves each stage's weights to it once per step (an all-to-all over `stage`) and the gradients back.
A stack with layers run outside the pipeline keeps them replicated over `stage`.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k2jax import sharding
from k2jax.model import pipeline as pipeline_lib
from k2jax.model.layers import RouterBias
from k2jax.train.step import TrainState


def state_shardings(
  abstract_model: nnx.Module,
  abstract_state: TrainState,
  mesh: Mesh,
  preset: str,
  *,
  offload_opt_state: bool = False,
  pipeline: pipeline_lib.PipelineSpec | None = None,
) -> TrainState:
  """A TrainState-shaped tree of NamedShardings for `abstract_state`."""
  params = nnx.to_pure_dict(sharding.param_shardings(nnx.state(abstract_model, nnx.Param), mesh, preset))
  bias = nnx.to_pure_dict(sharding.param_shardings(nnx.state(abstract_model, RouterBias), mesh, preset))
  stack = pipelined_stack(abstract_model, pipeline, mesh)
  if stack is not None:
    params[stack] = jax.tree.map(_over_stages, params[stack])
    if stack in bias:
      bias[stack] = jax.tree.map(_over_stages, bias[stack])
  by_path = {
    _keys(p): (s, _leaf_shape(abstract_state.params, p)) for p, s in jax.tree_util.tree_flatten_with_path(params)[0]
  }
  replicated = NamedSharding(mesh, P())

  def opt_leaf(path, x):
    keys = _keys(path)
    for n in range(len(keys), 0, -1):
      hit = by_path.get(keys[-n:])
      if hit is not None and hit[1] == x.shape:
        return hit[0]
    return replicated

  opt = jax.tree_util.tree_map_with_path(opt_leaf, abstract_state.opt_state)
  if offload_opt_state:
    opt = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt)
  return TrainState(step=replicated, params=params, bias=bias, opt_state=opt, skipped_steps=replicated)


def pipelined_stack(abstract_model: nnx.Module, pipeline: pipeline_lib.PipelineSpec | None, mesh: Mesh) -> str | None:
  """The state key of the stack whose layers are stored sharded over `stage` ('moe_layers' or 'dense_layers'),
  or None (no pipeline, a one-stage mesh, or layers of the stack run outside the pipeline)."""
  if pipeline is None or dict(mesh.shape).get(pipeline_lib.STAGE_AXIS, 1) == 1:
    return None
  cfg = abstract_model.cfg
  stack, n = ("moe_layers", cfg.num_moe_layers) if cfg.num_moe_layers else ("dense_layers", cfg.num_dense_layers)
  return stack if pipeline_lib.plan(pipeline, n).outside == 0 else None


def _over_stages(s: NamedSharding) -> NamedSharding:
  spec = tuple(s.spec)
  return NamedSharding(s.mesh, P(pipeline_lib.STAGE_AXIS, *spec[1:]))


def _keys(path) -> tuple[str, ...]:
  """Dict keys of a key path (NamedTuple fields and sequence indices of optax states dropped)."""
  return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _leaf_shape(tree: dict, path) -> tuple[int, ...]:
  for k in path:
    tree = tree[k.key]
  return tuple(tree.shape)
