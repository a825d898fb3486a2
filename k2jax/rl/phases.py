"""Colocated RL phases: the engine and the trainer take turns on the same devices (K2 §3.3.2).

  generate   the engine holds its serving-layout weights and a KV cache; the trainer's optimizer state
             (and, with `offload_params`, its float32 master weights) wait in host memory
  update     the engine is paused, its KV cache freed and its weights dropped; the state comes back to
             the devices and the trainer steps
  push       the new weights are resharded from the training layout to the serving layout device to
             device (`InferenceEngine.update_weights_from_params`: cast to the served dtype where they
             are, then `jax.device_put` onto the serving shardings); no file is written

Host memory is the `pinned_host` memory kind of the arrays' own devices (TPU, GPU and XLA:CPU all have
it in jax 0.10): `jax.device_put(x, sharding.with_memory_kind("pinned_host"))`, a copy per shard that
never leaves its process. The device buffers are deleted right after the copy (cross-memory-kind
donation is not implemented in jax 0.10), so the memory is free when `to_host` returns. On XLA:CPU host
and device memory are the same RAM: there the round trip proves the mechanics (bitwise, buffers deleted),
not a saving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
from jax.sharding import SingleDeviceSharding

HOST = "pinned_host"


@dataclasses.dataclass(frozen=True)
class ColocateConfig:
  offload_opt_state: bool = True  # the optimizer state to host memory while the engine generates
  offload_params: bool = False  # the (float32 master) weights too: the engine serves its own copy


def host_kind_available(tree) -> bool:
  """Whether every device under `tree`'s arrays has a pinned_host memory."""
  devices = {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}
  return all(
    any(m.kind == HOST for m in d.addressable_memories()) for d in devices if d.process_index == jax.process_index()
  )


def to_host(tree):
  """`tree`'s arrays copied to pinned host memory (same shardings otherwise); the device copies deleted."""
  if not host_kind_available(tree):
    raise RuntimeError(f"offload: the devices of this mesh have no {HOST!r} memory (jax.Device.addressable_memories)")
  return _move(tree, HOST)


def to_device(tree):
  """The inverse of `to_host`: device memory again, the host copies freed."""
  return _move(tree, "device")


def _move(tree, kind: str):
  """`tree`'s arrays copied to `kind` memory of their own devices (same shardings otherwise), in one
  batched `jax.device_put`; then the sources deleted.

  One process: the whole tree at once (every array is fully addressable, so each shard is a plain copy to
  its own device's other memory). Several processes: the addressable shards, one flat batch, the global
  arrays reassembled from them: `jax.device_put` of a global (not fully addressable) array to another
  memory kind compiles a resharding program with collectives, and several of those in flight at once
  deadlocked two CPU processes over gloo (jax 0.10.2); a per-device copy has no collective. Batched, not
  one call per shard: the tiny config's optimizer state is 384 shards, and per-shard calls cost 3x the
  time in dispatch (bench/colocated.py)."""
  leaves, treedef = jax.tree.flatten(tree)
  out = (_copy_arrays if jax.process_count() == 1 else _copy_shards)(leaves, kind)
  jax.block_until_ready(out)
  for x in leaves:
    x.delete()
  return jax.tree.unflatten(treedef, out)


def _copy_arrays(leaves: list, kind: str) -> list:
  return jax.device_put(leaves, [x.sharding.with_memory_kind(kind) for x in leaves], may_alias=False)


def _copy_shards(leaves: list, kind: str) -> list:
  shards = [s for x in leaves for s in x.addressable_shards]
  moved = iter(jax.device_put([s.data for s in shards], [_on(s.device, kind) for s in shards], may_alias=False))
  return [
    jax.make_array_from_single_device_arrays(
      x.shape, x.sharding.with_memory_kind(kind), [next(moved) for _ in x.addressable_shards]
    )
    for x in leaves
  ]


def _on(device, kind: str) -> SingleDeviceSharding:
  return SingleDeviceSharding(device, memory_kind=kind)


class Phases:
  """Runs the learner's generation phases on a paused colocated `InferenceEngine` (every process calls
  `generation` at the same point: the engine's loops run in lockstep, process 0 drives the requests).

  `state` get/set: the learner's TrainState (its opt_state, and params with offload_params, move)."""

  def __init__(self, engine, config: ColocateConfig, get_state, set_state):
    self.engine, self.config = engine, config
    self._get, self._set = get_state, set_state
    self.seconds = {"offload": 0.0, "restore": 0.0}

  @contextlib.contextmanager
  def generation(self, *, release_weights: bool = True):
    """Offload the trainer's state, let the engine step; afterwards pause it, free its cache (and its
    weights when a push follows: `release_weights`) and bring the state back."""
    t0 = time.perf_counter()
    self._move(to_host)
    self.seconds["offload"] = time.perf_counter() - t0
    self.engine.resume()
    try:
      yield
    finally:
      self.engine.pause()
      self.engine.release_memory(weights=release_weights)
      t0 = time.perf_counter()
      self._move(to_device)
      self.seconds["restore"] = time.perf_counter() - t0

  def _move(self, fn) -> None:
    s, c = self._get(), self.config
    if c.offload_opt_state:
      s = s._replace(opt_state=fn(s.opt_state))
    if c.offload_params:
      s = s._replace(params=fn(s.params))
    self._set(s)
