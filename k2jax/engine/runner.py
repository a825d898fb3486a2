"""Compiled model steps over a fixed-shape slot cache: prefill a batch of slots, decode all slots, copy rows.

Shapes are fixed so each function compiles once: the cache is [L, num_slots, max_len, ...]; decode
always runs all slots (free slots carry position max_len, so they write nothing); prefill runs the
requests admitted in one scheduling step together (as SGLang and vLLM do), as a [rows, T] batch padded
to power-of-two buckets in both dimensions (rows <= num_slots, T >= min_bucket, rows * T <=
max_prefill_tokens), one compile per bucket pair used. The cache is donated to
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
from jax.sharding import PartitionSpec as P
from flax import nnx

from k2jax import distributed
from k2jax.engine import decode
from k2jax.engine.placement import Placement, place
from k2jax.engine.sampling import Sampled, SamplingArrays, sample, sampling_arrays  # rl.aot reads the last here
from k2jax.engine.scored import jit_scored
from k2jax.model import int4
from k2jax.model.transformer import K2Model


DEFAULT_PREFILL_TOKENS = 8192


def bucket_length(n: int, min_bucket: int, max_len: int) -> int:
  """Prefill pad length: the smallest min_bucket * 2^i >= n, capped at max_len (n <= max_len)."""
  b = min_bucket
  while b < n:
    b *= 2
  return min(b, max_len)


def default_prefill_tokens(num_slots: int, max_len: int, min_bucket: int) -> int:
  """`max_prefill_tokens` 0: every slot at the smallest bucket, and as many full rows as fit in
  DEFAULT_PREFILL_TOKENS (vLLM's and SGLang's default batch budget), at least one."""
  return max(num_slots * min_bucket, max_len, min(num_slots * max_len, DEFAULT_PREFILL_TOKENS))


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
    max_prefill_tokens: int = 0,
    placement: Placement = Placement(),
  ):
    """`max_prefill_tokens`: the most padded tokens (rows * T) one batched prefill may hold (a single
    request always fits); 0 = enough for every slot at the smallest bucket, and at least max_len."""
    self.cfg = model.cfg
    self.num_slots, self.max_len, self.min_bucket = num_slots, max_len, min_bucket
    self.max_prefill_tokens = max(max_prefill_tokens or default_prefill_tokens(num_slots, max_len, min_bucket), max_len)
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
    self._decode, self._prefill, self._prefill_batch = steps.decode, steps.prefill, steps.prefill_batch
    self._read_row, self._write_row, self._init_cache = steps.read_row, steps.write_row, steps.init_cache
    # A prefill that also scores the prompts (prompt logprobs, `scored.py`), rows batched as `prefill` batches
    # them; single device only (`scores_prompts`). Each (rows, T) bucket compiles on first use, or in
    # `precompile(scored=True)`. Two variants by the prompt positions' top logprobs: 1 (what likelihood
    # scoring asks) or num_top.
    self._prefill_scored = jit_scored(graphdef, self._num_top) if self.placement.mesh is None else None

  @property
  def scores_prompts(self) -> bool:
    """Whether `prefill_scored` can run here (one device; a serving mesh has no scored program)."""
    return self._prefill_scored is not None

  def prefill_scored(
    self, slots: list[int], prompts: list[list[int]], sampling: SamplingArrays, prompt_top: int | None = None
  ):
    """`prefill` of whole prompts (each from position 0 of its slot; several rows in one [R, T] bucket, as
    `prefill` batches them, `prefill_fits` deciding how many) that also returns, from the same forward pass,
    per row: each prompt token's logprob given the tokens before it ([n - 1] float32, for tokens 1..n-1)
    and every position's top logprobs (ids, logprobs [n, num_top]; row t: the distribution over token
    t + 1). `prompt_top` (default num_top): how many of those top logprobs are needed; at most 1 runs the
    program that computes one (top_ids/top_lp [n, 1]), more the one with num_top.
    Returns (the sampled rows [A], [(token_lp, top_ids, top_lp)] per row)."""
    A, n_A = len(prompts), [len(p) for p in prompts]
    if self._prefill_scored is None or A < 1 or len(slots) != A or min(n_A) < 1:
      where = "mesh" if self.placement.mesh is not None else "device"
      raise ValueError(f"prefill_scored: {len(slots)} slots, prompt lengths {n_A} on a {where}")
    R, T = self.prefill_shape(A, max(n_A))
    tokens_RT = np.zeros((R, T), np.int32)
    positions_RT = np.full((R, T), self.max_len, np.int32)  # padding: out of range, write dropped
    for i, (prompt, n) in enumerate(zip(prompts, n_A)):
      tokens_RT[i, :n], positions_RT[i, :n] = prompt, np.arange(n)
    slots_R = np.full(R, slots[0], np.int32)  # padding rows read slot 0's row and write it back first
    slots_R[:A] = slots
    last_R = np.zeros(R, np.int32)
    last_R[:A] = np.asarray(n_A) - 1
    with self.placement.use():
      k = 1 if prompt_top is not None and prompt_top <= 1 else max(self._num_top, 1)
      (out, scores), self.cache = self._prefill_scored[k](
        self._state, self.cache, slots_R, tokens_RT, positions_RT, last_R, _pad_rows(sampling, R)
      )
    token_lp, top_ids, top_lp = (np.asarray(a) for a in scores)
    rows = [(token_lp[i, : n - 1], top_ids[i, :n], top_lp[i, :n]) for i, n in enumerate(n_A)]
    return jax.tree.map(lambda a: np.asarray(a)[:A], out), rows

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
    # INT4-served experts (`expert_storage='int4'`) from pushed float weights: quantized where they are, in
    # the trainer's dtype, so the codes are those its expert_qat='int4' forward pass used
    params = int4.served_params(params, nnx.to_pure_dict(self._abstract))
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

  def prefill(self, slot, tokens, start, sampling: SamplingArrays) -> Sampled:
    """Writes each row's tokens at positions start.. of its slot and samples the token after its last one.

    One row: `slot` and `start` ints, `tokens` a list. Several (the requests admitted in one step):
    `slot` and `start` [A] ints, `tokens` an int array [A, longest] padded with -1 after each row's end,
    `sampling` [A]; distinct slots. Returns the sampled rows [A]."""
    slots_A = np.atleast_1d(np.asarray(slot, np.int32))
    starts_A = np.atleast_1d(np.asarray(start, np.int32))
    tokens_AL = np.atleast_2d(np.asarray(tokens, np.int32))
    A = len(slots_A)
    n_A = (tokens_AL >= 0).sum(axis=1)
    if tokens_AL.shape[0] != A or len(starts_A) != A or np.any(n_A < 1):
      raise ValueError(f"prefill: {A} slots, {tokens_AL.shape[0]} token rows, {len(starts_A)} starts, lengths {n_A}")
    R, T = self.prefill_shape(A, int(n_A.max()))
    tokens_RT = np.zeros((R, T), np.int32)
    positions_RT = np.full((R, T), self.max_len, np.int32)  # padding: out of range, write dropped
    for i in range(A):
      tokens_RT[i, : n_A[i]] = tokens_AL[i, : n_A[i]]
      positions_RT[i, : n_A[i]] = np.arange(starts_A[i], starts_A[i] + n_A[i])
    slots_R = np.full(R, slots_A[0], np.int32)  # padding rows read slot 0's row and write it back first
    slots_R[:A] = slots_A
    last_R = np.zeros(R, np.int32)
    last_R[:A] = n_A - 1
    fn = self._prefill if R == 1 else self._prefill_batch
    with self.placement.use():
      out, self.cache = fn(self._state, self.cache, slots_R, tokens_RT, positions_RT, last_R, _pad_rows(sampling, R))
    return jax.tree.map(lambda a: np.asarray(a)[:A], out)

  def prefill_shape(self, rows: int, longest: int) -> tuple[int, int]:
    """The compiled (rows, T) bucket a prefill of `rows` requests, the longest `longest` tokens, runs in."""
    return bucket_length(rows, 1, self.num_slots), bucket_length(longest, self.min_bucket, self.max_len)

  def prefill_fits(self, rows: int, longest: int) -> bool:
    """Whether one batched prefill may hold these rows (one row always does)."""
    R, T = self.prefill_shape(rows, longest)
    return rows == 1 or R * T <= self.max_prefill_tokens

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

  def precompile(self, *, plain: bool = True, scored: bool = False) -> None:
    """Compiles every prefill bucket (rows x length) `prefill` can run, the decode step and the row copies
    now (`plain`), and with `scored` the same buckets of `prefill_scored`'s one-top-logprob program (what
    likelihood scoring runs), so that no request waits behind a compile later (a compile cannot be
    aborted). Every write lands at position max_len: dropped."""
    if plain:
      for R, T in self.prefill_buckets():
        self._prefill_padding(R, T)
      n = self.num_slots
      self.decode(np.zeros(n, np.int32), np.full(n, self.max_len, np.int32), _greedy(n))
      self.write_row(0, self.read_row(0))
    if scored and self._prefill_scored is not None:
      for R, T in self.prefill_buckets():
        tokens_RT, positions_RT = np.zeros((R, T), np.int32), np.full((R, T), self.max_len, np.int32)
        zeros = np.zeros(R, np.int32)
        with self.placement.use():
          _, self.cache = self._prefill_scored[1](
            self._state, self.cache, zeros, tokens_RT, positions_RT, zeros, _greedy(R)
          )

  def prefill_buckets(self) -> list[tuple[int, int]]:
    """Every (rows, T) shape `prefill` can compile: one row at every length bucket, several rows at the
    lengths that keep rows * T <= max_prefill_tokens."""
    lengths, T = [], min(self.min_bucket, self.max_len)
    while True:
      lengths.append(T)
      if T >= self.max_len:
        break
      T = min(2 * T, self.max_len)
    rows, R = [], 1
    while True:
      rows.append(R)
      if R >= self.num_slots:
        break
      R = min(2 * R, self.num_slots)
    return [(R, T) for R in rows for T in lengths if R == 1 or R * T <= self.max_prefill_tokens]

  def _prefill_padding(self, R: int, T: int) -> None:
    """Runs the prefill of bucket (R, T) on padding only: compiles it and changes no cache row."""
    tokens_RT, positions_RT = np.zeros((R, T), np.int32), np.full((R, T), self.max_len, np.int32)
    fn = self._prefill if R == 1 else self._prefill_batch
    with self.placement.use():
      _, self.cache = fn(
        self._state, self.cache, np.zeros(R, np.int32), tokens_RT, positions_RT, np.zeros(R, np.int32), _greedy(R)
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
  prefill: Callable  # (state, cache, slots_1, tokens_1T, positions_1T, last_index_1, sampling) -> (Sampled, cache)
  prefill_batch: Callable  # the same program over R > 1 rows (slots_R, tokens_RT, ...): its own jit cache
  read_row: Callable  # (cache, slot) -> one row (a prefix-cache entry)
  write_row: Callable  # (cache, row, slot) -> cache
  init_cache: Callable  # (cfg, num_slots, max_len) static -> a zeroed cache


def jit_steps(graphdef, num_top: int, placement: Placement, state_shardings) -> Steps:
  """The engine's steps jitted for `placement`: on one device jit places everything where its inputs are;
  on a serving mesh with explicit shardings (weights `state_shardings`, the cache by slot, host inputs and
  sampled outputs replicated) and the cache donated."""
  step = functools.partial(_step, graphdef, num_top)
  # Two partials: jit shares one compilation cache among wrappers of the same callable, and the one-row
  # program keeps its own (`_prefill._cache_size()` counts the length buckets).
  if placement.mesh is None:
    fn = _prefill
  else:  # the cache's slot axes (the preset's act_batch on this mesh; () when slots are not split)
    axes = placement.cache_sharding().spec[1]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    fn = functools.partial(_prefill_sharded, mesh=placement.mesh, axes=axes)
  prefill, prefill_batch = functools.partial(fn, step), functools.partial(fn, step)
  if placement.mesh is None:
    return Steps(
      decode=jax.jit(step, donate_argnums=(1,)),
      prefill=jax.jit(prefill, donate_argnums=(1,)),
      prefill_batch=jax.jit(prefill_batch, donate_argnums=(1,)),
      read_row=jax.jit(decode.read_row),
      write_row=jax.jit(decode.write_row, donate_argnums=(0,)),
      init_cache=jax.jit(decode.init_cache, static_argnums=(0, 1, 2)),
    )
  rep, cache, state = placement.replicated, placement.cache_sharding(), state_shardings
  io = dict(out_shardings=(rep, cache), donate_argnums=(1,))
  # A serving mesh may span processes (lockstep serving): each program runs on all together.
  together = distributed.compiled_together
  return Steps(
    decode=together(jax.jit(step, in_shardings=(state, cache, rep, rep, rep, rep), **io), "decode"),
    prefill=together(jax.jit(prefill, in_shardings=(state, cache) + (rep,) * 5, **io), "prefill"),
    prefill_batch=together(jax.jit(prefill_batch, in_shardings=(state, cache) + (rep,) * 5, **io), "prefill_batch"),
    read_row=together(jax.jit(decode.read_row, in_shardings=(cache, rep), out_shardings=rep), "read_row"),
    write_row=together(
      jax.jit(decode.write_row, in_shardings=(cache, rep, rep), out_shardings=cache, donate_argnums=(0,)), "write_row"
    ),
    init_cache=together(jax.jit(decode.init_cache, static_argnums=(0, 1, 2), out_shardings=cache), "init_cache"),
  )


def _step(graphdef, num_top, state, cache, tokens_BT, positions_BT, last_index_B, sampling):
  model = nnx.merge(graphdef, state)
  logits_BS, cache = decode.forward_cached(model, cache, tokens_BT, positions_BT, last_index_B)
  return sample(logits_BS, sampling, num_top), cache


def _prefill(step, state, cache, slots_R, tokens_RT, positions_RT, last_index_R, sampling):
  """Prefills R cache rows: gathers rows slots_R, runs the step over them, writes them back.

  Row slices and updates (R <= num_slots, unrolled) rather than a gather/scatter over the slot axis: the
  same program as a one-slot prefill for R = 1. Padding rows repeat slots_R[0] and leave its row
  unchanged (their positions are out of range); they are written back first, the real rows after."""
  R = tokens_RT.shape[0]
  rows = [jax.tree.map(functools.partial(_slice_row, slot=slots_R[i]), cache) for i in range(R)]
  rows = jax.tree.map(lambda *r: jax.numpy.concatenate(r, axis=1), *rows) if R > 1 else rows[0]
  out, rows = step(state, rows, tokens_RT, positions_RT, last_index_R, sampling)
  for i in reversed(range(R)):
    cache = jax.tree.map(functools.partial(_update_row, i=i, slot=slots_R[i]), cache, rows)
  return out, cache


def _slice_row(a, *, slot):
  return jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1)


def _update_row(a, rows, *, i, slot):
  return jax.lax.dynamic_update_slice_in_dim(a, rows[:, i : i + 1], slot, axis=1)


def _prefill_sharded(step, state, cache, slots_R, tokens_RT, positions_RT, last_index_R, sampling, *, mesh, axes):
  """`_prefill` for a cache sharded by slot over mesh `axes`. A dynamic index into a sharded dim makes XLA
  gather the whole cache onto every device first (`configs/rl.py:1t`, 640 slots x 4096 tokens: 177.7 GiB of
  temporaries per device, k2jax/rl/aot.py), so under `shard_map` each device slices its own shard: a row
  it holds, or zeros, summed over `axes` (exact: one term is the row), and it writes back only the rows
  it holds, in `_prefill`'s order (padding rows first, row 0 last). Every value is the one `_prefill`
  computes; each device reads and writes R rows, not R passes over its shard (the masked picks this
  replaced)."""
  R = tokens_RT.shape[0]
  specs = jax.tree.map(lambda _: P(None, axes or None, None, None), cache)
  rows_spec = jax.tree.map(lambda _: P(), cache)

  def local(slots, n):
    """Per row: (index into this device's shard, whether the shard holds the row)."""
    lo = jax.lax.axis_index(axes) * n if axes else 0
    k = slots - lo
    return jnp.clip(k, 0, n - 1), (k >= 0) & (k < n)

  def read(cache, slots):
    k, mine = local(slots, jax.tree.leaves(cache)[0].shape[1])

    def rows(a):
      picked = [jax.lax.dynamic_slice_in_dim(a, k[i], 1, axis=1) for i in range(R)]
      picked = [jnp.where(mine[i], p, jnp.zeros((), a.dtype)) for i, p in enumerate(picked)]
      picked = jnp.concatenate(picked, axis=1) if R > 1 else picked[0]
      return jax.lax.psum(picked, axes) if axes else picked

    return jax.tree.map(rows, cache)

  def write(cache, rows, slots):
    k, mine = local(slots, jax.tree.leaves(cache)[0].shape[1])

    def put(a, r):
      for i in reversed(range(R)):
        old = jax.lax.dynamic_slice_in_dim(a, k[i], 1, axis=1)
        a = jax.lax.dynamic_update_slice_in_dim(
          a, jnp.where(mine[i], r[:, i : i + 1].astype(a.dtype), old), k[i], axis=1
        )
      return a

    return jax.tree.map(put, cache, rows)

  rows = jax.shard_map(read, mesh=mesh, in_specs=(specs, P()), out_specs=rows_spec)(cache, slots_R)
  out, rows = step(state, rows, tokens_RT, positions_RT, last_index_R, sampling)
  cache = jax.shard_map(write, mesh=mesh, in_specs=(specs, rows_spec, P()), out_specs=specs)(cache, rows, slots_R)
  return out, cache


def _pad_rows(s: SamplingArrays, R: int) -> SamplingArrays:
  """`s` with greedy rows appended up to R (padding rows of a prefill batch)."""
  pad = R - len(np.asarray(s.temperature))
  if pad == 0:
    return s
  return SamplingArrays(*(np.concatenate([np.asarray(a), np.asarray(g)]) for a, g in zip(s, _greedy(pad))))


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
