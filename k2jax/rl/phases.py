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
  """Each addressable shard copied to `kind` memory of its own device, the global arrays reassembled
  from them; then the sources deleted. Shard by shard on purpose: `jax.device_put` of a whole global array
  to another memory kind compiles a resharding program with collectives, and several of those in flight
  at once deadlocked two CPU processes over gloo (seen with jax 0.10.2); a per-device copy has no collective."""

  def one(x):
    shards = [jax.device_put(s.data, SingleDeviceSharding(s.device, memory_kind=kind)) for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding.with_memory_kind(kind), shards)

  out = jax.tree.map(one, tree)
  jax.block_until_ready(out)
  for x in jax.tree.leaves(tree):
    x.delete()
  return out


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
