"""INT4 weight-only quantization of the routed experts on Kimi K2 Thinking's grid, and its fake-quant for QAT.

The grid is the one the Kimi-K2-Thinking release stores (../shared/reference/int4-qat.md §2-3): symmetric int4 in
groups of GROUP = 32 consecutive elements along a weight's input (contraction) dimension, one bf16 scale per group

  a = max |w| over the group,   s = bf16(fp32(a) / 7),   q = clamp(round_half_even(w / s), -7, 7),

with the quotient w / s taken in the weight's dtype and s = 0 (an all-zero group) giving q = 0; dequantization is
fp32(q) * fp32(s), exact in float32 (a 3-bit code times an 8-bit mantissa), cast to the wanted dtype. Code -8 is
never produced. Stored k2jax expert kernels are [..., in, out] (w_EDF for gate/up, w_EFD for down, an optional
leading layer axis when layers are scanned), so groups run along axis -2. An input dimension that is not a multiple
of 32 ends in a ragged last group: it is padded with zeros (which leave its amax alone) and cut back.

`fake_quant(w)` is `dequantize(*quantize(w), w.dtype)` in the forward pass with the identity (straight-through)
gradient to the full-precision master weights, as slime and SkyRL train Kimi's experts. It is applied to the
expert weight arrays themselves, before whichever grouped GEMM runs (moe_cpu's kernel, tokamax, ragged_dot, the
expert-parallel shard_map), so every MoE path sees the same fake-quantized weights. Under QAT `K2Model` leaves the
experts out of the layer stack's bf16 compute copy (`transformer.compute_copy`), so the grid is computed from the
float32 masters, as an export quantizes them, not from a bf16 copy (which can round a scale or a code differently).

Why not qwix (0.1.8, which MaxText uses): its QAT provider intercepts `jax.lax.ragged_dot` through
`qwix/_src/core/ragged_dot_qt.py`, which quantizes the expert weights with `channelwise_axes=[2]` (one scale per
expert and output column over the whole contraction axis; no `tile_size` reaches it, so no groups of 32), always
quantizes the activations too (weight-only is not expressible there), and its symmetric int4 bound is
`iinfo(int4).max + 0.5` = 7.5 with codes in [-8, 7] (`core/numerics.get_symmetric_bound`). Every one of the three
would move the weights off the grid the release stores, and the Pallas GEMMs (tokamax, moe_cpu) are not
intercepted at all. Weight-space fake-quant is one elementwise op per expert array and covers them all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BITS = 4
GROUP = 32  # elements per scale along the input dimension (the release's group_size)
QMAX = 7  # codes in [-QMAX, QMAX]: the release's amax/7 grid, not compressed-tensors' or qwix's amax/7.5
SCALE_DTYPE = jnp.bfloat16  # the release stores bf16 scales


def num_groups(n_in: int) -> int:
  return -(-n_in // GROUP)


def _grouped(w_IO):
  """[..., in, out] -> [..., G, GROUP, out], zero-padding a ragged last group."""
  n_in = w_IO.shape[-2]
  pad = num_groups(n_in) * GROUP - n_in
  if pad:
    w_IO = jnp.pad(w_IO, [(0, 0)] * (w_IO.ndim - 2) + [(0, pad), (0, 0)])
  return w_IO.reshape(*w_IO.shape[:-2], num_groups(n_in), GROUP, w_IO.shape[-1])


def quantize(w_IO):
  """[..., in, out] float -> (codes int8 [..., in, out] in [-7, 7], scales bf16 [..., ceil(in/32), out])."""
  n_in = w_IO.shape[-2]
  w_GKO = _grouped(w_IO)
  amax_GO = jnp.max(jnp.abs(w_GKO), axis=-2).astype(jnp.float32)
  scale_GO = (amax_GO / QMAX).astype(SCALE_DTYPE)
  # The quotient in the weight's dtype (compressed-tensors' `quantize` does the same); a zero scale only
  # occurs for an all-zero group, whose codes are 0 whatever the divisor.
  divisor_GO = jnp.where(scale_GO == 0, jnp.ones_like(scale_GO), scale_GO).astype(w_IO.dtype)
  q_GKO = jnp.clip(jnp.round(w_GKO / divisor_GO[..., None, :]), -QMAX, QMAX).astype(jnp.int8)
  q_IO = q_GKO.reshape(*q_GKO.shape[:-3], -1, q_GKO.shape[-1])[..., :n_in, :]
  return q_IO, scale_GO


def dequantize(q_IO, scale_GO, dtype=jnp.float32):
  """(codes [..., in, out], scales [..., ceil(in/32), out]) -> weights [..., in, out] in `dtype`:
  fp32(q) * fp32(s), exact in float32, then one rounding to `dtype`."""
  n_in = q_IO.shape[-2]
  if scale_GO.shape[-2] != num_groups(n_in) or scale_GO.shape[-1] != q_IO.shape[-1]:
    raise ValueError(
      f"int4 scales {tuple(scale_GO.shape)} do not fit codes {tuple(q_IO.shape)}: expected "
      f"[..., {num_groups(n_in)}, {q_IO.shape[-1]}] (one scale per {GROUP} inputs per output)"
    )
  s_IO = jnp.repeat(scale_GO.astype(jnp.float32), GROUP, axis=-2)[..., :n_in, :]
  return (q_IO.astype(jnp.float32) * s_IO).astype(dtype)


@jax.custom_vjp
def fake_quant(w_IO):
  """The weights as the INT4 release would serve them (`dequantize(*quantize(w), w.dtype)`), with the
  straight-through gradient: d loss / d w := d loss / d fake_quant(w)."""
  return dequantize(*quantize(w_IO), w_IO.dtype)


def _fake_quant_fwd(w_IO):
  return fake_quant(w_IO), None


def _fake_quant_bwd(_, g_IO):
  return (g_IO,)


fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


# ------------------------------------------------------------------------------ serving packed weights
# An engine serving INT4 experts (`K2Config.expert_storage='int4'`) holds per expert weight its codes two to a
# byte along the input axis (uint8 [..., ceil(in/2), out]: element 2i in the low nibble, 2i+1 in the high one,
# each as q + 8) and its bf16 scales [..., ceil(in/32), out]; a layer dequantizes its own experts when it runs.
PACKED = "_int4"  # served leaf names: w_gate -> w_gate_int4 (codes) and w_gate_scale (scales)
SCALE = "_scale"
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def pack_codes(q_IO):
  """int8 codes [..., in, out] -> uint8 [..., ceil(in/2), out], two per byte along the input axis."""
  if q_IO.shape[-2] % 2:
    q_IO = jnp.pad(q_IO, [(0, 0)] * (q_IO.ndim - 2) + [(0, 1), (0, 0)])
  nib = (q_IO.astype(jnp.int32) + 8).astype(jnp.uint8)
  return nib[..., 0::2, :] | (nib[..., 1::2, :] << 4)


def unpack_codes(p_HO, n_in: int):
  """uint8 [..., ceil(in/2), out] -> int8 codes [..., n_in, out]."""
  lo = (p_HO & 0xF).astype(jnp.int8) - 8
  hi = (p_HO >> 4).astype(jnp.int8) - 8
  q = jnp.stack([lo, hi], axis=-2)  # [..., H, 2, out]
  return q.reshape(*p_HO.shape[:-2], -1, p_HO.shape[-1])[..., :n_in, :]


def to_served(w_IO):
  """(packed codes, scales) an INT4-serving engine holds for float expert weights `w` (the QAT grid)."""
  q_IO, scale_GO = quantize(w_IO)
  return pack_codes(q_IO), scale_GO


def served_weight(p_HO, scale_GO, n_in: int, dtype):
  """The weights [..., n_in, out] in `dtype` of served (packed codes, scales): what the QAT forward sees."""
  return dequantize(unpack_codes(p_HO, n_in), scale_GO, dtype)


def served_params(params: dict, abstract: dict) -> dict:
  """`params` (a pure state dict) with every float routed-expert triplet that `abstract` (the served state)
  holds as INT4 replaced by its packed codes and scales, quantized where the weights are (jit)."""
  if not isinstance(params, dict) or not isinstance(abstract, dict):
    return params
  out = {k: served_params(v, abstract[k]) if k in abstract else v for k, v in params.items()}
  if all(w in params for w in EXPERT_WEIGHTS) and all(w + PACKED in abstract for w in EXPERT_WEIGHTS):
    for w in EXPERT_WEIGHTS:
      x = out.pop(w)
      out[w + PACKED], out[w + SCALE] = _to_served_jit(x)
  return out


_to_served_jit = jax.jit(to_served)
