"""Dropless expert dispatch and compute: sort token copies by expert, run `jax.lax.ragged_dot`.

Every (token, chosen expert) pair is computed: no capacity, no dropped tokens. The routed experts are
stacked weights [E, D, F] / [E, F, D]; ragged_dot runs one grouped matmul over the contiguous groups.
Under an active multi-device mesh (`k2jax.sharding.use`) the same steps run per device inside
`shard_map`, with token copies sent to the experts' devices by all-to-all (`expert_parallel.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k2jax import sharding as sharding_lib
from k2jax.model import grouped_matmul
from k2jax.model.config import K2Config
from k2jax.model.layers import make_param


class Experts(nnx.Module):
  def __init__(self, cfg: K2Config, *, stack: int | None, rngs: nnx.Rngs):
    E, D, F = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    std, dt = cfg.initializer_range, jnp.dtype(cfg.param_dtype)
    self.w_gate = make_param(rngs, (E, D, F), ("experts", "embed", "expert_mlp"), stack=stack, std=std, dtype=dt)
    self.w_up = make_param(rngs, (E, D, F), ("experts", "embed", "expert_mlp"), stack=stack, std=std, dtype=dt)
    self.w_down = make_param(rngs, (E, F, D), ("experts", "expert_mlp", "embed"), stack=stack, std=std, dtype=dt)

  def __call__(self, x_ND, weights_Nk, idx_Nk):
    """Σ_k weights[n,k] · Expert_{idx[n,k]}(x[n]) for every token n. Returns [N, D] in x's dtype."""
    weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
    ctx = sharding_lib.current()
    if ctx is not None:
      # A multi-device mesh is active: per-device dispatch under shard_map, all-to-all over `expert`.
      from k2jax.model import expert_parallel  # noqa: PLC0415 (expert_parallel imports this module)

      return expert_parallel.ep_experts(ctx, x_ND, weights_Nk, idx_Nk, *weights)
    return dispatch_compute_combine(x_ND, weights_Nk, idx_Nk, *weights)


def dispatch_compute_combine(x_ND, weights_Nk, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD):
  """The whole dropless MoE on one device's tokens and experts: sort, grouped SwiGLU, combine."""
  N, k = idx_Nk.shape
  x_sorted_MD, order_M, group_sizes_E = sort_by_expert(x_ND, idx_Nk, w_gate_EDF.shape[0])
  y_sorted_MD = expert_ffn(x_sorted_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD)
  return combine(y_sorted_MD, order_M, weights_Nk, N, k)


def sort_by_expert(x_ND, idx_Nk, num_experts: int):
  """Token copies sorted by expert id: (x_sorted [N*k, D], order [N*k], group_sizes [E])."""
  k = idx_Nk.shape[1]
  flat_M = idx_Nk.reshape(-1)
  order_M = jnp.argsort(flat_M, stable=True)
  group_sizes_E = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
  return jnp.take(x_ND, order_M // k, axis=0), order_M, group_sizes_E


def expert_ffn(x_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD):
  """SwiGLU per contiguous expert group with grouped matmuls."""
  dt = x_MD.dtype
  g_MF = grouped_dot(x_MD, w_gate_EDF.astype(dt), group_sizes_E)
  u_MF = grouped_dot(x_MD, w_up_EDF.astype(dt), group_sizes_E)
  return grouped_dot(jax.nn.silu(g_MF) * u_MF, w_down_EFD.astype(dt), group_sizes_E)


def grouped_dot(x_MD, w_EDF, group_sizes_E):
  """`jax.lax.ragged_dot`, except on CPU where it costs E dense matmuls: there the tiled kernel.
  The platform is the compile target's (the active mesh's devices), not the host's."""
  if sharding_lib.platform() == "cpu":
    return grouped_matmul.grouped_matmul(
      x_MD, w_EDF, group_sizes_E, grouped_matmul.default_tile(x_MD.shape[0], w_EDF.shape[0])
    )
  return jax.lax.ragged_dot(x_MD, w_EDF, group_sizes_E)


def combine(y_sorted_MD, order_M, weights_Nk, N: int, k: int):
  """Undo the sort and take the weighted sum over each token's k experts."""
  y_MD = jnp.zeros_like(y_sorted_MD).at[order_M].set(y_sorted_MD, unique_indices=True)
  y_NkD = y_MD.reshape(N, k, -1)
  return jnp.einsum("nkd,nk->nd", y_NkD, weights_Nk.astype(y_NkD.dtype))
