"""One decoder layer: pre-norm MLA then pre-norm FFN (dense SwiGLU or MoE), both residual."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from k2jax import sharding as sharding_lib
from k2jax.model import context_parallel as cp
from k2jax.model.config import K2Config
from k2jax.model.experts import Experts
from k2jax.model.layers import RMSNorm, SwiGLU
from k2jax.model.mla import MLA
from k2jax.model.router import Router


class MoE(nnx.Module):
  """Routed experts (top-k sigmoid, dropless) plus the always-on shared expert."""

  def __init__(self, cfg: K2Config, *, stack: int | None, rngs: nnx.Rngs):
    self.router = Router(cfg, stack=stack, rngs=rngs)
    self.experts = Experts(cfg, stack=stack, rngs=rngs)
    self.shared = (
      SwiGLU(
        cfg.hidden_size,
        cfg.moe_intermediate_size * cfg.n_shared_experts,
        "shared_mlp",
        stack=stack,
        std=cfg.initializer_range,
        dtype=jnp.dtype(cfg.param_dtype),
        rngs=rngs,
      )
      if cfg.n_shared_experts > 0
      else None
    )

  def __call__(self, x_BTD, token_valid_BT):
    """Returns (out [B,T,D], expert token counts [E] int32 over valid tokens)."""
    B, T, _ = x_BTD.shape
    # Tokens stay sharded over the batch axes through routing and into the EP dispatch; under context
    # parallelism a device's sequence chunk becomes its token block where it lies.
    x_ND = sharding_lib.constrain(cp.tokens_to_rows(x_BTD), ("act_batch", "act_embed"))
    w_Nk, idx_Nk = self.router(x_ND)
    y_ND = self.experts(x_ND, w_Nk, idx_Nk)
    E = self.router.w.get_value().shape[-1]
    valid_N = cp.tokens_to_rows(token_valid_BT[..., None].astype(jnp.int32))[:, 0]  # idx_Nk's row order
    counts_E = jnp.zeros((E,), jnp.int32).at[idx_Nk.reshape(-1)].add(jnp.repeat(valid_N, idx_Nk.shape[1]))
    out_BTD = cp.rows_to_tokens(y_ND, B, T)
    if self.shared is not None:
      out_BTD = out_BTD + self.shared(x_BTD)
    return out_BTD, counts_E


class Block(nnx.Module):
  def __init__(self, cfg: K2Config, *, moe: bool, stack: int | None, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.hidden_size, "embed", eps=cfg.rms_norm_eps, stack=stack, rngs=rngs, dtype=dt)
    self.attn = MLA(cfg, stack=stack, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, "embed", eps=cfg.rms_norm_eps, stack=stack, rngs=rngs, dtype=dt)
    if moe:
      self.moe = MoE(cfg, stack=stack, rngs=rngs)
    else:
      self.mlp = SwiGLU(
        cfg.hidden_size, cfg.intermediate_size, "mlp", stack=stack, std=cfg.initializer_range, dtype=dt, rngs=rngs
      )

  def __call__(self, x_BTD, cos_BTk, sin_BTk, segment_ids_BT, token_valid_BT):
    """Returns (x [B,T,D], max_logit [H], expert counts [E] or None for a dense layer)."""
    h_BTD, max_logit_H = self.attn(self.attn_norm(x_BTD), cos_BTk, sin_BTk, segment_ids_BT)
    x_BTD = x_BTD + h_BTD
    if hasattr(self, "moe"):
      h_BTD, counts_E = self.moe(self.mlp_norm(x_BTD), token_valid_BT)
    else:
      h_BTD, counts_E = self.mlp(self.mlp_norm(x_BTD)), None
    return x_BTD + h_BTD, max_logit_H, counts_E
