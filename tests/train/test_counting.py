"""Parameter counts from shapes: the K2 numbers, and the activated-parameter rule on tiny."""

import math

import jax
from flax import nnx

from k2jax.model import K2Model, presets
from k2jax.train.counting import count_params, flops_per_token


def test_k2_1t_counts():
  counts = count_params(presets.get("1t"))
  assert counts.total == 1026408209408
  assert counts.activated == 32861477888


def test_tiny_counts_match_allocated_model():
  cfg = presets.get("tiny")
  model = K2Model(cfg, rngs=nnx.Rngs(0))
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  counts = count_params(cfg)
  assert counts.total == total  # the RouterBias is not counted
  experts = nnx.state(model, nnx.Param)["moe_layers"]["moe"]["experts"]
  per_expert = sum(math.prod(v.shape[2:]) for v in jax.tree.leaves(experts))  # [L, E, ...] -> one expert
  idle = (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert * cfg.num_moe_layers
  assert counts.activated == total - idle


def test_flops_per_token_grows_with_context():
  cfg = presets.get("tiny")
  short, long = flops_per_token(cfg, 64), flops_per_token(cfg, 128)
  counts = count_params(cfg)
  assert short > 6 * (counts.activated - counts.embedding)
  attn_per_token_64 = short - 6 * (counts.activated - counts.embedding)
  assert math.isclose(long - short, attn_per_token_64)  # attention term is linear in T
