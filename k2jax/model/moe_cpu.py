"""The routed-expert SwiGLU of one device on CPU, dispatch and combine fused around the grouped matmuls.

  y[n] = Σ_j w[n, j] · down_e(silu(x[n] gate_e) * (x[n] up_e)),  e = idx[n, j]

Same function as `expert_parallel`'s sort -> three grouped matmuls -> unsort -> weighted sum, built for
XLA:CPU, where that chain spent more time moving rows than multiplying them: every grouped matmul
gathered its input rows into the [E, C] expert stack and scattered its output back to sorted rows
(forward and backward), and the sort and unsort each moved the [N*k, D] copies once more (profile of
bench/moe.py, small width: the gathers, scatters and the scatter-add of the sort's gradient were about
a quarter of the MoE layer's fwd+bwd). Here rows move once each way:

  dispatch  X[e, c] = x[token of the c-th copy routed to e] (zeros past the group's end): one gather
            straight from x [N, D], no sorted copy;
  experts   G = X gate, U = X up, H = silu(G) * U, Y = H down: batched dot_generals over [E, C, .],
            the same dots as grouped_matmul.py's bulk stack, without its scatters in between;
  combine   y[n] = Σ_j w[n, j] Y[slot(n, j)]: one gather + weighted sum, no scatter.

The backward is the same two gathers with the roles swapped (dY[e, c] = w · dy[token], dx[n] =
Σ_j dX[slot(n, j)]), so no scatter-add either. Copies past the bulk capacity C of their expert (a hot
expert) run as overflow tiles of `tile` rows, as in grouped_matmul.py; C comes from the same ladder and
cost model (`grouped_matmul.capacities`, `choose_capacity`), tiles of `overflow_tile` rows. Dropless:
no copy is lost.

Residuals: G, U and Y at the top rung of the ladder (~1.125 N*k rows), so the backward recomputes no
matmul; branches with a smaller C pad to it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k2jax.model import grouped_matmul as gm


def moe_swiglu(x_ND, weights_Nk, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD):
  """Σ_k weights[n,k] · SwiGLU_{idx[n,k]}(x[n]) -> [N, D] in x's dtype (CPU, one device's experts)."""
  N, k = idx_Nk.shape
  E = w_gate_EDF.shape[0]
  dt = x_ND.dtype
  ws = (w_gate_EDF.astype(dt), w_up_EDF.astype(dt), w_down_EFD.astype(dt))
  operands = (x_ND, weights_Nk.astype(dt), idx_Nk.astype(jnp.int32), *ws)
  vma = frozenset().union(*(gm._varying_axes(a) for a in operands))
  operands = tuple(gm._cast(a, vma) for a in operands)
  return _moe_swiglu(*operands, overflow_tile(N * k, E))


def overflow_tile(copies: int, experts: int) -> int:
  """Overflow tile rows: a quarter of the mean group, as a power of two in [8, 128]. Larger than
  grouped_matmul's (each tile here runs the whole SwiGLU and its gradient, so per-tile overhead
  counts more): measured on bench/moe.py's random routing, 128-row tiles cut the tiny width's
  fwd+bwd ~8% against 32-row ones and left the small width unchanged."""
  mean = max(copies // max(4 * experts, 1), 1)
  return int(min(128, max(8, 1 << (mean.bit_length() - 1))))


class _Routing:
  """Where every token copy m = n*k + j goes for bulk capacity C: slots of the [E, C] stack and tiles."""

  def __init__(self, idx_Nk, E: int, C: int, tile: int):
    N, k = idx_Nk.shape
    M = N * k
    self.N, self.k, self.M, self.C, self.tile = N, k, M, C, tile
    e_M = idx_Nk.reshape(-1)
    self.order_M = jnp.argsort(e_M, stable=True).astype(jnp.int32)  # sorted position -> copy
    self.sizes_E = jnp.bincount(e_M, length=E).astype(jnp.int32)
    ends_E = jnp.cumsum(self.sizes_E)
    self.starts_E, self.ends_E = ends_E - self.sizes_E, ends_E
    # Copy at bulk slot (e, c); M (no copy) past the group's end.
    i_C = jnp.arange(C, dtype=jnp.int32)
    pos_EC = jnp.where(i_C[None] < self.sizes_E[:, None], self.starts_E[:, None] + i_C, M)
    self.copy_EC = jnp.take(self.order_M, pos_EC, axis=0, mode="fill", fill_value=M)
    self.token_EC = jnp.where(self.copy_EC < M, self.copy_EC // k, N)  # N: out of range -> zero row
    # Slot of copy m: e*C + rank within its group while the rank is below C; E*C (none) otherwise.
    pos_M = jnp.zeros((M,), jnp.int32).at[self.order_M].set(jnp.arange(M, dtype=jnp.int32), unique_indices=True)
    rank_M = pos_M - self.starts_E[e_M]
    self.slot_Nk = jnp.where(rank_M < C, e_M * C + rank_M, E * C).reshape(N, k)
    # Overflow tiles over sorted positions: group e's copies from starts[e] + C in `tile`-row pieces.
    # Windows read `tile` sorted positions; with fewer than `tile` copies, the order is padded with M.
    self.Mp = max(M, tile)
    self.order_pad = jnp.pad(self.order_M, (0, self.Mp - M), constant_values=M)
    n_E = (jnp.maximum(self.sizes_E - C, 0) + tile - 1) // tile
    cum_E = jnp.cumsum(n_E)
    self.n_tiles = cum_E[-1]
    t_T = jnp.arange(-(-M // tile) + E, dtype=jnp.int32)  # static bound on the tile count
    self.e_T = jnp.minimum(jnp.searchsorted(cum_E, t_T, side="right"), E - 1).astype(jnp.int32)
    self.r_T = self.starts_E[self.e_T] + C + (t_T - (cum_E - n_E)[self.e_T]) * tile

  def dispatch(self, a_NX):
    """[N, X] -> [E, C, X]: each bulk slot's token row (zeros in empty slots)."""
    return jnp.take(a_NX, self.token_EC, axis=0, mode="fill", fill_value=0)

  def slot_weights(self, w_Nk):
    """[E, C]: the routing weight of each bulk slot's copy (0 in empty slots)."""
    return jnp.take(w_Nk.reshape(-1), self.copy_EC, axis=0, mode="fill", fill_value=0)

  def gather_slots(self, a_ECX):
    """[E, C, X] -> [N, k, X]: each copy's bulk row (zeros for overflow copies)."""
    E, C, X = a_ECX.shape
    return jnp.take(a_ECX.reshape(E * C, X), self.slot_Nk, axis=0, mode="fill", fill_value=0)

  def tile_at(self, t):
    """(expert, copies [tile], keep mask [tile]) of overflow tile t; rows outside it are masked off."""
    e, r = self.e_T[t], self.r_T[t]
    r0 = jnp.minimum(r, self.Mp - self.tile)  # windows past the end slide back; the mask keeps r..
    pos_t = r0 + jnp.arange(self.tile, dtype=jnp.int32)
    copies_t = jax.lax.dynamic_slice_in_dim(self.order_pad, r0, self.tile)
    return e, copies_t, (pos_t >= r) & (pos_t < self.ends_E[e])


def _swiglu_parts(x, wg, wu, wd, batched: bool):
  spec = ("ecd,edf->ecf", "ecf,efd->ecd") if batched else ("cd,df->cf", "cf,fd->cd")
  g = jnp.einsum(spec[0], x, wg, preferred_element_type=jnp.float32).astype(x.dtype)
  u = jnp.einsum(spec[0], x, wu, preferred_element_type=jnp.float32).astype(x.dtype)
  y = jnp.einsum(spec[1], jax.nn.silu(g) * u, wd, preferred_element_type=jnp.float32).astype(x.dtype)
  return g, u, y


def _forward_at(x_ND, w_Nk, idx_Nk, wg, wu, wd, *, C, C_max, tile):
  """Output [N, D] and residuals (G, U [E, C_max, F], Y [E, C_max, D]) for bulk capacity C."""
  E, D, F = wg.shape
  N, k = idx_Nk.shape
  r = _Routing(idx_Nk, E, C, tile)
  if C:
    g, u, y = _swiglu_parts(r.dispatch(x_ND), wg, wu, wd, batched=True)
    y_ND = jnp.einsum("nkd,nk->nd", r.gather_slots(y), w_Nk)
  else:
    g = u = jnp.zeros((E, 0, F), x_ND.dtype)
    y = jnp.zeros((E, 0, D), x_ND.dtype)
    y_ND = jnp.zeros((N, D), x_ND.dtype)
  y_ND = gm._varying_like(y_ND, x_ND, w_Nk, wg)
  w_M = w_Nk.reshape(-1)

  def one_tile(t, y_ND):
    e, copies_t, keep_t = r.tile_at(t)
    tok_t = copies_t // k  # masked-off rows may name token N (padding): clipped reads, dropped adds
    x_tD = jnp.take(x_ND, tok_t, axis=0, mode="clip")
    _, _, y_tD = _swiglu_parts(x_tD, wg[e], wu[e], wd[e], batched=False)
    add_tD = jnp.where(keep_t[:, None], jnp.take(w_M, copies_t, mode="clip")[:, None] * y_tD, 0)
    return y_ND.at[tok_t].add(add_tD, mode="drop")

  y_ND = jax.lax.fori_loop(0, r.n_tiles, one_tile, y_ND)
  pad = ((0, 0), (0, C_max - C), (0, 0))
  res = tuple(gm._varying_like(jnp.pad(a, pad), x_ND, w_Nk, wg) for a in (g, u, y))
  return y_ND, res


def _backward_at(x_ND, w_Nk, idx_Nk, wg, wu, wd, res, dy_ND, *, C, tile):
  E, D, F = wg.shape
  N, k = idx_Nk.shape
  r = _Routing(idx_Nk, E, C, tile)
  refs = (x_ND, w_Nk, wg, dy_ND)
  if C:
    g, u, y = (a[:, :C] for a in res)
    x_ECD, dy_ECD = r.dispatch(x_ND), r.dispatch(dy_ND)
    dw_Nk = jnp.einsum("nkd,nd->nk", r.gather_slots(y), dy_ND)
    dyw_ECD = dy_ECD * r.slot_weights(w_Nk)[..., None]
    sg = jax.nn.sigmoid(g)
    h = g * sg * u
    dh = jnp.einsum("ecd,efd->ecf", dyw_ECD, wd, preferred_element_type=jnp.float32).astype(x_ND.dtype)
    dwd = jnp.einsum("ecf,ecd->efd", h, dyw_ECD, preferred_element_type=jnp.float32)
    dg = dh * u * sg * (1 + g * (1 - sg))
    du = dh * g * sg
    dx_ECD = jnp.einsum("ecf,edf->ecd", dg, wg, preferred_element_type=jnp.float32) + jnp.einsum(
      "ecf,edf->ecd", du, wu, preferred_element_type=jnp.float32
    )
    dwg = jnp.einsum("ecd,ecf->edf", x_ECD, dg, preferred_element_type=jnp.float32)
    dwu = jnp.einsum("ecd,ecf->edf", x_ECD, du, preferred_element_type=jnp.float32)
    dx_ND = jnp.sum(r.gather_slots(dx_ECD.astype(x_ND.dtype)), axis=1)
  else:
    dw_Nk, dx_ND = jnp.zeros_like(w_Nk), jnp.zeros_like(x_ND)
    dwg, dwu, dwd = (jnp.zeros(a.shape, jnp.float32) for a in (wg, wu, wd))
  carry = tuple(gm._varying_like(a, *refs) for a in (dx_ND, dw_Nk.reshape(-1), dwg, dwu, dwd))
  w_M = w_Nk.reshape(-1)

  def one_tile(t, carry):
    dx_ND, dw_M, dwg, dwu, dwd = carry
    e, copies_t, keep_t = r.tile_at(t)
    tok_t = copies_t // k
    x_tD = jnp.take(x_ND, tok_t, axis=0, mode="clip")
    dy_tD = jnp.where(keep_t[:, None], jnp.take(dy_ND, tok_t, axis=0, mode="clip"), 0)

    def f(x_tD, w_t, wg_e, wu_e, wd_e):
      return w_t[:, None] * _swiglu_parts(x_tD, wg_e, wu_e, wd_e, batched=False)[2]

    _, vjp = jax.vjp(f, x_tD, jnp.take(w_M, copies_t, mode="clip"), wg[e], wu[e], wd[e])
    dx_tD, dw_t, dwg_e, dwu_e, dwd_e = vjp(dy_tD)
    dx_ND = dx_ND.at[tok_t].add(jnp.where(keep_t[:, None], dx_tD, 0), mode="drop")
    dw_M = dw_M.at[copies_t].add(jnp.where(keep_t, dw_t, 0), mode="drop")
    upd = lambda acc, d: jax.lax.dynamic_update_index_in_dim(acc, acc[e] + d, e, 0)  # noqa: E731
    return dx_ND, dw_M, upd(dwg, dwg_e), upd(dwu, dwu_e), upd(dwd, dwd_e)

  dx_ND, dw_M, dwg, dwu, dwd = jax.lax.fori_loop(0, r.n_tiles, one_tile, carry)
  return dx_ND, dw_M.reshape(N, k), dwg, dwu, dwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _moe_swiglu(x_ND, w_Nk, idx_Nk, wg, wu, wd, tile: int):
  return _fwd(x_ND, w_Nk, idx_Nk, wg, wu, wd, tile)[0]


def _caps(idx_Nk, E: int, tile: int):
  """(static capacity ladder, traced index of the cheapest rung for this routing)."""
  M = idx_Nk.size
  sizes_E = jnp.bincount(idx_Nk.reshape(-1), length=E).astype(jnp.int32)
  return gm.capacities(M, E), gm.choose_capacity(sizes_E, M, tile)


def _fwd(x_ND, w_Nk, idx_Nk, wg, wu, wd, tile):
  caps, i = _caps(idx_Nk, wg.shape[0], tile)
  branches = [functools.partial(_forward_at, C=C, C_max=caps[-1], tile=tile) for C in caps]
  y_ND, res = jax.lax.switch(i, branches, x_ND, w_Nk, idx_Nk, wg, wu, wd)
  return y_ND, (x_ND, w_Nk, idx_Nk, wg, wu, wd, res, i)


def _bwd(tile, saved, dy_ND):
  x_ND, w_Nk, idx_Nk, wg, wu, wd, res, i = saved
  caps = gm.capacities(idx_Nk.size, wg.shape[0])
  branches = [functools.partial(_backward_at, C=C, tile=tile) for C in caps]
  dx, dw, dwg, dwu, dwd = jax.lax.switch(i, branches, x_ND, w_Nk, idx_Nk, wg, wu, wd, res, dy_ND)
  return dx, dw, None, dwg.astype(wg.dtype), dwu.astype(wu.dtype), dwd.astype(wd.dtype)


_moe_swiglu.defvjp(_fwd, _bwd)
