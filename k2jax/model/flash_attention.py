"""Causal, packed-segment flash attention that also returns the per-head max logit (Pallas, TPU layout).

MLA attention (`k2jax.model.mla`) with q = [q_nope | q_rope] and k = [k_nope | k_rope broadcast over heads]
(qk head dim Kn+Kr, value head dim V). Query t may attend key s iff s <= t, both share a segment id and
that id is > 0 (0 = padding), exactly `mla.attention_mask`. Besides the output, the kernel returns the
max pre-softmax logit per head over valid positions and the whole batch, which QK-Clip (K2 §2.1) needs:
the online softmax keeps that running max anyway, so it costs one small extra output.

Blocking (flash-attention-2): the forward grid is (batch, head, q block, kv block); the kv axis is
sequential and carries the running max m, the denominator l and the unnormalised output in VMEM
scratch. Blocks wholly above the causal diagonal are skipped and their kv index is clamped to the last
needed block, so the pipeline fetches nothing for them. The forward saves only the output and
logsumexp [B, H, T]; the backward recomputes each block's probabilities from them (a dq kernel over kv
blocks, a dk/dv kernel over q blocks), so memory is linear in sequence length.

Rows with no valid key (padding, segment id 0) output exactly 0 with zero gradients, as the einsum path
does. The max logit of a head with no valid position anywhere is -inf (as the einsum path's). The max
logit is a statistic: its cotangent is ignored by the backward pass.

Layout follows the TPU rules (a block's last two dims are multiples of (8, 128) or the full dims):
per-row statistics travel as [.., T, 128] lane-broadcast tiles, segment ids as [B, T, 128] (queries)
and [B, 8, T] (keys), as in jax's own TPU flash/splash kernels. Lengths that are not a multiple of the
block are padded with segment id 0 and sliced off. On CPU the same kernel runs with
`pallas_call(interpret=True)` (tests).

Context parallelism (`k2jax.model.context_parallel`): the queries are one device's load-balanced share of
the sequence and the keys the whole gathered sequence in natural order, so q and k lengths differ and a
query's causal limit is its global position (`q_positions`), not its row. The kernel reads the positions
as a lane tile like the segment ids, and the per-q-block max position as a scalar-prefetch operand: the
forward and dq kernels skip (and do not fetch) kv blocks past it, the dk/dv kernel skips them; so a
balanced share costs its causal half, as the unsharded kernel does. Without `q_positions` the positions are
the rows (0..T-1) and the kernel is the unsharded one.

`impl="xla"` is the documented GPU fallback (`attention='flash_xla'`; the GPU kernel is tokamax's Triton
flash attention, `k2jax.model.attention_gpu`): the same algorithm and custom VJP in plain JAX, a `lax.scan` over kv
blocks for the forward and for the backward, each step holding [B, H, T, block_k] logits, so memory
stays linear in T (it computes blocks above the diagonal too, masked).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NUM_LANES = 128
NUM_SUBLANES = 8
DEFAULT_BLOCK = 512
_TRANS_B = (((1,), (1,)), ((), ()))  # a @ b.T


@dataclasses.dataclass(frozen=True)
class _Params:
  scale: float
  block_q: int
  block_k: int
  interpret: bool
  impl: str  # "pallas" | "xla"
  natural: bool = True  # q positions are the rows 0..T-1 (no context parallelism)


IMPLS = ("pallas", "xla")


def flash_attention(
  q_BTHK,
  k_BSHK,
  v_BSHV,
  segment_ids_BT,
  *,
  scale,
  kv_segment_ids_BS=None,
  q_positions_BT=None,
  block_q=None,
  block_k=None,
  interpret=False,
  impl="pallas",
):
  """Causal packed-segment attention: (out [B,T,H,V] in v's dtype, max_logit [H] float32).

  q: [B, T, H, Kq], k: [B, S, H, Kq] (MLA: [nope | rope], the rope key broadcast over heads); v: [B, S, H, V];
  segment_ids: [B, T] int (0 = padding). logits = scale * q.k in float32. Differentiable in q, k, v.
  Without `q_positions` S == T and query t attends keys s <= t; with it (context parallelism) query t
  attends keys s <= q_positions[b, t], of segment kv_segment_ids[b, s] (default: segment_ids).
  block_q / block_k default to min(512, length rounded up to 128). impl: "pallas" (the TPU kernel; off TPU
  pass interpret=True) or "xla" (plain-JAX blocked fallback for GPU).
  """
  if impl not in IMPLS:
    raise ValueError(f"flash_attention: impl must be one of {IMPLS}, got {impl!r}")
  B, T, H, _ = q_BTHK.shape
  S = k_BSHK.shape[1]
  kv_seg_BS = segment_ids_BT if kv_segment_ids_BS is None else kv_segment_ids_BS
  if q_positions_BT is None and S != T:
    raise ValueError(f"flash_attention: {S} keys for {T} queries needs q_positions (each query's key index)")
  if k_BSHK.shape != (B, S, H, q_BTHK.shape[-1]):
    raise ValueError(f"flash_attention: k has shape {k_BSHK.shape}, expected [B, S, H, Kq] with q's B, H, Kq")
  if v_BSHV.shape[:3] != (B, S, H):
    raise ValueError(f"flash_attention: v has shape {v_BSHV.shape}, expected [B, S, H, V] = [{B}, {S}, {H}, V]")
  for name, x, n in (("segment_ids", segment_ids_BT, T), ("kv_segment_ids", kv_seg_BS, S)) + (
    () if q_positions_BT is None else (("q_positions", q_positions_BT, T),)
  ):
    if x.shape != (B, n) or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"flash_attention: {name} must be an integer [{B}, {n}] array, got {x.dtype}{list(x.shape)}")
  default = min(DEFAULT_BLOCK, _round_up(max(T, S), NUM_LANES))
  bq, bk = block_q or default, block_k or default
  for name, b in (("block_q", bq), ("block_k", bk)):
    if b <= 0 or (impl == "pallas" and not interpret and b % NUM_LANES):
      raise ValueError(f"flash_attention: {name}={b} must be a positive multiple of {NUM_LANES} on TPU")
  natural = q_positions_BT is None
  if natural:
    Tp = Sp = _round_up(T, math.lcm(bq, bk))
    q_positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  else:
    Tp, Sp = _round_up(T, bq), _round_up(S, bk)
  params = _Params(float(scale), bq, bk, bool(interpret), impl, natural)
  q = jnp.swapaxes(_pad_time(q_BTHK, Tp, 0), 1, 2)
  k, v = (jnp.swapaxes(_pad_time(x, Sp, 0), 1, 2) for x in (k_BSHK, v_BSHV))
  seg_BT = _pad_time(segment_ids_BT.astype(jnp.int32), Tp, 0)
  kv_seg_BS = _pad_time(kv_seg_BS.astype(jnp.int32), Sp, 0)
  pos_BT = _pad_time(q_positions_BT.astype(jnp.int32), Tp, 0)
  o_BHTV, max_logit_H = _flash(q, k, v, (seg_BT, kv_seg_BS, pos_BT), params)
  # A statistic (QK-Clip's input): no gradient flows through it, so callers may pmax it under grad.
  return jnp.swapaxes(o_BHTV, 1, 2)[:, :T], lax.stop_gradient(max_logit_H)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad_time(x, Tp, value):
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, Tp - x.shape[1])
  return jnp.pad(x, pad, constant_values=value) if Tp != x.shape[1] else x


# ------------------------------------------------------------------------------------- custom VJP
# `masks` = (q segment ids [B, T], kv segment ids [B, S], q positions [B, T]), int32, padded.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, masks, params):
  o, _, max_logit_H = _FORWARD[params.impl](q, k, v, masks, params)
  return o, max_logit_H


def _flash_fwd(q, k, v, masks, params):
  o, lse_BHT, max_logit_H = _FORWARD[params.impl](q, k, v, masks, params)
  return (o, max_logit_H), (q, k, v, masks, o, lse_BHT)


def _flash_bwd(params, res, cts):
  q, k, v, masks, o, lse_BHT = res
  do, _ = cts  # the max logit is a statistic (QK-Clip input), not a differentiable output
  do = do.astype(o.dtype)
  di_BHT = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  dq, dk, dv = _BACKWARD[params.impl](q, k, v, masks, do, lse_BHT, di_BHT, params)
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# -------------------------------------------------------------------------------- kernel helpers
def _lanes(x, n):
  """A [rows, 128] lane-broadcast tile as [rows, n] (n = block or head width)."""
  if n == NUM_LANES:
    return x
  if n < NUM_LANES:
    return x[:, :n]
  return jnp.tile(x, (1, -(-n // NUM_LANES)))[:, :n]


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
  """float32-accumulated matmul of a block. float32 operands follow jax's default matmul precision, as
  the einsum path does; bfloat16 ones take the MXU's native pass (Mosaic rejects an fp32-precision
  contraction of bfloat16 operands, e.g. under jax_default_matmul_precision='highest')."""
  precision = lax.Precision.DEFAULT if a.dtype == jnp.bfloat16 else None
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _needed(qmax_ref, b, i, j, bk):
  """Whether kv block j has a key at or below the causal limit of some query of q block i (the block's
  largest position, a scalar-prefetch operand: rows i*bq.. without context parallelism)."""
  return j * bk <= qmax_ref[b, i]


# Grid ids are non-negative, so lax.div (C division) is floor division; `//` lowers through sign().
def _last_kv_block(qmax_ref, b, i, j, bk):
  """Kv block to fetch at step j of q block i: j itself, or the last needed one past the causal limit."""
  return jnp.minimum(j, lax.div(jnp.maximum(qmax_ref[b, i], 0), bk))


def _first_q_block(j, i, bq, bk):
  """Q block to fetch at step i of kv block j (natural order): i, or the first needed one before the diagonal."""
  return jnp.maximum(i, lax.div(j * bk, bq))


def _valid(qseg_ref, kvseg_ref, qpos_ref, j, bq, bk):
  q_ids = _lanes(qseg_ref[...], bk)  # [bq, bk]
  kv_ids = kvseg_ref[:1, :]  # [1, bk]
  rows = _lanes(qpos_ref[...], bk)  # each query's causal limit (its position)
  cols = lax.broadcasted_iota(jnp.int32, (bq, bk), 1) + j * bk
  return (q_ids == kv_ids) & (q_ids > 0) & (cols <= rows)


def _logits(q_ref, k_ref, qseg_ref, kvseg_ref, qpos_ref, j, params):
  """Masked float32 logits of one block: -inf where query r may not attend key j*bk+c."""
  s = _dot(q_ref[...], k_ref[...], _TRANS_B) * params.scale
  return jnp.where(_valid(qseg_ref, kvseg_ref, qpos_ref, j, params.block_q, params.block_k), s, -jnp.inf)


def _mask_tiles(masks, bq):
  """(q segment tile [B,T,128], kv segment tile [B,8,S], q position tile [B,T,128], per-q-block max
  position [B, nq] for scalar prefetch)."""
  seg_BT, kv_seg_BS, pos_BT = masks
  B, T = seg_BT.shape
  S = kv_seg_BS.shape[1]
  qmax_BN = jnp.max(pos_BT.reshape(B, T // bq, bq), axis=-1)
  return (
    lax.broadcast_in_dim(seg_BT, (B, T, NUM_LANES), (0, 1)),
    lax.broadcast_in_dim(kv_seg_BS, (B, NUM_SUBLANES, S), (0, 2)),
    lax.broadcast_in_dim(pos_BT, (B, T, NUM_LANES), (0, 1)),
    qmax_BN,
  )


def _pairs_run(T, S, bq, bk, natural):
  """Number of (query, key) pairs in the blocks computed: the causal half (block-granular)."""
  if natural:
    return sum(min(S // bk, ((i + 1) * bq - 1) // bk + 1) for i in range(T // bq)) * bq * bk
  # A load-balanced share (chunks r and 2c-1-r of g = T/2 rows each): (2c + 1) g^2 = T*S/2 + T^2/4.
  return T * S // 2 + T * T // 4


def _cost(arrays, B, H, pairs, flops_per_pair: int, exps_per_pair: int):
  """XLA cannot see inside a kernel: its cost analysis (FLOPs, AOT reports, scheduling) reads this."""
  nbytes = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)
  n = B * H * pairs
  return pl.CostEstimate(flops=n * flops_per_pair, transcendentals=n * exps_per_pair, bytes_accessed=nbytes)


def _compiler_params(*semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics)


# ---------------------------------------------------------------------------------------- forward
def _fwd_kernel(
  qmax_ref, q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, qpos_ref, o_ref, lse_ref, mx_ref, m_sc, l_sc, acc_sc, *, params
):
  bk = params.block_k
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  Dv = acc_sc.shape[-1]

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(_needed(qmax_ref, b, i, j, bk))
  def _step():
    s = _logits(q_ref, k_ref, qseg_ref, kvseg_ref, qpos_ref, j, params)  # [bq, bk]
    m_prev = m_sc[...]  # [bq, 128]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # A row with no valid key so far keeps m = -inf; shift it by 0 so exp() sees -inf - 0, never NaN.
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - _lanes(m_safe, bk))
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    pv = _dot(p.astype(v_ref.dtype), v_ref[...])
    acc_sc[...] = _lanes(alpha, Dv) * acc_sc[...] + pv
    m_sc[...] = m_next

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    m, l = m_sc[...], l_sc[...]
    empty = l == 0.0  # padding rows: no valid key at all
    o_ref[...] = (acc_sc[...] / _lanes(jnp.where(empty, 1.0, l), Dv)).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))
    mx_ref[...] = jnp.broadcast_to(jnp.max(m, axis=0, keepdims=True), mx_ref.shape)


def _forward(q, k, v, masks, params):
  """q [B,H,T,Kq], k [B,H,S,Kq], v [B,H,S,V] -> (o [B,H,T,V], lse [B,H,T], max_logit [H])."""
  B, H, T, Kq = q.shape
  S, Dv = k.shape[2], v.shape[-1]
  bq, bk = params.block_q, params.block_k
  nq, nk = T // bq, S // bk
  qseg, kvseg, qpos, qmax = _mask_tiles(masks, bq)

  def kv_block(b, i, j, qmax_ref):  # skipped blocks re-use the last needed one: no DMA
    return _last_kv_block(qmax_ref, b, i, j, bk)

  in_specs = [
    pl.BlockSpec((None, None, bq, Kq), lambda b, h, i, j, m: (b, h, i, 0)),
    pl.BlockSpec((None, None, bk, Kq), lambda b, h, i, j, m: (b, h, kv_block(b, i, j, m), 0)),
    pl.BlockSpec((None, None, bk, Dv), lambda b, h, i, j, m: (b, h, kv_block(b, i, j, m), 0)),
    pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, j, m: (b, i, 0)),
    pl.BlockSpec((None, NUM_SUBLANES, bk), lambda b, h, i, j, m: (b, 0, kv_block(b, i, j, m))),
    pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, j, m: (b, i, 0)),
  ]
  out_specs = [
    pl.BlockSpec((None, None, bq, Dv), lambda b, h, i, j, m: (b, h, i, 0)),
    pl.BlockSpec((None, None, bq, NUM_LANES), lambda b, h, i, j, m: (b, h, i, 0)),
    pl.BlockSpec((None, None, NUM_SUBLANES, NUM_LANES), lambda b, h, i, j, m: (b, h, i, 0)),
  ]
  out_shape = [
    jax.ShapeDtypeStruct((B, H, T, Dv), v.dtype),
    jax.ShapeDtypeStruct((B, H, T, NUM_LANES), jnp.float32),
    jax.ShapeDtypeStruct((B, H, nq * NUM_SUBLANES, NUM_LANES), jnp.float32),
  ]
  pairs = _pairs_run(T, S, bq, bk, params.natural)
  o, lse, mx = pl.pallas_call(
    functools.partial(_fwd_kernel, params=params),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(B, H, nq, nk),
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=[
        pltpu.VMEM((bq, NUM_LANES), jnp.float32),
        pltpu.VMEM((bq, NUM_LANES), jnp.float32),
        pltpu.VMEM((bq, Dv), jnp.float32),
      ],
    ),
    out_shape=out_shape,
    compiler_params=_compiler_params("parallel", "parallel", "parallel", "arbitrary"),
    cost_estimate=_cost([q, k, v, *out_shape], B, H, pairs, 2 * (Kq + Dv), 1),
    interpret=params.interpret,
    name="k2jax_flash_mla_fwd",
  )(qmax, q, k, v, qseg, kvseg, qpos)
  return o, lse[..., 0], jnp.max(mx, axis=(0, 2, 3))


# --------------------------------------------------------------------------------------- backward
def _dq_kernel(
  qmax_ref, q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, qpos_ref, lse_ref, di_ref, do_ref, dq_ref, dq_sc, *, params
):
  bk = params.block_k
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(_needed(qmax_ref, b, i, j, bk))
  def _step():
    s = _logits(q_ref, k_ref, qseg_ref, kvseg_ref, qpos_ref, j, params)
    p = jnp.exp(s - _lanes(lse_ref[...], bk))
    dp = _dot(do_ref[...], v_ref[...], _TRANS_B)
    ds = p * (dp - _lanes(di_ref[...], bk))
    dq_sc[...] += _dot(ds.astype(k_ref.dtype), k_ref[...])

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_sc[...] * params.scale).astype(dq_ref.dtype)


def _dkv_kernel(
  qmax_ref,
  q_ref,
  k_ref,
  v_ref,
  qseg_ref,
  kvseg_ref,
  qpos_ref,
  lse_ref,
  di_ref,
  do_ref,
  dk_ref,
  dv_ref,
  dk_sc,
  dv_sc,
  *,
  params,
):
  bk = params.block_k
  b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)  # kv block outer, q blocks sequential

  @pl.when(i == 0)
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when(_needed(qmax_ref, b, i, j, bk))
  def _step():
    s = _logits(q_ref, k_ref, qseg_ref, kvseg_ref, qpos_ref, j, params)
    p = jnp.exp(s - _lanes(lse_ref[...], bk))  # [bq, bk]
    do = do_ref[...]
    dv_sc[...] += _dot(p.T.astype(do.dtype), do)
    dp = _dot(do, v_ref[...], _TRANS_B)
    ds = p * (dp - _lanes(di_ref[...], bk))
    dk_sc[...] += _dot(ds.T.astype(q_ref.dtype), q_ref[...])

  @pl.when(i == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = (dk_sc[...] * params.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _backward(q, k, v, masks, do, lse_BHT, di_BHT, params):
  B, H, T, Kq = q.shape
  S, Dv = k.shape[2], v.shape[-1]
  bq, bk = params.block_q, params.block_k
  nq, nk = T // bq, S // bk
  qseg, kvseg, qpos, qmax = _mask_tiles(masks, bq)
  lse, di = (lax.broadcast_in_dim(x, (B, H, T, NUM_LANES), (0, 1, 2)) for x in (lse_BHT, di_BHT))
  args = (qmax, q, k, v, qseg, kvseg, qpos, lse, di, do)

  def specs(q_block, kv_block):
    """In-specs for `args` given index maps (b, grid ids, qmax ref) -> q block / kv block."""
    qi = lambda b, h, x, y, m: (b, h, q_block(b, x, y, m), 0)
    ki = lambda b, h, x, y, m: (b, h, kv_block(b, x, y, m), 0)
    return [
      pl.BlockSpec((None, None, bq, Kq), qi),
      pl.BlockSpec((None, None, bk, Kq), ki),
      pl.BlockSpec((None, None, bk, Dv), ki),
      pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, x, y, m: (b, q_block(b, x, y, m), 0)),
      pl.BlockSpec((None, NUM_SUBLANES, bk), lambda b, h, x, y, m: (b, 0, kv_block(b, x, y, m))),
      pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, x, y, m: (b, q_block(b, x, y, m), 0)),
      pl.BlockSpec((None, None, bq, NUM_LANES), qi),
      pl.BlockSpec((None, None, bq, NUM_LANES), qi),
      pl.BlockSpec((None, None, bq, Dv), qi),
    ]

  pairs = _pairs_run(T, S, bq, bk, params.natural)
  # dq: grid (b, h, q block i, kv block j); kv blocks past the causal limit clamp to the last needed one.
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, params=params),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(B, H, nq, nk),
      in_specs=specs(lambda b, i, j, m: i, lambda b, i, j, m: _last_kv_block(m, b, i, j, bk)),
      out_specs=pl.BlockSpec((None, None, bq, Kq), lambda b, h, i, j, m: (b, h, i, 0)),
      scratch_shapes=[pltpu.VMEM((bq, Kq), jnp.float32)],
    ),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=_compiler_params("parallel", "parallel", "parallel", "arbitrary"),
    cost_estimate=_cost([q, k, v, do, q], B, H, pairs, 2 * (2 * Kq + Dv), 1),
    interpret=params.interpret,
    name="k2jax_flash_mla_dq",
  )(*args)

  # dk, dv: grid (b, h, kv block j, q block i). In natural order the q blocks before the diagonal clamp to
  # the first needed one (no DMA); a load-balanced share's q blocks are not monotone, so they are fetched
  # and only their compute is skipped.
  if params.natural:
    q_of = lambda b, j, i, m: _first_q_block(j, i, bq, bk)  # noqa: E731
  else:
    q_of = lambda b, j, i, m: i  # noqa: E731
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, params=params),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(B, H, nk, nq),
      in_specs=specs(q_of, lambda b, j, i, m: j),
      out_specs=[
        pl.BlockSpec((None, None, bk, Kq), lambda b, h, j, i, m: (b, h, j, 0)),
        pl.BlockSpec((None, None, bk, Dv), lambda b, h, j, i, m: (b, h, j, 0)),
      ],
      scratch_shapes=[pltpu.VMEM((bk, Kq), jnp.float32), pltpu.VMEM((bk, Dv), jnp.float32)],
    ),
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    compiler_params=_compiler_params("parallel", "parallel", "parallel", "arbitrary"),
    cost_estimate=_cost([q, k, v, do, k, v], B, H, pairs, 2 * (2 * Kq + 2 * Dv), 1),
    interpret=params.interpret,
    name="k2jax_flash_mla_dkv",
  )(*args)
  return dq, dk, dv


# ------------------------------------------------------------------- plain-JAX fallback (impl="xla")
def _xla_blocks(q, k, v, masks, params):
  """(kv blocks as scan inputs, per-block masked-logits function) shared by forward and backward."""
  seg_BT, kv_seg_BS, pos_BT = masks
  B, H, S, Kq = k.shape
  bk = params.block_k
  nk = S // bk
  blocks = (
    k.reshape(B, H, nk, bk, Kq).swapaxes(0, 2),
    v.reshape(B, H, nk, bk, v.shape[-1]).swapaxes(0, 2),
    kv_seg_BS.reshape(B, nk, bk).swapaxes(0, 1),
    jnp.arange(nk),
  )

  def logits(k_blk, seg_k, j):  # k_blk [H, B, bk, Kq] (scan slices axis 0 of the swapped layout)
    s = jnp.einsum("bhtk,hbsk->bhts", q, k_blk, preferred_element_type=jnp.float32) * params.scale
    cols = j * bk + jnp.arange(bk)
    valid = (
      (seg_BT[:, :, None] == seg_k[:, None, :]) & (seg_BT[:, :, None] > 0) & (cols[None, None] <= pos_BT[..., None])
    )
    return jnp.where(valid[:, None], s, -jnp.inf)

  return blocks, logits


def _xla_forward(q, k, v, masks, params):
  B, H, T, _ = q.shape
  blocks, logits = _xla_blocks(q, k, v, masks, params)

  def step(carry, blk):
    m, l, acc = carry
    k_blk, v_blk, seg_k, j = blk
    s = logits(k_blk, seg_k, j)
    m_next = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    pv = jnp.einsum("bhts,hbsv->bhtv", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
    return (m_next, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv), None

  init = (
    jnp.full((B, H, T), -jnp.inf, jnp.float32),
    jnp.zeros((B, H, T), jnp.float32),
    jnp.zeros((B, H, T, v.shape[-1]), jnp.float32),
  )
  (m, l, acc), _ = lax.scan(step, init, blocks)
  empty = l == 0.0
  o = (acc / jnp.where(empty, 1.0, l)[..., None]).astype(v.dtype)
  lse = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))
  return o, lse, jnp.max(m, axis=(0, 2))


def _xla_backward(q, k, v, masks, do, lse_BHT, di_BHT, params):
  B, H, S, _ = k.shape
  blocks, logits = _xla_blocks(q, k, v, masks, params)

  def step(dq, blk):
    k_blk, v_blk, seg_k, j = blk
    p = jnp.exp(logits(k_blk, seg_k, j) - lse_BHT[..., None])  # [B, H, T, bk]
    dv_blk = jnp.einsum("bhts,bhtv->hbsv", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bhtv,hbsv->bhts", do, v_blk, preferred_element_type=jnp.float32)
    ds = p * (dp - di_BHT[..., None])
    dk_blk = jnp.einsum("bhts,bhtk->hbsk", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
    dq = dq + jnp.einsum("bhts,hbsk->bhtk", ds.astype(k.dtype), k_blk, preferred_element_type=jnp.float32)
    return dq, (dk_blk, dv_blk)

  dq, (dk_blocks, dv_blocks) = lax.scan(step, jnp.zeros(q.shape, jnp.float32), blocks)
  nk = S // params.block_k

  def unblock(x):  # [nk, H, B, bk, D] -> [B, H, S, D]
    return x.swapaxes(0, 2).reshape(B, H, nk * params.block_k, x.shape[-1])

  s = params.scale
  return (dq * s).astype(q.dtype), (unblock(dk_blocks) * s).astype(k.dtype), unblock(dv_blocks).astype(v.dtype)


_FORWARD = {"pallas": _forward, "xla": _xla_forward}
_BACKWARD = {"pallas": _backward, "xla": _xla_backward}
