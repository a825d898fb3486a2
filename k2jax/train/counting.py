"""Parameter counts and training FLOPs per token, from shapes only (`nnx.eval_shape`, no allocation).

params_total      every nnx.Param (the balancing bias is a RouterBias, not counted)
params_activated  total minus the routed experts a token does not use:
                  (n_routed_experts - num_experts_per_tok) * 3 * hidden * moe_intermediate * num_moe_layers
flops_per_token   training FLOPs (forward + backward = 3 x forward) per token at sequence length T:
                  6 * (activated matmul params, i.e. without the embedding lookup table)
                  + 3 * attention scores and values: 2 * H * (qk_head_dim + v_head_dim) * T/2 per layer
                  forward (causal: a token attends to (T+1)/2 keys on average; we use T/2 as MaxText).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from flax import nnx

from k2jax.model.config import K2Config
from k2jax.model.transformer import K2Model


class ParamCounts(NamedTuple):
  total: int
  activated: int
  embedding: int  # the input embedding table (a lookup, no matmul FLOPs)


def count_params(cfg: K2Config) -> ParamCounts:
  """Counts from the abstract model (jax.eval_shape under the hood: nothing is allocated)."""
  abstract = nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(abstract, nnx.Param)
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  idle_experts = cfg.n_routed_experts - cfg.num_experts_per_tok
  inactive = idle_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_moe_layers
  return ParamCounts(total=total, activated=total - inactive, embedding=cfg.vocab_size * cfg.hidden_size)


def flops_per_token(cfg: K2Config, seq_len: int) -> float:
  """Training FLOPs per token (see module docstring)."""
  counts = count_params(cfg)
  matmul = 6.0 * (counts.activated - counts.embedding)
  per_layer_fwd = 2.0 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len / 2
  return matmul + 3.0 * per_layer_fwd * cfg.num_hidden_layers
