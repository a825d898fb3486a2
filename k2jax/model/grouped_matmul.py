"""Grouped matmul for CPU: `ragged_dot` semantics at dense-matmul cost.

y[rows of group e] = x[rows of group e] @ w[e] for contiguous row groups of sizes `group_sizes`;
rows past sum(group_sizes) give zeros. Same contract as `jax.lax.ragged_dot(x, w, group_sizes)`.

Why hand-written: on XLA:CPU (jax 0.10) `ragged_dot` lowers to one dense matmul of the row-masked
input against all E experts stacked, [M, E*D] @ [E*D, F]: E times the useful FLOPs (227x slower than
the dense matmul for E=64 in a measurement here). This kernel walks experts and, within each, row
tiles of `tile` rows: sum_e ceil(g_e / tile) small dense matmuls, waste at most one partial tile per
expert. GPU/TPU keep `ragged_dot` (native grouped matmul); see `experts.expert_ffn`.
The loops have data-dependent trip counts, so the gradient is a custom VJP built from the same loops:
dx = gmm(dy, w^T), dw[e] = x_e^T dy_e.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def default_tile(rows: int, groups: int) -> int:
  """Half the mean group size, as a power of two in [8, 128]: bounds the partial-tile waste."""
  mean = max(rows // max(2 * groups, 1), 1)
  return int(min(128, max(8, 1 << (mean.bit_length() - 1))))


def grouped_matmul(x_MD, w_EDF, group_sizes_E, tile: int):
  """x [M, D] @ w [E, D, F] per contiguous row group -> [M, F] (rows past the groups: zeros)."""
  # Inside shard_map, make every operand vary over the same mesh axes first: the custom VJP then
  # returns cotangents of matching type, and jax transposes the cast (a psum for weights that are
  # replicated over the batch axes).
  vma = _varying_axes(x_MD) | _varying_axes(w_EDF) | _varying_axes(group_sizes_E)
  x_MD, w_EDF, group_sizes_E = (_cast(a, vma) for a in (x_MD, w_EDF, group_sizes_E))
  return _grouped_matmul(x_MD, w_EDF, group_sizes_E, tile)


def _cast(x, vma):
  missing = tuple(sorted(vma - _varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(x_MD, w_EDF, group_sizes_E, tile: int):
  return _gmm(x_MD, w_EDF, group_sizes_E, tile)


def _tiles(group_sizes_E, tile):
  starts_E = jnp.cumsum(group_sizes_E) - group_sizes_E
  return starts_E, (group_sizes_E + tile - 1) // tile


def _gmm(x_MD, w_EDF, group_sizes_E, tile):
  M = x_MD.shape[0]
  E, _, F = w_EDF.shape
  x_pad = jnp.pad(x_MD, ((0, tile), (0, 0)))  # slices past the end never clamp
  starts_E, n_tiles_E = _tiles(group_sizes_E, tile)

  def expert(e, out):
    w_DF, start, end = w_EDF[e], starts_E[e], starts_E[e] + group_sizes_E[e]

    def one_tile(t, out):
      r = start + t * tile
      y_tF = jnp.dot(jax.lax.dynamic_slice_in_dim(x_pad, r, tile), w_DF, preferred_element_type=jnp.float32).astype(
        out.dtype
      )
      keep_t = (r + jnp.arange(tile)) < end
      old_tF = jax.lax.dynamic_slice_in_dim(out, r, tile)
      return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep_t[:, None], y_tF, old_tF), r, 0)

    return jax.lax.fori_loop(0, n_tiles_E[e], one_tile, out)

  out_MF = _varying_like(jnp.zeros((M + tile, F), x_MD.dtype), x_MD, w_EDF)
  out_MF = jax.lax.fori_loop(0, E, expert, out_MF)
  return out_MF[:M]


def _gmm_weight_grad(x_MD, dy_MF, group_sizes_E, tile, E):
  """dw[e] = x_e^T dy_e: per expert, accumulate over its row tiles (rows of other groups masked)."""
  x_pad = jnp.pad(x_MD, ((0, tile), (0, 0)))
  dy_pad = jnp.pad(dy_MF, ((0, tile), (0, 0)))
  starts_E, n_tiles_E = _tiles(group_sizes_E, tile)
  D, F = x_MD.shape[1], dy_MF.shape[1]

  def expert(e):
    start, end = starts_E[e], starts_E[e] + group_sizes_E[e]

    def one_tile(t, acc_DF):
      r = start + t * tile
      keep_t = (r + jnp.arange(tile)) < end
      x_tD = jnp.where(keep_t[:, None], jax.lax.dynamic_slice_in_dim(x_pad, r, tile), 0)
      dy_tF = jax.lax.dynamic_slice_in_dim(dy_pad, r, tile)
      return acc_DF + jnp.dot(x_tD.T, dy_tF, preferred_element_type=jnp.float32)

    acc_DF = _varying_like(jnp.zeros((D, F), jnp.float32), x_MD, dy_MF)
    return jax.lax.fori_loop(0, n_tiles_E[e], one_tile, acc_DF)

  # lax.map stacks the per-expert results: no [E, D, F] carry rewritten E times.
  return jax.lax.map(expert, jnp.arange(E))


def _varying_like(init, *refs):
  """Inside shard_map, a loop carry must vary over the same mesh axes as what the body adds to it."""
  vma = set().union(*(_varying_axes(r) for r in refs))
  return jax.lax.pcast(init, tuple(sorted(vma)), to="varying") if vma else init


def _varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  if hasattr(aval, "vma"):  # jax <= 0.9 spelling
    return frozenset(aval.vma)
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(manual.varying) if manual is not None else frozenset()


def _fwd(x_MD, w_EDF, group_sizes_E, tile):
  return _gmm(x_MD, w_EDF, group_sizes_E, tile), (x_MD, w_EDF, group_sizes_E)


def _bwd(tile, res, dy_MF):
  x_MD, w_EDF, group_sizes_E = res
  dx_MD = _gmm(dy_MF, jnp.swapaxes(w_EDF, 1, 2), group_sizes_E, tile).astype(x_MD.dtype)
  dw_EDF = _gmm_weight_grad(x_MD, dy_MF, group_sizes_E, tile, w_EDF.shape[0]).astype(w_EDF.dtype)
  return dx_MD, dw_EDF, None


_grouped_matmul.defvjp(_fwd, _bwd)
