"""Rotary position embedding with YaRN scaling, as Hugging Face `modeling_rope_utils` computes it.

Frequencies are computed once on the host in float32 (the same op order as transformers, so logits
match to float32 rounding). `rope_interleave=True` (the published K2 layout) rotates adjacent pairs
(x0, x1), (x2, x3), ... and, like HF, returns the rotated dims in half-split order; q and k get the same
permutation, so their dot product is unchanged.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from k2jax.model.config import K2Config


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN attention temperature: 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: K2Config) -> float:
  """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 when YaRN sets mscale_all_dim (HF)."""
  scale = cfg.qk_head_dim**-0.5
  rope = cfg.rope
  if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
    m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
    scale = scale * m * m
  return scale


def inv_freq_and_attention_factor(cfg: K2Config) -> tuple[np.ndarray, float]:
  """Per-pair inverse frequencies [Kr/2] (float32) and the cos/sin multiplier."""
  dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
  exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
  pos_freqs = np.power(np.float32(base), exponents).astype(np.float32)
  rope = cfg.rope
  if rope["rope_type"] == "default":
    return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
  factor = rope.get("factor")
  orig = rope["original_max_position_embeddings"]
  if factor is None:
    factor = cfg.max_position_embeddings / orig
  attention_factor = rope.get("attention_factor")
  if attention_factor is None:
    ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if ms and ms_all:
      attention_factor = yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all)
    else:
      attention_factor = yarn_mscale(factor)
  beta_fast = rope.get("beta_fast") or 32
  beta_slow = rope.get("beta_slow") or 1

  def correction_dim(rotations):
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if rope.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # HF: avoid a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
  extrapolation_factor = np.float32(1) - ramp
  inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
  inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
  inv = inv_inter * (np.float32(1) - extrapolation_factor) + inv_extra * extrapolation_factor
  return inv.astype(np.float32), float(attention_factor)


def rope_cos_sin(cfg: K2Config, positions_BT: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """cos, sin [B, T, Kr/2] in float32 for integer positions."""
  inv_freq, attn_factor = inv_freq_and_attention_factor(cfg)
  angles = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(angles) * attn_factor, jnp.sin(angles) * attn_factor


def apply_rope(x_BTHK: jnp.ndarray, cos_BTk: jnp.ndarray, sin_BTk: jnp.ndarray, interleave: bool) -> jnp.ndarray:
  """Rotate the last axis of x [B, T, H, Kr] by the given angles; output in half-split order."""
  cos, sin = cos_BTk[:, :, None, :], sin_BTk[:, :, None, :]
  xf = x_BTHK.astype(jnp.float32)
  if interleave:
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
  else:
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHK.dtype)
