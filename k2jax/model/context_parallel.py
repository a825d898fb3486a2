"""Context parallelism: the sequence sharded over one mesh axis, causally load-balanced.

With c context shards, the sequence is cut into 2c chunks of g = T/(2c) tokens and shard r holds chunks r
and 2c-1-r (MaxText's `dual_chunk_swap`, Megatron's zigzag): chunk k costs (k + 1/2)·g² under the causal
mask, so every shard holds (r + 1/2) + (2c - 1 - r + 1/2) = 2c units of attention work and none idles.

The model applies the permutation itself (`K2Model.__call__`): token ids, segment ids and positions go into
the balanced order once at entry (int32 [B, T]), so RoPE/YaRN positions and packed segments travel with their
tokens, and the last hidden state comes back to natural order once before the final norm; every layer in
between runs in the balanced order, and the logits and the loss are in the caller's order. Each move is two
`ppermute`s of one chunk per device (`_exchange`), no all-gather. Attention keys are gathered over the CP
axis and put back in natural order (`natural_keys`), so a query's causal mask compares its global position
(`global_positions`) with the key index.

Under CP a [B, T, ...] activation has B over the other batch axes and T over the CP axis; the MoE's flat
token dim [N] is sharded over all batch axes with the CP axis last, so `tokens_to_rows` flattens each
device's own [b, t] block into its [n] block with no communication (a token routes from where it is).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k2jax import sharding as sharding_lib


class ContextParallelError(ValueError):
  """The sequence length, kernel or layout cannot run context-parallel; the message names it."""


def degree(ctx: sharding_lib.Context | None) -> int:
  """The context-parallel degree of the active layout (1 when the sequence is not sharded)."""
  if ctx is None or ctx.context_axis is None:
    return 1
  return ctx.mesh.shape[ctx.context_axis]


def check_length(T: int, c: int) -> None:
  if c > 1 and T % (2 * c):
    raise ContextParallelError(
      f"context parallelism over {c} shards splits the sequence into 2 x {c} = {2 * c} load-balanced chunks: "
      f"sequence length {T} is not divisible by {2 * c}"
    )


@functools.cache
def global_positions(T: int, c: int) -> np.ndarray:
  """[T] int32: the natural (global) index of the token stored at each balanced index."""
  check_length(T, c)
  g = T // (2 * c)
  chunks = [k for r in range(c) for k in (r, 2 * c - 1 - r)]
  return np.concatenate([np.arange(k * g, (k + 1) * g) for k in chunks]).astype(np.int32)


@functools.cache
def _plan(c: int, forward: bool):
  """Static ppermute rounds between the natural layout (shard r holds chunks 2r, 2r+1) and the balanced one
  (shard r holds chunks r, 2c-1-r): per round the (source, destination) pairs and, per device, the local slot
  it sends from and the one it writes to. Forward rounds go by source slot, inverse rounds by destination
  slot: in both, every device sends and receives exactly one chunk per round (checked)."""
  natural = {(k // 2, k % 2): k for k in range(2 * c)}
  balanced = {(r, 0): r for r in range(c)} | {(r, 1): 2 * c - 1 - r for r in range(c)}
  src, dst = (natural, balanced) if forward else (balanced, natural)
  where = {k: pos for pos, k in dst.items()}
  rounds = []
  for s in (0, 1):
    pairs, send_slot, recv_slot = [], [0] * c, [0] * c
    for r in range(c):
      if forward:
        k = src[(r, s)]
        send_slot[r] = s
      else:
        k = next(k for (q, slot), k in src.items() if q == r and where[k][1] == s)
        send_slot[r] = next(slot for (q, slot), kk in src.items() if kk == k)
      to, slot = where[k]
      pairs.append((r, to))
      recv_slot[to] = slot
    if sorted(t for _, t in pairs) != list(range(c)):
      raise AssertionError(f"load-balance plan for {c} shards is not a permutation: {pairs}")
    rounds.append((tuple(pairs), np.asarray(send_slot, np.int32), np.asarray(recv_slot, np.int32)))
  return tuple(rounds)


def _exchange(x_BT, ctx, forward: bool):
  axis = ctx.context_axis
  c = ctx.mesh.shape[axis]
  check_length(x_BT.shape[1], c)
  spec = sharding_lib.logical_to_spec(("act_batch", "act_length") + (None,) * (x_BT.ndim - 2), ctx.preset)
  plan = _plan(c, forward)

  def local(x):
    b, t = x.shape[:2]
    x2 = x.reshape(b, 2, t // 2, *x.shape[2:])
    me = jax.lax.axis_index(axis)
    out = jnp.zeros_like(x2)
    for pairs, send_slot, recv_slot in plan:
      piece = jnp.take(x2, jnp.asarray(send_slot)[me], axis=1)
      got = jax.lax.ppermute(piece, axis, perm=pairs)
      out = jnp.where(
        (jnp.arange(2) == jnp.asarray(recv_slot)[me]).reshape(1, 2, *(1,) * (x2.ndim - 2)), got[:, None], out
      )
    return out.reshape(x.shape)

  return jax.shard_map(local, mesh=ctx.mesh, in_specs=spec, out_specs=spec, check_vma=False)(x_BT)


def balance(x_BT):
  """[B, T, ...] from natural order into the load-balanced order (identity without CP)."""
  ctx = sharding_lib.current()
  return x_BT if degree(ctx) == 1 else _exchange(x_BT, ctx, forward=True)


def restore(x_BT):
  """[B, T, ...] from the load-balanced order back into natural order (identity without CP)."""
  ctx = sharding_lib.current()
  return x_BT if degree(ctx) == 1 else _exchange(x_BT, ctx, forward=False)


def natural_keys(x_BS):
  """A gathered [B, S, ...] key-side array (balanced order, replicated over the CP axis) in natural order:
  a local static gather on every device."""
  ctx = sharding_lib.current()
  c = degree(ctx)
  if c == 1:
    return x_BS
  inverse = np.argsort(global_positions(x_BS.shape[1], c))
  return jnp.take(x_BS, jnp.asarray(inverse, jnp.int32), axis=1)


def query_positions(B: int, T: int):
  """[B, T] int32: each (balanced-order) query's index in the natural key sequence; None without CP."""
  ctx = sharding_lib.current()
  c = degree(ctx)
  if c == 1:
    return None
  pos_BT = jnp.broadcast_to(jnp.asarray(global_positions(T, c)), (B, T))
  return sharding_lib.constrain(pos_BT, ("act_batch", "act_length"))


def tokens_to_rows(x_BTD):
  """[B, T, D] -> [B*T, D] with each device's [b, t] block as its own [n] block (no communication)."""
  ctx = sharding_lib.current()
  B, T, D = x_BTD.shape
  if degree(ctx) == 1:
    return x_BTD.reshape(B * T, D)
  spec_in = sharding_lib.logical_to_spec(("act_batch", "act_length", None), ctx.preset)
  spec_out = sharding_lib.logical_to_spec(("act_batch", None), ctx.preset)
  _check_row_order(spec_in, spec_out, ctx)
  fn = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
  return jax.shard_map(fn, mesh=ctx.mesh, in_specs=spec_in, out_specs=spec_out, check_vma=False)(x_BTD)


def rows_to_tokens(x_ND, B: int, T: int):
  """Inverse of `tokens_to_rows`."""
  ctx = sharding_lib.current()
  D = x_ND.shape[-1]
  if degree(ctx) == 1:
    return x_ND.reshape(B, T, D)
  spec_in = sharding_lib.logical_to_spec(("act_batch", None), ctx.preset)
  spec_out = sharding_lib.logical_to_spec(("act_batch", "act_length", None), ctx.preset)
  c = ctx.mesh.shape[ctx.context_axis]
  _check_row_order(spec_out, spec_in, ctx)
  b, t = B * c // ctx.axis_size("act_batch"), T // c
  fn = lambda x: x.reshape(b, t, D)  # noqa: E731
  return jax.shard_map(fn, mesh=ctx.mesh, in_specs=spec_in, out_specs=spec_out, check_vma=False)(x_ND)


def _check_row_order(spec_BT, spec_N, ctx):
  """The flat token dim's mesh axes must be the row axes then the CP axis, so blocks line up."""
  rows = sharding_lib.spec_mesh_axes(spec_BT[0])
  if sharding_lib.spec_mesh_axes(spec_N[0]) != rows + (ctx.context_axis,):
    raise ContextParallelError(
      f"rules preset {ctx.preset!r}: act_batch must list the context axis {ctx.context_axis!r} last "
      f"(flat tokens {spec_N[0]} vs rows {spec_BT[0]} + sequence)"
    )
