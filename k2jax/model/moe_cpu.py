"""The routed-expert SwiGLU of one device on CPU: dispatch, grouped SwiGLU and combine in one custom VJP.

  y[n] = Σ_j w[n, j] · down_e(silu(x[n] gate_e) * (x[n] up_e)),  e = idx[n, j]

Same function as `expert_parallel`'s sort -> three grouped matmuls -> unsort -> weighted sum, built for
XLA:CPU. Layout: token copies sorted by expert into a padded row stack X [P, D], each expert's group
rounded up to a multiple of q rows (zero rows in the padding), so the rows computed are the real ones
plus under q per expert: work proportional to the routing, whatever its imbalance.

  dispatch  X[p] = x[token of the copy at padded row p]: one gather straight from x [N, D];
  experts   each group is cut into tiles of T0, T0/2, ... q rows (whole T0 tiles, then the binary
            digits of the remainder), one `fori_loop` per tile size whose trip count is the number of
            such tiles; a tile is three dots against its one expert's weights, written in place;
  combine   y[n] = Σ_j w[n, j] Y[slot(n, j)]: one gather + weighted sum, no scatter.

The backward runs the same tiles (dX, and the weight gradients accumulated per expert) with the
routing plan, G, U and the gathered Y saved from the forward: nothing is recomputed.

Why tiles, not the padded [E, C] stack of batched dot_generals this module used before: measured on
2 cores (XLA:CPU, jax 0.10; 16384 rows, D=1024, F=512, process CPU time, fwd dot rate): a `fori_loop`
of [T, D] x [D, F] tile dots runs at 130 / 149 / 169 GFLOP/s for T = 64 / 128 / 256 against 148 for
the batched [64, 256, D] dot, so the batched layout buys no speed, while its capacity C must be static:
the random router of bench/moe.py (busiest expert 1.8x the mean) left 17% of the [E, C] stack empty
and sent 17% of the rows through overflow tiles recomputed in the backward (1.23x the real rows in
all). Here: 1.06x (q = 32 at the small width), one compiled path instead of a `lax.switch` over six.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k2jax.model import grouped_matmul as gm

MAX_TILE = 256  # measured: 256-row tiles ran the fwd dot at 169 GFLOP/s, 512 no faster
MIN_TILE = 8


def moe_swiglu(x_ND, weights_Nk, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD):
  """Σ_k weights[n,k] · SwiGLU_{idx[n,k]}(x[n]) -> [N, D] in x's dtype (CPU, one device's experts)."""
  N, k = idx_Nk.shape
  E = w_gate_EDF.shape[0]
  dt = x_ND.dtype
  ws = (w_gate_EDF.astype(dt), w_up_EDF.astype(dt), w_down_EFD.astype(dt))
  operands = (x_ND, weights_Nk.astype(dt), idx_Nk.astype(jnp.int32), *ws)
  vma = frozenset().union(*(gm._varying_axes(a) for a in operands))
  operands = tuple(gm._cast(a, vma) for a in operands)
  return _moe_swiglu(*operands, tile_sizes(N * k, E))


def tile_sizes(copies: int, experts: int) -> tuple[int, ...]:
  """Tile rows, largest first: T0 = the mean group as a power of two in [MIN_TILE, MAX_TILE], then its
  halves down to q = T0 / 8 (at least MIN_TILE). Groups are padded to multiples of q (under q wasted
  rows per expert); the smaller tiles only cover each group's remainder below T0."""
  mean = max(copies // max(experts, 1), 1)
  top = int(min(MAX_TILE, max(MIN_TILE, 1 << (mean.bit_length() - 1))))
  return tuple(t for t in (top, top // 2, top // 4, top // 8) if t >= MIN_TILE)


def padded_rows(copies: int, experts: int, sizes: tuple[int, ...]) -> int:
  """Static row count P of the padded stack: every group rounded up to q, at most min(E, copies) groups."""
  q = sizes[-1]
  return gm._round_up(copies + min(experts, copies) * (q - 1), q)


class _Plan(NamedTuple):
  """Where the copies go (int32 arrays; saved for the backward). m = n*k + j is copy j of token n."""

  slot_Nk: jax.Array  # padded row of each copy
  copy_P: jax.Array  # copy at each padded row; M (none) in the padding
  tiles: tuple  # per tile size: (number of tiles, expert [bound], first row [bound])


def _plan(idx_Nk, E: int, sizes: tuple[int, ...]) -> _Plan:
  N, k = idx_Nk.shape
  M, q, T0 = N * k, sizes[-1], sizes[0]
  P = padded_rows(M, E, sizes)
  e_M = idx_Nk.reshape(-1)
  # Rank of each copy within its expert, in copy order (a counting sort: XLA:CPU's comparator sort of the
  # 4096 copies of the tiny width took 0.46 ms, this 0.08 ms; equal at the small width's 16384).
  hit_ME = e_M[:, None] == jnp.arange(E, dtype=jnp.int32)
  seen_ME = jnp.cumsum(hit_ME.astype(jnp.int32), axis=0)
  count_E = seen_ME[-1]
  rank_M = jnp.take_along_axis(seen_ME, e_M[:, None], axis=1)[:, 0] - 1
  pcount_E = (count_E + q - 1) // q * q
  pstart_E = jnp.cumsum(pcount_E) - pcount_E
  slot_M = pstart_E[e_M] + rank_M
  copy_P = jnp.full((P,), M, jnp.int32).at[slot_M].set(jnp.arange(M, dtype=jnp.int32), unique_indices=True)
  # Whole T0 tiles first, then one tile per binary digit of the remainder (a multiple of q below T0).
  n_E = pcount_E // T0
  tiles = [_tile_table(n_E, pstart_E, T0, P // T0)]
  off_E, rem_E = pstart_E + n_E * T0, pcount_E - n_E * T0
  for T in sizes[1:]:
    bit_E = (rem_E // T) % 2
    tiles.append(_tile_table(bit_E, off_E, T, E))
    off_E = off_E + bit_E * T
  return _Plan(slot_M.reshape(N, k), copy_P, tuple(tiles))


def _tile_table(n_E, first_E, T: int, bound: int):
  """(number of tiles, expert of tile t, first row of tile t) for n_E tiles of T rows from row first_E."""
  E = n_E.shape[0]
  cum_E = jnp.cumsum(n_E)
  t_T = jnp.arange(max(bound, 1), dtype=jnp.int32)
  e_T = jnp.minimum(jnp.searchsorted(cum_E, t_T, side="right"), E - 1).astype(jnp.int32)
  return cum_E[-1], e_T, first_E[e_T] + (t_T - (cum_E - n_E)[e_T]) * T


def _run_tiles(plan: _Plan, sizes, body, carry):
  """carry = body(T, expert, first row, carry) over every tile of every size."""
  for T, (n, e_T, r_T) in zip(sizes, plan.tiles):
    step = functools.partial(body, T)
    carry = jax.lax.fori_loop(0, n, lambda t, c, e_T=e_T, r_T=r_T, step=step: step(e_T[t], r_T[t], c), carry)
  return carry


def _dot(a, b, spec):
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _rows(plan: _Plan, a_NX, k: int):
  """[N, X] -> [P, X]: each padded row's token row (zeros in the padding)."""
  tok_P = jnp.where(plan.copy_P < plan.slot_Nk.size, plan.copy_P // k, a_NX.shape[0])
  return jnp.take(a_NX, tok_P, axis=0, mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _moe_swiglu(x_ND, w_Nk, idx_Nk, wg, wu, wd, sizes):
  return _fwd(x_ND, w_Nk, idx_Nk, wg, wu, wd, sizes)[0]


def _fwd(x_ND, w_Nk, idx_Nk, wg, wu, wd, sizes):
  E, D, F = wg.shape
  k = idx_Nk.shape[1]
  dt = x_ND.dtype
  plan = _plan(idx_Nk, E, sizes)
  P = plan.copy_P.shape[0]
  x_PD = _rows(plan, x_ND, k)

  def tile(T, e, r, carry):
    g_PF, u_PF, y_PD = carry
    x_tD = jax.lax.dynamic_slice_in_dim(x_PD, r, T)
    g_tF = _dot(x_tD, wg[e], "td,df->tf").astype(dt)
    u_tF = _dot(x_tD, wu[e], "td,df->tf").astype(dt)
    y_tD = _dot(jax.nn.silu(g_tF) * u_tF, wd[e], "tf,fd->td").astype(dt)
    put = jax.lax.dynamic_update_slice_in_dim
    return put(g_PF, g_tF, r, 0), put(u_PF, u_tF, r, 0), put(y_PD, y_tD, r, 0)

  refs = (x_ND, w_Nk, wg)
  init = tuple(gm._varying_like(jnp.zeros(s, dt), *refs) for s in ((P, F), (P, F), (P, D)))
  g_PF, u_PF, y_PD = _run_tiles(plan, sizes, tile, init)
  y_NkD = jnp.take(y_PD, plan.slot_Nk, axis=0)
  y_ND = jnp.einsum("nkd,nk->nd", y_NkD, w_Nk)
  return y_ND, (x_ND, w_Nk, wg, wu, wd, plan, g_PF, u_PF, y_NkD)


def _bwd(sizes, saved, dy_ND):
  x_ND, w_Nk, wg, wu, wd, plan, g_PF, u_PF, y_NkD = saved
  k = plan.slot_Nk.shape[1]
  dt = x_ND.dtype
  x_PD = _rows(plan, x_ND, k)
  w_P = jnp.take(w_Nk.reshape(-1), plan.copy_P, mode="fill", fill_value=0)
  dy_PD = _rows(plan, dy_ND, k) * w_P[:, None]
  dw_Nk = jnp.einsum("nkd,nd->nk", y_NkD, dy_ND)

  def tile(T, e, r, carry):
    dx_PD, dwg, dwu, dwd = carry
    cut = lambda a: jax.lax.dynamic_slice_in_dim(a, r, T)  # noqa: E731
    x_tD, dy_tD, g_tF, u_tF = cut(x_PD), cut(dy_PD), cut(g_PF), cut(u_PF)
    sg = jax.nn.sigmoid(g_tF)
    h_tF = g_tF * sg * u_tF
    dh_tF = _dot(dy_tD, wd[e], "td,fd->tf").astype(dt)
    dg_tF = dh_tF * u_tF * sg * (1 + g_tF * (1 - sg))
    du_tF = dh_tF * g_tF * sg
    dx_tD = _dot(dg_tF, wg[e], "tf,df->td") + _dot(du_tF, wu[e], "tf,df->td")
    acc = lambda a, d: jax.lax.dynamic_update_index_in_dim(a, a[e] + d, e, 0)  # noqa: E731
    return (
      jax.lax.dynamic_update_slice_in_dim(dx_PD, dx_tD.astype(dt), r, 0),
      acc(dwg, _dot(x_tD, dg_tF, "td,tf->df")),
      acc(dwu, _dot(x_tD, du_tF, "td,tf->df")),
      acc(dwd, _dot(h_tF, dy_tD, "tf,td->fd")),
    )

  refs = (x_ND, w_Nk, wg, dy_ND)
  init = (jnp.zeros(x_PD.shape, dt),) + tuple(jnp.zeros(a.shape, jnp.float32) for a in (wg, wu, wd))
  dx_PD, dwg, dwu, dwd = _run_tiles(plan, sizes, tile, tuple(gm._varying_like(a, *refs) for a in init))
  dx_ND = jnp.sum(jnp.take(dx_PD, plan.slot_Nk, axis=0), axis=1)
  return dx_ND, dw_Nk, None, dwg.astype(wg.dtype), dwu.astype(wu.dtype), dwd.astype(wd.dtype)


_moe_swiglu.defvjp(_fwd, _bwd)
