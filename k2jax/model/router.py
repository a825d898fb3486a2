"""Top-k sigmoid routing with the aux-loss-free balancing bias (DeepSeek-V3 `noaux_tc`, K2).

1. scores s = sigmoid(x W) in float32;
2. selection scores c = s + b (b = balancing bias, used ONLY to choose experts);
3. when n_group > 1: keep the topk_group groups with the largest sum of their top-2 c; others get -inf;
4. indices = top-k of c;
5. weights = s[indices] / (sum + 1e-20) * routed_scaling_factor (unbiased scores, renormalised).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k2jax.model.config import K2Config
from k2jax.model.layers import RouterBias, make_param


class Router(nnx.Module):
  def __init__(self, cfg: K2Config, *, stack: int | None, rngs: nnx.Rngs):
    self.cfg = cfg
    D, E = cfg.hidden_size, cfg.n_routed_experts
    self.w = make_param(
      rngs,
      (D, E),
      ("embed", "experts_router"),
      stack=stack,
      std=cfg.initializer_range,
      dtype=jnp.dtype(cfg.param_dtype),
    )
    self.bias = make_param(rngs, (E,), ("experts_router",), stack=stack, std=0.0, dtype=jnp.float32, kind=RouterBias)

  def __call__(self, x_ND: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Returns (weights [N, k] float32, expert indices [N, k] int32)."""
    cfg = self.cfg
    logits_NE = jnp.dot(x_ND.astype(jnp.float32), self.w[...].astype(jnp.float32), preferred_element_type=jnp.float32)
    scores_NE = jax.nn.sigmoid(logits_NE)
    choice_NE = scores_NE + jax.lax.stop_gradient(self.bias[...].astype(jnp.float32))
    if cfg.n_group > 1:
      choice_NE = _limit_groups(choice_NE, cfg.n_group, cfg.topk_group)
    # Selection is a discrete choice: no gradient flows through the ranking itself.
    _, idx_Nk = jax.lax.top_k(jax.lax.stop_gradient(choice_NE), cfg.num_experts_per_tok)
    w_Nk = jnp.take_along_axis(scores_NE, idx_Nk, axis=-1)
    if cfg.norm_topk_prob:
      w_Nk = w_Nk / (jnp.sum(w_Nk, axis=-1, keepdims=True) + 1e-20)
    return w_Nk * cfg.routed_scaling_factor, idx_Nk.astype(jnp.int32)


def _limit_groups(choice_NE: jnp.ndarray, n_group: int, topk_group: int) -> jnp.ndarray:
  N, E = choice_NE.shape
  grouped_NGe = choice_NE.reshape(N, n_group, E // n_group)
  group_score_NG = jnp.sum(jax.lax.top_k(grouped_NGe, 2)[0], axis=-1)
  _, keep_Ng = jax.lax.top_k(group_score_NG, topk_group)
  keep_NG = jnp.zeros((N, n_group), bool).at[jnp.arange(N)[:, None], keep_Ng].set(True)
  masked = jnp.where(keep_NG[:, :, None], grouped_NGe, -jnp.inf)
  return masked.reshape(N, E)
