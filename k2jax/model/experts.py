"""The routed experts' weights: stacked [E, D, F] / [E, F, D] SwiGLU matrices.

Dispatch (sorting token copies by expert, the grouped matmuls, and the all-to-all of expert
parallelism under a multi-device mesh) lives in `expert_parallel.py`; this module only holds the
parameters and hands them over, so the dependency points one way.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from k2jax.model import expert_parallel, int4
from k2jax.model.config import K2Config
from k2jax.model.layers import make_param


class Experts(nnx.Module):
  def __init__(self, cfg: K2Config, *, stack: int | None, rngs: nnx.Rngs):
    E, D, F = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    std, dt = cfg.initializer_range, jnp.dtype(cfg.param_dtype)
    self.dispatch = cfg.moe_dispatch
    self.chunk_tokens = cfg.moe_chunk_tokens
    self.gemm = cfg.moe_gemm
    self.qat = cfg.expert_qat
    self.w_gate = make_param(rngs, (E, D, F), ("experts", "embed", "expert_mlp"), stack=stack, std=std, dtype=dt)
    self.w_up = make_param(rngs, (E, D, F), ("experts", "embed", "expert_mlp"), stack=stack, std=std, dtype=dt)
    self.w_down = make_param(rngs, (E, F, D), ("experts", "expert_mlp", "embed"), stack=stack, std=std, dtype=dt)

  def __call__(self, x_ND, weights_Nk, idx_Nk):
    """Σ_k weights[n,k] · Expert_{idx[n,k]}(x[n]) for every token n. Returns [N, D] in x's dtype."""
    weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
    if self.qat == "int4":  # on the weights, before any grouped GEMM: every MoE path sees the same grid
      weights = tuple(int4.fake_quant(w) for w in weights)
    return expert_parallel.routed_experts(
      x_ND, weights_Nk, idx_Nk, *weights, dispatch=self.dispatch, chunk_tokens=self.chunk_tokens, gemm=self.gemm
    )
