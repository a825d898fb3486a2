"""The Kimi K2 decoder: embedding, dense layers, MoE layers, final norm, untied LM head.

Layers of each kind are stored stacked (leading `layers` axis) and run with `jax.lax.scan` over the
stacked state, so a 61-layer model compiles one dense and one MoE layer body. `scan_layers=False` runs
the same stacked parameters in a Python loop (used to check the scan, and for debugging).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k2jax.model import rope as rope_lib
from k2jax.model.block import Block
from k2jax.model.config import K2Config
from k2jax.model.layers import RMSNorm, make_param

REMAT = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class ModelOutput(NamedTuple):
  logits: jnp.ndarray  # [B, T, S] float32
  max_logits: jnp.ndarray  # [num_hidden_layers, H] float32: per-head max pre-softmax logit
  expert_counts: jnp.ndarray  # [num_moe_layers, E] int32: tokens routed to each expert


class K2Model(nnx.Module):
  """Kimi K2 / DeepSeek-V3 causal LM. `model(input_ids)` -> ModelOutput."""

  def __init__(self, cfg: K2Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = jnp.dtype(cfg.param_dtype)
    self.embed = nnx.Module()
    self.embed.embedding = make_param(
      rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), stack=None, std=cfg.initializer_range, dtype=dt
    )
    if cfg.num_dense_layers:
      self.dense_layers = Block(cfg, moe=False, stack=cfg.num_dense_layers, rngs=rngs)
    if cfg.num_moe_layers:
      self.moe_layers = Block(cfg, moe=True, stack=cfg.num_moe_layers, rngs=rngs)
    self.final_norm = RMSNorm(cfg.hidden_size, "embed", eps=cfg.rms_norm_eps, stack=None, rngs=rngs, dtype=dt)
    self.lm_head = nnx.Module()
    self.lm_head.w = make_param(
      rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), stack=None, std=cfg.initializer_range, dtype=dt
    )

  def __call__(self, input_ids_BT, segment_ids_BT=None, positions_BT=None) -> ModelOutput:
    cfg = self.cfg
    B, T = input_ids_BT.shape
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones((B, T), jnp.int32)
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cdt = jnp.dtype(cfg.compute_dtype)
    x_BTD = jnp.take(self.embed.embedding[...], input_ids_BT, axis=0).astype(cdt)
    cos_BTk, sin_BTk = rope_lib.rope_cos_sin(cfg, positions_BT)
    token_valid_BT = segment_ids_BT > 0
    side = (cos_BTk, sin_BTk, segment_ids_BT, token_valid_BT)
    max_logits, counts = [], None
    if cfg.num_dense_layers:
      x_BTD, m_LH, _ = self._run_stack(self.dense_layers, x_BTD, side)
      max_logits.append(m_LH)
    if cfg.num_moe_layers:
      x_BTD, m_LH, counts = self._run_stack(self.moe_layers, x_BTD, side)
      max_logits.append(m_LH)
    if counts is None:
      counts = jnp.zeros((0, cfg.n_routed_experts), jnp.int32)
    x_BTD = self.final_norm(x_BTD)
    logits_BTS = jnp.dot(x_BTD, self.lm_head.w[...].astype(cdt), preferred_element_type=jnp.float32)
    return ModelOutput(logits_BTS.astype(jnp.float32), jnp.concatenate(max_logits, axis=0), counts)

  def _run_stack(self, stack: Block, x_BTD, side):
    graphdef, state = nnx.split(stack)

    def body(x, layer_state):
      x, m_H, c_E = nnx.merge(graphdef, layer_state)(x, *side)
      return x, (m_H, c_E)

    if self.cfg.remat_policy != "none":
      body = jax.checkpoint(body, policy=REMAT[self.cfg.remat_policy], prevent_cse=not self.cfg.scan_layers)
    if self.cfg.scan_layers:
      x_BTD, (m_LH, c_LE) = jax.lax.scan(body, x_BTD, state)
      return x_BTD, m_LH, c_LE
    n = jax.tree.leaves(state)[0].shape[0]
    outs = []
    for i in range(n):
      x_BTD, out = body(x_BTD, jax.tree.map(lambda a, i=i: a[i], state))
      outs.append(out)
    m_LH = jnp.stack([o[0] for o in outs])
    c_LE = None if outs[0][1] is None else jnp.stack([o[1] for o in outs])
    return x_BTD, m_LH, c_LE
