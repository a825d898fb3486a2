"""Multi-head Latent Attention (DeepSeek-V3 / Kimi K2), with packed-sequence masking.

q = W_qb · RMSNorm(W_qa x)                 -> per head [q_nope (Kn) | q_rope (Kr)]
[c_kv | k_rope] = W_kva x                  -> latent (Rkv) and ONE shared rope key (Kr)
[k_nope | v] = W_kvb · RMSNorm(c_kv)       -> per head (Kn, V)
logits = scale · (q_nope·k_nope + rope(q_rope)·rope(k_rope))

Besides the output, the layer returns the per-head max pre-softmax logit over valid (unmasked)
positions: QK-Clip (K2 §2.1) rescales exactly the heads whose max exceeds tau.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k2jax.model import rope as rope_lib
from k2jax.model.config import K2Config
from k2jax.model.layers import RMSNorm, make_param

# HF builds q_a_layernorm and kv_a_layernorm with the default eps, not config.rms_norm_eps.
LORA_NORM_EPS = 1e-6
_NEG = -1e30  # finite "minus infinity": fully masked rows (padding) stay NaN-free


class MLA(nnx.Module):
  def __init__(self, cfg: K2Config, *, stack: int | None, rngs: nnx.Rngs):
    D, H = cfg.hidden_size, cfg.num_attention_heads
    Kn, Kr, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    Rq, Rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    std, dt = cfg.initializer_range, jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.scale = rope_lib.softmax_scale(cfg)
    self.w_q_a = make_param(rngs, (D, Rq), ("embed", "q_lora"), stack=stack, std=std, dtype=dt)
    self.q_norm = RMSNorm(Rq, "q_lora", eps=LORA_NORM_EPS, stack=stack, rngs=rngs, dtype=dt)
    self.w_q_b = make_param(rngs, (Rq, H * (Kn + Kr)), ("q_lora", "q_heads"), stack=stack, std=std, dtype=dt)
    self.w_kv_a = make_param(rngs, (D, Rkv + Kr), ("embed", "kv_lora_rope"), stack=stack, std=std, dtype=dt)
    self.kv_norm = RMSNorm(Rkv, "kv_lora", eps=LORA_NORM_EPS, stack=stack, rngs=rngs, dtype=dt)
    self.w_kv_b = make_param(rngs, (Rkv, H * (Kn + V)), ("kv_lora", "kv_heads"), stack=stack, std=std, dtype=dt)
    self.w_o = make_param(rngs, (H * V, D), ("o_heads", "embed"), stack=stack, std=std, dtype=dt)

  def __call__(self, x_BTD, cos_BTk, sin_BTk, valid_BTS):
    """x [B,T,D]; cos/sin [B,T,Kr/2]; valid [B,T,S] bool (query t may attend key s).

    Returns (out [B,T,D], max_logit [H] float32).
    """
    cfg, dt = self.cfg, x_BTD.dtype
    B, T, _ = x_BTD.shape
    H, Kn, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    q_nope_BTHK, q_rope_BTHK = self.queries(x_BTD, cos_BTk, sin_BTk)
    c_BTR, k_rope_BSK = self.latent_and_rope_key(x_BTD, cos_BTk, sin_BTk)
    kv_BTHK = (c_BTR @ self.w_kv_b[...].astype(dt)).reshape(B, T, H, Kn + V)
    k_nope_BSHK, v_BSHV = kv_BTHK[..., :Kn], kv_BTHK[..., Kn:]
    logits_BHTS = (
      jnp.einsum("bthk,bshk->bhts", q_nope_BTHK, k_nope_BSHK, preferred_element_type=jnp.float32)
      + jnp.einsum("bthk,bsk->bhts", q_rope_BTHK, k_rope_BSK, preferred_element_type=jnp.float32)
    ) * self.scale
    valid_B1TS = valid_BTS[:, None]
    max_logit_H = jnp.max(jnp.where(valid_B1TS, logits_BHTS, -jnp.inf), axis=(0, 2, 3))
    probs_BHTS = jax.nn.softmax(jnp.where(valid_B1TS, logits_BHTS, _NEG), axis=-1)
    out_BTHV = jnp.einsum("bhts,bshv->bthv", probs_BHTS.astype(dt), v_BSHV)
    out_BTD = out_BTHV.reshape(B, T, H * V) @ self.w_o[...].astype(dt)
    return out_BTD, max_logit_H

  def queries(self, x_BTD, cos_BTk, sin_BTk):
    """(q_nope [B,T,H,Kn], rotated q_rope [B,T,H,Kr]); shared with the KV-cached decode path."""
    cfg, dt = self.cfg, x_BTD.dtype
    B, T, _ = x_BTD.shape
    Kn, Kr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_BTR = self.q_norm(x_BTD @ self.w_q_a[...].astype(dt))
    q_BTHK = (q_BTR @ self.w_q_b[...].astype(dt)).reshape(B, T, cfg.num_attention_heads, Kn + Kr)
    return q_BTHK[..., :Kn], rope_lib.apply_rope(q_BTHK[..., Kn:], cos_BTk, sin_BTk, cfg.rope_interleave)

  def latent_and_rope_key(self, x_BTD, cos_BTk, sin_BTk):
    """(normalised kv latent [B,T,Rkv], rotated shared rope key [B,T,Kr]): what a KV cache stores."""
    cfg, Rkv = self.cfg, self.cfg.kv_lora_rank
    kv_a_BTR = x_BTD @ self.w_kv_a[...].astype(x_BTD.dtype)
    k_rope_BTK = rope_lib.apply_rope(kv_a_BTR[:, :, None, Rkv:], cos_BTk, sin_BTk, cfg.rope_interleave)[:, :, 0]
    return self.kv_norm(kv_a_BTR[..., :Rkv]), k_rope_BTK


def attention_mask(segment_ids_BT: jnp.ndarray) -> jnp.ndarray:
  """valid[b, t, s]: causal, same segment, and not padding (segment id 0)."""
  T = segment_ids_BT.shape[1]
  causal_TS = jnp.tril(jnp.ones((T, T), bool))
  same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  return causal_TS[None] & same_BTS & (segment_ids_BT[:, :, None] > 0)
