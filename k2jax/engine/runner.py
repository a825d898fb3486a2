"""Compiled model steps over a fixed-shape slot cache: prefill one slot, decode all slots, copy rows.

Shapes are fixed so each function compiles once: the cache is [L, num_slots, max_len, ...]; decode
always runs all slots (free slots carry position max_len, so they write nothing); prefill pads the new
tokens to a power-of-two bucket (>= min_bucket), one compile per bucket used. The cache is donated to
every step, so XLA updates it in place. On a serving mesh (`placement.Placement`) every step is jitted
with explicit in/out shardings: weights per the serving preset, the cache by slot, host inputs and
sampled outputs replicated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k2jax.engine import decode
from k2jax.engine.placement import Placement, place
from k2jax.engine.sampling import Sampled, SamplingArrays, sample
from k2jax.model.transformer import K2Model


def bucket_length(n: int, min_bucket: int, max_len: int) -> int:
  """Prefill pad length: the smallest min_bucket * 2^i >= n, capped at max_len (n <= max_len)."""
  b = min_bucket
  while b < n:
    b *= 2
  return min(b, max_len)


class ModelRunner:
  """Owns the params and the slot cache; all methods run on the scheduler thread."""

  def __init__(
    self,
    model: K2Model,
    *,
    num_slots: int,
    max_len: int,
    num_top: int,
    min_bucket: int = 16,
    placement: Placement = Placement(),
  ):
    self.cfg = model.cfg
    self.num_slots, self.max_len, self.min_bucket = num_slots, max_len, min_bucket
    self.placement = placement
    self._graphdef, state = nnx.split(model)
    self._shardings = None if placement.mesh is None else placement.state_shardings(state)
    self._state = state if self._shardings is None else place(state, self._shardings)
    self._abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)  # what set_params fits
    self._num_top = num_top
    self._compile(self._graphdef)
    self.cache = None
    self.allocate_cache()

  def _compile(self, graphdef) -> None:
    steps = jit_steps(graphdef, self._num_top, self.placement, self._shardings)
    self._decode, self._prefill = steps.decode, steps.prefill
    self._read_row, self._write_row, self._init_cache = steps.read_row, steps.write_row, steps.init_cache

  # ---- memory between phases (colocated RL) ---------------------------------------------------------
  def allocate_cache(self) -> None:
    """A zeroed slot cache (after `release_cache`; no-op while one exists)."""
    if self.cache is None:
      with self.placement.use():
        self.cache = self._init_cache(self.cfg, self.num_slots, self.max_len)

  def release_cache(self) -> None:
    """Frees the cache's device buffers now (`jax.Array.delete`), not when the last reference goes."""
    for a in jax.tree.leaves(self.cache):
      a.delete()
    self.cache = None

  def release_params(self) -> None:
    """Drops the served weights (their buffers go with the last reference: they may be a trainer's own
    arrays, which must not be deleted here). `set_params` serves again."""
    self._state = None

  def params(self) -> dict:
    """The served parameters as the model's pure state dict (the runner's own arrays, no copy)."""
    return nnx.to_pure_dict(self._state)

  def set_params(self, params: dict) -> None:
    """Serve `params` (the model's pure state dict, the served shapes) from the next step on.

    Floating leaves of another dtype are cast to the served one where they are (float32 master weights ->
    bf16 before they move: half the bytes), then placed where the served weights go (`jax.device_put`:
    the arrays themselves when they are there already, no copy; on a serving mesh a device-to-device
    reshard from the trainer's layout) and swapped into the model's state; the model is not rebuilt."""
    params = _cast_like(params, nnx.to_pure_dict(self._abstract))
    want, got = self._served_signature(), _signature(params)
    for path in sorted(want.keys() | got.keys()):
      if want.get(path) != got.get(path):
        raise ValueError(f"new weights do not fit the served model: {path} is {got.get(path)}, served {want.get(path)}")
    state = jax.tree.map(lambda x: x, self._abstract)  # a new State over the same variables
    # On a serving mesh the engine keeps its own copy (the trainer may donate or offload its arrays).
    nnx.replace_by_pure_dict(state, place(params, self._pure_shardings(), copy=self._shardings is not None))
    self._state = state

  def _served_signature(self) -> dict:
    return _signature(self._abstract)

  def _pure_shardings(self) -> dict:
    if self._shardings is None:  # one device: the first one of this process, or where the weights are
      here = jax.tree.map(lambda a: a.sharding, self._state) if self._state is not None else None
      return nnx.to_pure_dict(here) if here is not None else jax.local_devices()[0]
    return nnx.to_pure_dict(self._shardings)

  def prefill(self, slot: int, tokens: list[int], start: int, sampling: SamplingArrays) -> Sampled:
    """Writes tokens at positions start.. of `slot` and samples the token after the last one."""
    n = len(tokens)
    T = bucket_length(n, self.min_bucket, self.max_len)
    tokens_1T = np.zeros((1, T), np.int32)
    tokens_1T[0, :n] = tokens
    positions_1T = np.full((1, T), self.max_len, np.int32)  # padding: out of range, write dropped
    positions_1T[0, :n] = np.arange(start, start + n)
    with self.placement.use():
      out, self.cache = self._prefill(
        self._state, self.cache, np.int32(slot), tokens_1T, positions_1T, np.array([n - 1], np.int32), sampling
      )
    return jax.tree.map(np.asarray, out)

  def decode(self, tokens_N: np.ndarray, positions_N: np.ndarray, sampling: SamplingArrays) -> Sampled:
    """One token per slot at positions_N (max_len for free slots)."""
    with self.placement.use():
      out, self.cache = self._decode(
        self._state,
        self.cache,
        tokens_N[:, None].astype(np.int32),
        positions_N[:, None].astype(np.int32),
        np.zeros((self.num_slots,), np.int32),
        sampling,
      )
    return jax.tree.map(np.asarray, out)

  def precompile(self) -> None:
    """Compiles every prefill bucket, the decode step and the row copies now, so that no request waits
    behind a compile later (a compile cannot be aborted). Every write lands at position max_len: dropped."""
    T = min(self.min_bucket, self.max_len)  # every length bucket_length can return
    while True:
      self._prefill_padding(T)
      if T >= self.max_len:
        break
      T = min(2 * T, self.max_len)
    n = self.num_slots
    self.decode(np.zeros(n, np.int32), np.full(n, self.max_len, np.int32), _greedy(n))
    self.write_row(0, self.read_row(0))

  def _prefill_padding(self, T: int) -> None:
    """Runs the prefill of bucket T on padding only: compiles it and changes no cache row."""
    tokens_1T, positions_1T = np.zeros((1, T), np.int32), np.full((1, T), self.max_len, np.int32)
    with self.placement.use():
      _, self.cache = self._prefill(
        self._state, self.cache, np.int32(0), tokens_1T, positions_1T, np.zeros(1, np.int32), _greedy(1)
      )

  def read_row(self, slot: int) -> dict:
    with self.placement.use():
      return self._read_row(self.cache, np.int32(slot))

  def write_row(self, slot: int, row: dict) -> None:
    with self.placement.use():
      self.cache = self._write_row(self.cache, row, np.int32(slot))


@dataclasses.dataclass(frozen=True)
class Steps:
  """The engine's jitted programs (`ModelRunner` calls them; `k2jax.rl.aot` lowers them for a TPU slice)."""

  decode: Callable  # (state, cache, tokens_N1, positions_N1, last_index_N, sampling) -> (Sampled, cache)
  prefill: Callable  # (state, cache, slot, tokens_1T, positions_1T, last_index_1, sampling) -> (Sampled, cache)
  read_row: Callable  # (cache, slot) -> one row (a prefix-cache entry)
  write_row: Callable  # (cache, row, slot) -> cache
  init_cache: Callable  # (cfg, num_slots, max_len) static -> a zeroed cache


def jit_steps(graphdef, num_top: int, placement: Placement, state_shardings) -> Steps:
  """The engine's steps jitted for `placement`: on one device jit places everything where its inputs are;
  on a serving mesh with explicit shardings (weights `state_shardings`, the cache by slot, host inputs and
  sampled outputs replicated) and the cache donated."""
  step = functools.partial(_step, graphdef, num_top)
  prefill = functools.partial(_prefill if placement.mesh is None else _prefill_sharded, step)
  if placement.mesh is None:
    return Steps(
      decode=jax.jit(step, donate_argnums=(1,)),
      prefill=jax.jit(prefill, donate_argnums=(1,)),
      read_row=jax.jit(decode.read_row),
      write_row=jax.jit(decode.write_row, donate_argnums=(0,)),
      init_cache=jax.jit(decode.init_cache, static_argnums=(0, 1, 2)),
    )
  rep, cache, state = placement.replicated, placement.cache_sharding(), state_shardings
  io = dict(out_shardings=(rep, cache), donate_argnums=(1,))
  return Steps(
    decode=jax.jit(step, in_shardings=(state, cache, rep, rep, rep, rep), **io),
    prefill=jax.jit(prefill, in_shardings=(state, cache) + (rep,) * 5, **io),
    read_row=jax.jit(decode.read_row, in_shardings=(cache, rep), out_shardings=rep),
    write_row=jax.jit(decode.write_row, in_shardings=(cache, rep, rep), out_shardings=cache, donate_argnums=(0,)),
    init_cache=jax.jit(decode.init_cache, static_argnums=(0, 1, 2), out_shardings=cache),
  )


def _step(graphdef, num_top, state, cache, tokens_BT, positions_BT, last_index_B, sampling):
  model = nnx.merge(graphdef, state)
  logits_BS, cache = decode.forward_cached(model, cache, tokens_BT, positions_BT, last_index_B)
  return sample(logits_BS, sampling, num_top), cache


def _prefill(step, state, cache, slot, tokens_1T, positions_1T, last_index_1, sampling):
  row = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1), cache)
  out, row = step(state, row, tokens_1T, positions_1T, last_index_1, sampling)
  cache = jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=1), cache, row)
  return out, cache


def _prefill_sharded(step, state, cache, slot, tokens_1T, positions_1T, last_index_1, sampling):
  """`_prefill` for a cache sharded by slot: the row is picked by a mask over the slots, not a dynamic
  slice. A dynamic index into a sharded dim makes XLA gather the whole cache onto every device first
  (`configs/rl.py:1t`, 640 slots x 4096 tokens: 177.7 GiB of temporaries per device, k2jax/rl/aot.py); masked,
  each device sums its own shard (the row or zeros: exact) and one row is all-reduced, and the write is
  a local select. Every value is the one `_prefill` computes."""
  n = jax.tree.leaves(cache)[0].shape[1]
  mask = lambda a: (jnp.arange(n) == slot).reshape((1, n) + (1,) * (a.ndim - 2))  # noqa: E731
  row = jax.tree.map(lambda a: jnp.sum(jnp.where(mask(a), a, jnp.zeros((), a.dtype)), axis=1, keepdims=True), cache)
  out, row = step(state, row, tokens_1T, positions_1T, last_index_1, sampling)
  cache = jax.tree.map(lambda a, r: jnp.where(mask(a), r.astype(a.dtype), a), cache, row)
  return out, cache


def sampling_arrays(temperature, top_p, top_k, seed, position) -> SamplingArrays:
  """Host lists/arrays -> SamplingArrays with the dtypes the compiled steps expect."""
  return SamplingArrays(
    np.asarray(temperature, np.float32),
    np.asarray(top_p, np.float32),
    np.asarray(top_k, np.int32),
    np.asarray(seed, np.uint32),
    np.asarray(position, np.int32),
  )


def _greedy(n: int) -> SamplingArrays:
  return sampling_arrays([0.0] * n, [1.0] * n, [0] * n, [0] * n, [0] * n)


def _cast_like(params: dict, abstract: dict) -> dict:
  """Floating leaves of `params` in the dtype of `abstract`'s leaf at the same path (other leaves as they are)."""

  def one(x, a):
    same = getattr(x, "dtype", None) == a.dtype
    floats = np.issubdtype(getattr(x, "dtype", np.int32), np.floating) and np.issubdtype(a.dtype, np.floating)
    if same or not floats or tuple(x.shape) != tuple(a.shape):
      return x
    return _astype(x, a.dtype) if isinstance(x, jax.Array) else np.asarray(x).astype(a.dtype)

  try:
    return jax.tree.map(one, params, abstract)
  except ValueError:  # another tree structure: the signature check names the difference
    return params


@functools.partial(jax.jit, static_argnums=(1,))
def _astype(x, dtype):
  return x.astype(dtype)  # keeps the input's sharding: the cast runs where the trainer's shards are


def _signature(params) -> dict[str, tuple]:
  """Path -> (shape, dtype) of a pure state dict or an nnx.State."""
  if isinstance(params, nnx.State):
    params = nnx.to_pure_dict(params)
  return {
    jax.tree_util.keystr(path): (tuple(leaf.shape), str(leaf.dtype))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
  }
