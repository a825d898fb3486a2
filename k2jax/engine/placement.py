"""Where the engine's weights and KV cache live: one device, or a serving mesh under a serving preset.

The serving layout is the engine's own, chosen by `EngineConfig.sharding` (`k2jax.sharding` presets `tp`,
`ep`, `tp_ep`) and `EngineConfig.mesh`, independent of the trainer's layout: a colocated trainer's weights
are resharded onto it device to device (`jax.device_put`). Every compiled engine step takes and returns
explicit shardings: weights per the preset, the cache [L, slots, T, R] sharded by slot over the preset's
`act_batch` axes (MLA caches one latent per token for all heads, so heads cannot shard it), and every
host input and sampled output replicated, so each process of a multi-process mesh feeds the same host
values and reads the whole result.

  mesh string: "tensor:4,data:2" (axes of k2jax.sharding.MESH_AXES; one size may be -1 = the rest);
  "" = the preset's default: tp -> tensor:-1, ep -> expert:-1 (tp_ep needs an explicit split).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k2jax import sharding as sharding_lib

DEFAULT_MESH = {"tp": {"tensor": -1}, "ep": {"expert": -1}}


def parse_mesh(text: str) -> dict[str, int]:
  """'tensor:4,data:2' -> {'tensor': 4, 'data': 2} (ValueError naming the bad entry)."""
  out = {}
  for part in (p.strip() for p in text.split(",") if p.strip()):
    axis, sep, size = part.partition(":")
    if not sep or axis not in sharding_lib.MESH_AXES or not size.lstrip("-").isdigit():
      raise ValueError(
        f"engine mesh {text!r}: entry {part!r} is not <axis>:<size> with axis in {sharding_lib.MESH_AXES}"
      )
    out[axis] = int(size)
  return out


@dataclasses.dataclass(frozen=True)
class Placement:
  """A serving mesh and preset, or (mesh None) this process's first device with jit's own placement."""

  mesh: Mesh | None = None
  preset: str = ""

  @property
  def replicated(self) -> NamedSharding | None:
    return None if self.mesh is None else NamedSharding(self.mesh, P())

  @property
  def batch_shards(self) -> int:
    """Devices the requests (cache slots, prefill tokens) are split over."""
    if self.mesh is None:
      return 1
    return math.prod(self.mesh.shape[a] for a in sharding_lib.rules(self.preset)["act_batch"] or ())

  def cache_sharding(self) -> NamedSharding | None:
    if self.mesh is None:
      return None
    return NamedSharding(self.mesh, sharding_lib.logical_to_spec((None, "act_batch", None, None), self.preset))

  def state_shardings(self, state):
    """NamedShardings for an nnx.State of the model under the preset (divisibility checked per tensor)."""
    return sharding_lib.param_shardings(state, self.mesh, self.preset)

  def use(self):
    """The (mesh, preset) context the engine's steps are traced under (MoE takes the EP path)."""
    return contextlib.nullcontext() if self.mesh is None else sharding_lib.use(self.mesh, self.preset)


def make_placement(preset: str, mesh: str = "", devices=None) -> Placement:
  """The engine's placement for `EngineConfig.sharding`/`.mesh` over `devices` (default: all devices of
  every process). `preset` "" serves on this process's first device."""
  if not preset:
    if mesh:
      raise ValueError(f"engine mesh {mesh!r} given without a serving preset (engine sharding: tp | ep | tp_ep)")
    return Placement()
  if preset not in sharding_lib.SERVING_PRESETS:
    raise ValueError(f"engine sharding {preset!r}: one of {sharding_lib.SERVING_PRESETS} (or '' for one device)")
  shape = parse_mesh(mesh) if mesh else DEFAULT_MESH.get(preset)
  if shape is None:
    raise ValueError(f"engine sharding {preset!r} needs an explicit mesh, e.g. 'expert:2,tensor:4'")
  return Placement(sharding_lib.make_mesh(shape, devices), preset)


def load_model(path: str, placement: Placement):
  """The model stored in `path` (workdir or HF dir) with its weights read straight onto `placement`'s
  shardings (`k2jax.api.source_state`), never whole on one device first."""
  from flax import nnx

  from k2jax import api
  from k2jax.convert.export_dir import recover
  from k2jax.model.transformer import K2Model

  recover(path)  # an export that died between its two renames (as k2jax.load)
  cfg = api.source_config(path)
  if placement.mesh is None:
    return api.model_from_state(cfg, api.source_state(path, cfg))
  abstract = nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  shardings = nnx.to_pure_dict(placement.state_shardings(abstract))
  return api.model_from_state(cfg, api.source_state(path, cfg, shardings))


def place(tree, shardings, *, copy: bool = False):
  """`tree` (device or host arrays) on `shardings`. Device arrays move device to device (`jax.device_put`,
  no copy when they are there already, unless `copy`: then the result never aliases the input, which its
  owner may donate or delete); host arrays, on a multi-process mesh, place only this process's shards
  (every process holds the same full values)."""

  if jax.process_count() == 1:
    return jax.device_put(tree, shardings, may_alias=False if copy else None)  # one batched transfer

  def one(x, s):
    if isinstance(x, jax.Array):
      # One leaf at a time, finished before the next: a cross-layout reshard of a global array is a program
      # with collectives, and several in flight at once deadlocked two CPU processes over gloo (jax 0.10.2).
      return jax.block_until_ready(jax.device_put(x, s, may_alias=False if copy else None))
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

  return jax.tree.map(one, tree, shardings)
