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


class ServedInt4(nnx.Variable):
  """An INT4-serving engine's expert codes or scales (`K2Config.expert_storage='int4'`): not trained."""


class Experts(nnx.Module):
  def __init__(self, cfg: K2Config, *, stack: int | None, rngs: nnx.Rngs):
    E, D, F = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    std, dt = cfg.initializer_range, jnp.dtype(cfg.param_dtype)
    self.dispatch = cfg.moe_dispatch
    self.chunk_tokens = cfg.moe_chunk_tokens
    self.gemm = cfg.moe_gemm
    self.qat, self.storage, self.dtype = cfg.expert_qat, cfg.expert_storage, dt
    self.n_in = (D, D, F)  # each weight's input (group) axis length
    gate_up, down = ((E, D, F), ("experts", "embed", "expert_mlp")), ((E, F, D), ("experts", "expert_mlp", "embed"))
    for name, (shape, axes) in zip(int4.EXPERT_WEIGHTS, (gate_up, gate_up, down)):
      if self.storage == "int4":  # zeros until weights are set (`int4.served_params` of float ones)
        *lead, n_in, n_out = shape
        zeros = dict(stack=stack, std=0.0, kind=ServedInt4)
        packed = make_param(rngs, (*lead, -(-n_in // 2), n_out), axes, dtype=jnp.uint8, **zeros)
        setattr(self, name + int4.PACKED, packed)
        setattr(
          self,
          name + int4.SCALE,
          make_param(rngs, (*lead, int4.num_groups(n_in), n_out), axes, dtype=int4.SCALE_DTYPE, **zeros),
        )
      else:
        setattr(self, name, make_param(rngs, shape, axes, stack=stack, std=std, dtype=dt))

  def __call__(self, x_ND, weights_Nk, idx_Nk):
    """Σ_k weights[n,k] · Expert_{idx[n,k]}(x[n]) for every token n. Returns [N, D] in x's dtype."""
    if self.storage == "int4":  # this layer's experts dequantized now (one layer's floats live at a time)
      weights = tuple(
        int4.served_weight(getattr(self, name + int4.PACKED)[...], getattr(self, name + int4.SCALE)[...], n, self.dtype)
        for name, n in zip(int4.EXPERT_WEIGHTS, self.n_in)
      )
    else:
      weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
    if self.qat == "int4" and self.storage == "float":  # before any grouped GEMM: every MoE path sees the grid
      weights = tuple(int4.fake_quant(w) for w in weights)
    return expert_parallel.routed_experts(
      x_ND, weights_Nk, idx_Nk, *weights, dispatch=self.dispatch, chunk_tokens=self.chunk_tokens, gemm=self.gemm
    )
