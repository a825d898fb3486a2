"""The routed-expert SwiGLU of one device on CPU: dispatch, grouped SwiGLU and combine in one custom VJP.

  y[n] = Σ_j w[n, j] · down_e(silu(x[n] gate_e) * (x[n] up_e)),  e = idx[n, j]

Same function as `expert_parallel`'s sort -> three grouped matmuls -> unsort -> weighted sum, built for
XLA:CPU. Layout: token copies sorted by expert (a counting sort) into P padded rows, each expert's group
rounded up to a multiple of q rows (zero rows in the padding), so the rows computed are the real ones
plus under q per expert: work proportional to the routing, whatever its imbalance. The backward runs
the same tiles with the routing plan and the forward's G, U, Y saved: nothing recomputed, no routing
redone. Combine: y[n] = Σ_j w[n, j] Y[slot(n, j)], one gather + weighted sum.

Wide experts (F > the batched tile; the small width): a `fori_loop` over experts slices the expert's
weights once and runs its group as whole tiles of T0 rows (an inner loop) plus one tile per binary digit
of the remainder (T0/2 .. q, each under a `cond`); a tile gathers its rows of x (and of dy) by token
and writes G, U, Y in place; the weight gradients accumulate in [D, F] carries written to row e once,
dx by a scatter-add of the tile's rows. No [P, D] copy of x or dy exists: 147k page faults per
fwd+bwd instead of 209k with them gathered up front (the same CPU time otherwise).

Narrow experts (F <= T, the tiny width): the tiles are T-row slices of the gathered stack X [P, D],
each with its expert's weights gathered ([P / T, D, F]: no more bytes than the rows), one batched dot
per product, gate and up as one [D, 2F] dot, weight gradients summed per expert by a one-hot matmul:
~70 thunks per fwd+bwd of the MoE layer instead of ~1150 for the loops at that width.

Measured (2 cores, XLA:CPU, jax 0.10, process CPU time, interleaved; bench/moe.py shapes): a loop of
[T, D] x [D, F] tile dots (D=1024, F=512) runs at 130 / 149 / 169 GFLOP/s for T = 64 / 128 / 256
against 148 for one batched [64, 256, D] dot, so tiles cost nothing in dot speed, while the [E, C]
stack this module used before needs a static capacity C: with bench/moe.py's random router (busiest
expert 1.8x the mean) it left 17% of the stack empty and ran 17% of the rows as overflow tiles
recomputed in the backward (1.23x the real rows; here 1.06x). MoE fwd+bwd over the dense layer of the
same FLOPs: small 1.40 -> 1.18-1.21, tiny 1.47 -> 1.06-1.08 (CPU-time ratios, lightly loaded machine).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k2jax.model import grouped_matmul as gm

MAX_TILE = 256  # T0 follows the mean group up to this; the fwd tile dot ran at 169 GFLOP/s with 256 rows
MIN_TILE = 8
# Tiny width, CPU time of the MoE layer against the loops: 128-row tiles 0.94, 64-row 0.95 (less padding
# does not pay); before gate and up were fused, 32-row tiles 1.17 (many small batched dots are slow).
BATCHED_TILE = 128


def moe_swiglu(x_ND, weights_Nk, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD):
  """Σ_k weights[n,k] · SwiGLU_{idx[n,k]}(x[n]) -> [N, D] in x's dtype (CPU, one device's experts)."""
  N, k = idx_Nk.shape
  E = w_gate_EDF.shape[0]
  dt = x_ND.dtype
  ws = (w_gate_EDF.astype(dt), w_up_EDF.astype(dt), w_down_EFD.astype(dt))
  operands = (x_ND, weights_Nk.astype(dt), idx_Nk.astype(jnp.int32), *ws)
  vma = frozenset().union(*(gm._varying_axes(a) for a in operands))
  operands = tuple(gm._cast(a, vma) for a in operands)
  sizes = tile_sizes(N * k, E)
  T = batched_tile(w_gate_EDF.shape[2], sizes)
  return _moe_swiglu_batched(*operands, T) if T else _moe_swiglu(*operands, sizes)


def batched_tile(width: int, sizes: tuple[int, ...]) -> int:
  """Rows of a batched tile for experts of this width (F), or 0 for the tile loops: batched when a tile's
  gathered weights [D, F] are no larger than its rows [T, D]."""
  T = min(BATCHED_TILE, sizes[0])
  return T if width <= T else 0


def tile_sizes(copies: int, experts: int) -> tuple[int, ...]:
  """Tile rows, largest first: T0 = the mean group as a power of two in [MIN_TILE, MAX_TILE], then its
  halves down to q = T0 / 8 (at least MIN_TILE). Groups are padded to multiples of q (under q wasted
  rows per expert); the smaller tiles only cover each group's remainder below T0. Small width, CPU time
  against q = T0 / 8: T0 / 4 1.025 (more padding), T0 / 16 1.019 (more tiles)."""
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
  first_E: jax.Array  # first padded row of each expert's group
  rows_E: jax.Array  # padded rows of each expert's group (a multiple of q)


def _plan(idx_Nk, E: int, sizes: tuple[int, ...]) -> _Plan:
  N, k = idx_Nk.shape
  M, q = N * k, sizes[-1]
  P = padded_rows(M, E, sizes)
  e_M = idx_Nk.reshape(-1)
  # Rank of each copy within its expert, in copy order (a counting sort: XLA:CPU's comparator sort of the
  # 4096 copies of the tiny width took 0.46 ms, this 0.08 ms; equal at the small width's 16384).
  hit_ME = e_M[:, None] == jnp.arange(E, dtype=jnp.int32)
  seen_ME = jnp.cumsum(hit_ME.astype(jnp.int32), axis=0)
  rank_M = jnp.take_along_axis(seen_ME, e_M[:, None], axis=1)[:, 0] - 1
  rows_E = (seen_ME[-1] + q - 1) // q * q
  first_E = jnp.cumsum(rows_E) - rows_E
  slot_M = first_E[e_M] + rank_M
  copy_P = jnp.full((P,), M, jnp.int32).at[slot_M].set(jnp.arange(M, dtype=jnp.int32), unique_indices=True)
  return _Plan(slot_M.reshape(N, k), copy_P, first_E, rows_E)


def _expert_tiles(sizes, first, rows, tile, carry):
  """carry = tile(T, first row, carry) over one expert's group of `rows` rows from row `first`: whole
  T0 tiles, then one tile per binary digit of the remainder (a multiple of q below T0)."""
  T0 = sizes[0]
  n = rows // T0
  carry = jax.lax.fori_loop(0, n, lambda i, c: tile(T0, first + i * T0, c), carry)
  at, rest = first + n * T0, rows - n * T0
  for T in sizes[1:]:
    bit = (rest // T) % 2
    # A cond, not a 0/1-trip loop: XLA hoists a loop-invariant tile out of such a loop and runs it always.
    carry = jax.lax.cond(bit > 0, lambda c, T=T, at=at: tile(T, at, c), lambda c: c, carry)
    at = at + bit * T
  return carry


def _dot(a, b, spec):
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _tokens(plan: _Plan, N: int):
  """[P]: the token of each padded row's copy; N (out of range: zero rows, dropped adds) in the padding."""
  return jnp.where(plan.copy_P < plan.slot_Nk.size, plan.copy_P // plan.slot_Nk.shape[1], N)


def _rows(plan: _Plan, a_NX):
  """[N, X] -> [P, X]: each padded row's token row (zeros in the padding)."""
  return jnp.take(a_NX, _tokens(plan, a_NX.shape[0]), axis=0, mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _moe_swiglu(x_ND, w_Nk, idx_Nk, wg, wu, wd, sizes):
  return _fwd(x_ND, w_Nk, idx_Nk, wg, wu, wd, sizes)[0]


def _fwd(x_ND, w_Nk, idx_Nk, wg, wu, wd, sizes):
  E, D, F = wg.shape
  dt = x_ND.dtype
  plan = _plan(idx_Nk, E, sizes)
  P = plan.copy_P.shape[0]
  tok_P = _tokens(plan, x_ND.shape[0])

  def expert(e, carry):
    wg_DF, wu_DF, wd_FD = wg[e], wu[e], wd[e]  # sliced once per expert, not per tile

    def tile(T, r, carry):
      g_PF, u_PF, y_PD = carry
      x_tD = jnp.take(x_ND, jax.lax.dynamic_slice_in_dim(tok_P, r, T), axis=0, mode="fill", fill_value=0)
      g_tF = _dot(x_tD, wg_DF, "td,df->tf").astype(dt)
      u_tF = _dot(x_tD, wu_DF, "td,df->tf").astype(dt)
      y_tD = _dot(jax.nn.silu(g_tF) * u_tF, wd_FD, "tf,fd->td").astype(dt)
      put = jax.lax.dynamic_update_slice_in_dim
      return put(g_PF, g_tF, r, 0), put(u_PF, u_tF, r, 0), put(y_PD, y_tD, r, 0)

    return _expert_tiles(sizes, plan.first_E[e], plan.rows_E[e], tile, carry)

  refs = (x_ND, w_Nk, wg)
  init = tuple(gm._varying_like(jnp.zeros(s, dt), *refs) for s in ((P, F), (P, F), (P, D)))
  g_PF, u_PF, y_PD = jax.lax.fori_loop(0, E, expert, init)
  y_ND = jnp.einsum("nkd,nk->nd", jnp.take(y_PD, plan.slot_Nk, axis=0), w_Nk)
  return y_ND, (x_ND, w_Nk, wg, wu, wd, plan, g_PF, u_PF, y_PD)


def _bwd(sizes, saved, dy_ND):
  x_ND, w_Nk, wg, wu, wd, plan, g_PF, u_PF, y_PD = saved
  N = x_ND.shape[0]
  dt = x_ND.dtype
  tok_P = _tokens(plan, N)
  w_P = jnp.take(w_Nk.reshape(-1), plan.copy_P, mode="fill", fill_value=0)
  refs = (x_ND, w_Nk, wg, dy_ND)

  def expert(e, carry):
    dx_ND, dw_P, dwg, dwu, dwd = carry
    wg_DF, wu_DF, wd_FD = wg[e], wu[e], wd[e]

    def tile(T, r, carry):
      dx_ND, dw_P, dwg_DF, dwu_DF, dwd_FD = carry
      cut = lambda a: jax.lax.dynamic_slice_in_dim(a, r, T)  # noqa: E731
      tok_t = cut(tok_P)
      x_tD = jnp.take(x_ND, tok_t, axis=0, mode="fill", fill_value=0)
      dy_tD = jnp.take(dy_ND, tok_t, axis=0, mode="fill", fill_value=0)
      g_tF, u_tF = cut(g_PF), cut(u_PF)
      dw_t = jnp.sum(cut(y_PD) * dy_tD, axis=1)
      dy_tD = dy_tD * cut(w_P)[:, None]
      sg = jax.nn.sigmoid(g_tF)
      h_tF = g_tF * sg * u_tF
      dh_tF = _dot(dy_tD, wd_FD, "td,fd->tf").astype(dt)
      dg_tF = dh_tF * u_tF * sg * (1 + g_tF * (1 - sg))
      du_tF = dh_tF * g_tF * sg
      dx_tD = _dot(dg_tF, wg_DF, "tf,df->td") + _dot(du_tF, wu_DF, "tf,df->td")
      return (
        dx_ND.at[tok_t].add(dx_tD.astype(dt), mode="drop"),  # padding rows name token N: dropped
        jax.lax.dynamic_update_slice_in_dim(dw_P, dw_t, r, 0),
        dwg_DF + _dot(x_tD, dg_tF, "td,tf->df"),
        dwu_DF + _dot(x_tD, du_tF, "td,tf->df"),
        dwd_FD + _dot(h_tF, dy_tD, "tf,td->fd"),
      )

    # The expert's weight gradients accumulate in [D, F] carries, written to row e once.
    zeros = tuple(gm._varying_like(jnp.zeros(a.shape[1:], jnp.float32), *refs) for a in (wg, wu, wd))
    dx_ND, dw_P, *dw = _expert_tiles(sizes, plan.first_E[e], plan.rows_E[e], tile, (dx_ND, dw_P, *zeros))
    put = lambda acc, d: jax.lax.dynamic_update_index_in_dim(acc, d, e, 0)  # noqa: E731
    return (dx_ND, dw_P, *(put(acc, d) for acc, d in zip((dwg, dwu, dwd), dw)))

  init = (jnp.zeros_like(x_ND), jnp.zeros(w_P.shape, dt))
  init += tuple(jnp.zeros(a.shape, jnp.float32) for a in (wg, wu, wd))
  dx_ND, dw_P, dwg, dwu, dwd = jax.lax.fori_loop(
    0, wg.shape[0], expert, tuple(gm._varying_like(a, *refs) for a in init)
  )
  dw_Nk = jnp.take(dw_P, plan.slot_Nk)
  return dx_ND, dw_Nk, None, dwg.astype(wg.dtype), dwu.astype(wu.dtype), dwd.astype(wd.dtype)


_moe_swiglu.defvjp(_fwd, _bwd)


# ---------------------------------------------------------------------------- narrow experts: batched tiles
def _tile_experts(plan: _Plan, T: int):
  """[P / T]: the expert of each T-row tile of the stack (groups padded to T); tiles past the last group
  (zero rows) get the last expert."""
  nT, E = plan.copy_P.shape[0] // T, plan.rows_E.shape[0]
  tile_T = jnp.arange(nT, dtype=jnp.int32) * T
  ends_E = jnp.cumsum(plan.rows_E)
  return jnp.minimum(jnp.searchsorted(ends_E, tile_T, side="right", method="compare_all"), E - 1).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _moe_swiglu_batched(x_ND, w_Nk, idx_Nk, wg, wu, wd, T):
  return _fwd_batched(x_ND, w_Nk, idx_Nk, wg, wu, wd, T)[0]


def _fwd_batched(x_ND, w_Nk, idx_Nk, wg, wu, wd, T):
  E, D, F = wg.shape
  dt = x_ND.dtype
  plan = _plan(idx_Nk, E, (T,))
  e_T = _tile_experts(plan, T)
  x_TtD = _rows(plan, x_ND).reshape(e_T.shape[0], T, D)
  # Gate and up as one dot against the tile's [D, 2F] weights: fewer, wider dots (narrow experts only).
  gu_TtG = _dot(x_TtD, _tile_weights(e_T, wg, wu), "ntd,ndg->ntg").astype(dt)
  g_TtF, u_TtF = gu_TtG[..., :F], gu_TtG[..., F:]
  y_TtD = _dot(jax.nn.silu(g_TtF) * u_TtF, jnp.take(wd, e_T, axis=0), "ntf,nfd->ntd").astype(dt)
  y_NkD = jnp.take(y_TtD.reshape(-1, D), plan.slot_Nk, axis=0)
  y_ND = jnp.einsum("nkd,nk->nd", y_NkD, w_Nk)
  return y_ND, (x_ND, w_Nk, wg, wu, wd, plan, e_T, gu_TtG, y_NkD)


def _tile_weights(e_T, wg, wu):
  """[P / T, D, 2F]: each tile's gate and up weights side by side."""
  return jnp.take(jnp.concatenate([wg, wu], axis=2), e_T, axis=0)


def _bwd_batched(T, saved, dy_ND):
  x_ND, w_Nk, wg, wu, wd, plan, e_T, gu_TtG, y_NkD = saved
  E, D, F = wg.shape
  dt = x_ND.dtype
  nT = e_T.shape[0]
  x_TtD = _rows(plan, x_ND).reshape(nT, T, D)
  w_P = jnp.take(w_Nk.reshape(-1), plan.copy_P, mode="fill", fill_value=0)
  dy_TtD = (_rows(plan, dy_ND) * w_P[:, None]).reshape(nT, T, D)
  dw_Nk = jnp.einsum("nkd,nd->nk", y_NkD, dy_ND)
  g_TtF, u_TtF = gu_TtG[..., :F], gu_TtG[..., F:]
  sg = jax.nn.sigmoid(g_TtF)
  h_TtF = g_TtF * sg * u_TtF
  dh_TtF = _dot(dy_TtD, jnp.take(wd, e_T, axis=0), "ntd,nfd->ntf").astype(dt)
  dgu_TtG = jnp.concatenate([dh_TtF * u_TtF * sg * (1 + g_TtF * (1 - sg)), dh_TtF * g_TtF * sg], axis=2)
  dx_TtD = _dot(dgu_TtG, _tile_weights(e_T, wg, wu), "ntg,ndg->ntd").astype(dt)
  dx_ND = jnp.sum(jnp.take(dx_TtD.reshape(-1, D), plan.slot_Nk, axis=0), axis=1)
  # Per-tile weight gradients, summed per expert by a one-hot matmul (tiles of one expert are adjacent).
  onehot_TE = (e_T[:, None] == jnp.arange(E, dtype=jnp.int32)).astype(jnp.float32)
  dwgu = jnp.einsum("ne,nxy->exy", onehot_TE, _dot(x_TtD, dgu_TtG, "ntd,ntg->ndg"))
  dwd = jnp.einsum("ne,nxy->exy", onehot_TE, _dot(h_TtF, dy_TtD, "ntf,ntd->nfd"))
  dwg, dwu = dwgu[..., :F], dwgu[..., F:]
  return dx_ND, dw_Nk, None, dwg.astype(wg.dtype), dwu.astype(wu.dtype), dwd.astype(wd.dtype)


_moe_swiglu_batched.defvjp(_fwd_batched, _bwd_batched)
