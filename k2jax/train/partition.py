"""Shardings of the whole TrainState from the model's logical axes (k2jax.sharding presets).

Params and the balancing bias take their preset sharding; every optimizer-state leaf whose key path
ends with a parameter's path and has that parameter's shape (Muon momentum, Adam moments) takes that
parameter's sharding; everything else (counters, scalars) is replicated. With `offload_opt_state` the
optimizer state's shardings name pinned host memory (`step.apply_update` brings it to HBM for the update).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k2jax import sharding
from k2jax.model.layers import RouterBias
from k2jax.train.step import TrainState


def state_shardings(
  abstract_model: nnx.Module, abstract_state: TrainState, mesh: Mesh, preset: str, *, offload_opt_state: bool = False
) -> TrainState:
  """A TrainState-shaped tree of NamedShardings for `abstract_state`."""
  params = nnx.to_pure_dict(sharding.param_shardings(nnx.state(abstract_model, nnx.Param), mesh, preset))
  bias = nnx.to_pure_dict(sharding.param_shardings(nnx.state(abstract_model, RouterBias), mesh, preset))
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


def _keys(path) -> tuple[str, ...]:
  """Dict keys of a key path (NamedTuple fields and sequence indices of optax states dropped)."""
  return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _leaf_shape(tree: dict, path) -> tuple[int, ...]:
  for k in path:
    tree = tree[k.key]
  return tuple(tree.shape)
