"""MLA attention on GPU: tokamax's Pallas-Triton flash attention, with QK-Clip's max logit from its residuals.

Same contract as `flash_attention.flash_attention`: causal, packed-segment attention (query t attends key s
iff s <= t, seg[t] == seg[s] > 0), q/k head dim Kq = nope + rope (MLA: 192), v head dim V (MLA: 128),
returning (out [B,T,H,V], max_logit [H] float32). Rows with no valid key output exactly 0; a head with
no valid position anywhere has max logit -inf.

Why tokamax's Triton kernel (`tokamax.dot_product_attention(implementation="triton")`, 0.0.12):
- The max is exact and comes out of the kernel: `return_residuals=True` returns the running max m and
  denominator l per (batch, head, query) that its online softmax keeps anyway. m is the max of the
  kernel's own softmax input, `logits_scale * q.k` accumulated in float32 (the kernel multiplies q by the
  scale in q's dtype before the dot: for bfloat16 inputs that rounding is in the logits the softmax sees), so per head max_{b,t valid} m[b,h,t] is QK-Clip's max logit with no second pass
  over the scores. jax's Pallas GPU attention returns only the logsumexp (the max within ln S of it);
  cuDNN through `jax.nn.dot_product_attention` returns no statistic at all, and jax 0.10.2 rejects MLA's
  dims there before cuDNN sees them ("value shape should be [2, 128, 4, 192]: but got (2, 128, 4, 128)",
  checked by lowering for cuda on this host).
- Masks without a [B, H, T, S] tensor: packed segments become tokamax's `Mask(k_start=..., is_causal=True)`,
  one int per query (the first key of its segment), which the forward kernel reads blockwise and uses to
  skip whole kv blocks before the segment. Its backward kernel expands that mask to a [B, 1, T, S] bool
  (`Mask.as_array`, B*T*S bytes, broadcast over heads) and reads it blockwise.
- It lowers for CUDA from a CPU host (Triton kernels do; Mosaic-GPU ones need a GPU), so the GPU program
  is checked in CPU tests; it ships forward and backward kernels with one VJP; it is the same library the
  routed experts use (`moe_gemm`), so no second GPU dependency.
- Its speed has not been measured on a GPU yet (docs/results.md): `bench/gpu.py` measures it there.

Limits, each a clear error naming the fallback (`attention='flash_xla'`, the plain-JAX blocked kernel):
- Segment ids must form contiguous runs per row (what `k2jax.data.packing` emits: ids 1..n in order, 0
  = padding). A segment id that reappears after another one would attend only its last run: k_start
  cannot express a gap. This is a data precondition (not checkable at trace time without a pass).
- float32, bfloat16 or float16 inputs; q/k and v head dims <= 256 (the kernel pads each to a power of
  two: 192 runs as 256).
- A GPU of compute capability >= 8.0 (tokamax's Triton support). A slower GPU is refused, not served
  by a slow path.
Padding rows (segment 0) get k_start = T (no key at all); the kernel then averages over its masked row,
so their output is multiplied by 0 here, which also zeros their gradients.

On a CPU host `implementation="xla"` is tokamax's reference (it materialises [B, H, T, S] logits: tests
only); tokamax's Triton kernels do not run in Pallas interpret mode (their block refs read program ids
inside loops, which the interpreter does not lower), so CPU tests check the reference numerically and the
Triton path by lowering it for CUDA under `sharding.target_platform("gpu")`, whose hook turns tokamax's
own device check off (`tokamax.config.cross_compile`) for that block only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from k2jax import sharding as sharding_lib
from k2jax.model import moe_gemm  # noqa: F401  (registers tokamax's cross-compile hook)
from k2jax.model.moe_gemm import MoEGemmError, import_tokamax

IMPLEMENTATIONS = ("triton", "xla")  # tokamax's Triton kernel; its XLA reference (tests on CPU)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
MIN_COMPUTE_CAPABILITY = 8.0
FALLBACK = "attention='flash_xla'"


class GpuAttentionError(ValueError):
  """The GPU attention kernel cannot serve this call (device, dtype, shape, install)."""


def tokamax_attention(
  q_BTHK,
  k_BTHK,
  v_BTHV,
  segment_ids_BT,
  *,
  scale,
  implementation="triton",
  kv_segment_ids_BS=None,
  q_positions_BT=None,
):
  """Causal packed-segment attention through tokamax: (out [B,T,H,V] in v's dtype, max_logit [H] float32).

  q, k: [B, T, H, Kq]; v: [B, T, H, V]; segment_ids: [B, T] int, contiguous runs (0 = padding).
  logits = scale * q.k. Differentiable in q, k, v; the max logit is a statistic (stop_gradient).
  Context parallelism: k, v [B, S, ...] are the whole gathered sequence with segments kv_segment_ids [B, S]
  and query t sits at key index q_positions[b, t]: its mask is the key range [its segment's first key,
  its position] (tokamax's k_start / k_end, which the kernel also uses to skip kv blocks).
  """
  seg_BT = segment_ids_BT.astype(jnp.int32)
  if q_positions_BT is None:
    _check(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT, implementation)
    mask_kw = {"k_start": segment_starts(seg_BT)[:, None, :], "is_causal": True}
  else:
    S = k_BTHK.shape[1]
    _check(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT, implementation, S=S)
    pos_BT = q_positions_BT.astype(jnp.int32)
    start_BT = jnp.take_along_axis(segment_starts(kv_segment_ids_BS.astype(jnp.int32)), pos_BT, axis=1)
    start_BT = jnp.where(seg_BT > 0, start_BT, S)
    mask_kw = {"k_start": start_BT[:, None, :], "k_end": (pos_BT + 1)[:, None, :]}
  op, mask_cls = _tokamax_op(implementation)
  mask = mask_cls(**mask_kw)
  out_BTHV, (m_BHT, _) = op(q_BTHK, k_BTHK, v_BTHV, mask=mask, logits_scale=float(scale), return_residuals=True)
  valid_BT = seg_BT > 0
  out_BTHV = jnp.where(valid_BT[:, :, None, None], out_BTHV, 0).astype(v_BTHV.dtype)
  max_logit_H = jnp.max(jnp.where(valid_BT[:, None, :], m_BHT.astype(jnp.float32), -jnp.inf), axis=(0, 2))
  return out_BTHV, lax.stop_gradient(max_logit_H)


def segment_starts(segment_ids_BT):
  """k_start [B, T]: the first key query t may attend (its segment's first position); T for padding.

  With causal masking, keys [k_start[t], t] are exactly `mla.attention_mask`'s row t when every segment
  id is one contiguous run of its row.
  """
  B, T = segment_ids_BT.shape
  pos_T = jnp.arange(T, dtype=jnp.int32)
  new_run_BT = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
  start_BT = lax.cummax(jnp.where(new_run_BT, pos_T, 0), axis=1)
  return jnp.where(segment_ids_BT > 0, start_BT, T)


def check_device():
  """Refuse a GPU without the kernel's compute capability (skipped while cross-compiling from a CPU host)."""
  if sharding_lib.cross_compiling():
    return
  device = jax.devices()[0]
  if device.platform != "gpu":
    raise GpuAttentionError(
      f"the Triton attention kernel runs on a GPU, this process has {device.platform} devices; "
      f"use {FALLBACK} or 'einsum' (or sharding.target_platform('gpu') to cross-compile)"
    )
  cc = getattr(device, "compute_capability", None)
  if cc is not None and float(cc) < MIN_COMPUTE_CAPABILITY:
    raise GpuAttentionError(
      f"the Triton attention kernel needs compute capability >= {MIN_COMPUTE_CAPABILITY}, "
      f"{device.device_kind} has {cc}; use {FALLBACK}"
    )


def _check(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT, implementation, S=None):
  if implementation not in IMPLEMENTATIONS:
    raise GpuAttentionError(f"tokamax_attention: implementation one of {IMPLEMENTATIONS}, got {implementation!r}")
  B, T, H, Kq = q_BTHK.shape
  S = T if S is None else S
  if k_BTHK.shape != (B, S, H, Kq):
    raise GpuAttentionError(f"tokamax_attention: k has shape {k_BTHK.shape}, expected {(B, S, H, Kq)}")
  if v_BTHV.shape[:3] != (B, S, H):
    raise GpuAttentionError(f"tokamax_attention: v has shape {v_BTHV.shape}, expected [{B}, {S}, {H}, V]")
  if segment_ids_BT.shape != (B, T) or not jnp.issubdtype(segment_ids_BT.dtype, jnp.integer):
    raise GpuAttentionError(
      f"tokamax_attention: segment_ids must be an integer [{B}, {T}] array, got "
      f"{segment_ids_BT.dtype}{list(segment_ids_BT.shape)}"
    )
  for name, x in (("q", q_BTHK), ("k", k_BTHK), ("v", v_BTHV)):
    if x.dtype not in DTYPES:
      raise GpuAttentionError(
        f"the Triton attention kernel takes {[jnp.dtype(d).name for d in DTYPES]}, {name} is {x.dtype}; use {FALLBACK}"
      )
  for name, d in (("q/k head dim", Kq), ("v head dim", v_BTHV.shape[-1])):
    if d > MAX_HEAD_DIM:
      raise GpuAttentionError(
        f"the Triton attention kernel takes head dims <= {MAX_HEAD_DIM}, {name} is {d}; use {FALLBACK}"
      )
  if implementation == "triton":
    check_device()


@functools.cache
def _tokamax_op(implementation):
  """(tokamax's attention op for `implementation`, its Mask class). The public `dot_product_attention`
  takes neither a Mask with k_start nor `return_residuals`, so this builds the op objects it dispatches
  to. The Triton op keeps the stable (max-subtracting) softmax explicitly: only then is its residual m
  the running max (with `use_stable_softmax=False` it would be 0)."""
  try:
    import_tokamax()
  except MoEGemmError as e:
    raise GpuAttentionError(f"{e}; or use {FALLBACK}") from e
  from tokamax._src.ops.attention import base

  if implementation == "xla":
    return base.DotProductAttention(), base.Mask
  from tokamax._src.ops.attention import pallas_triton

  return pallas_triton.PallasTritonFlashAttention(use_stable_softmax=True), base.Mask
