"""The K2 forward pass over a KV cache, for serving: MLA's compressed cache with W_kv_b absorbed.

Cache (per layer stack, layers leading so `jax.lax.scan` walks it like the model does):
  latent [L, N, T, Rkv]  = kv_norm(c_kv)      (the kv-LoRA latent after its RMSNorm)
  rope   [L, N, T, Kr]   = rope(k_rope)       (the ONE shared rope key, already rotated)
N = cache rows (serving slots), T = max sequence length. That is Rkv + Kr numbers per token and layer
instead of H * (Kn + V) for full K/V (576 vs 32768 for K2).

Attention with the cache absorbs W_kv_b (DeepSeek-V2 §2.1.2): with W_kv_b split per head into
W_uk [Rkv, H, Kn] and W_uv [Rkv, H, V],
  q_nope · k_nope = (q_nope W_uk^T) · c     and     Σ_s p_s v_s = (Σ_s p_s c_s) W_uv,
so keys and values are never expanded. This is the same function as `k2jax.model.mla.MLA` up to
float rounding (tests check greedy tokens and logprobs against the full forward).

Everything else (norms, rope, router, experts, dense MLP) calls the model's own modules; only the
attention step is re-written here, reading MLA's parameters.

Positions: token t of row b sits at `positions[b, t]`; its latent/rope key are written there, and it
attends to cache slots s <= positions[b, t]. Padding tokens get position T (out of range): their
writes are dropped (`mode="drop"`) and their outputs ignored, so no row is ever polluted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k2jax.model import rope as rope_lib
from k2jax.model.block import Block
from k2jax.model.config import K2Config
from k2jax.model.mla import _NEG, MLA
from k2jax.model.transformer import K2Model

STACKS = ("dense_layers", "moe_layers")  # layer order: dense first, then MoE (as the model runs them)


def init_cache(cfg: K2Config, num_rows: int, max_len: int) -> dict:
  """Zeroed cache {stack: {"latent": [L,N,T,Rkv], "rope": [L,N,T,Kr]}} in the compute dtype."""
  dt = jnp.dtype(cfg.compute_dtype)
  sizes = {"dense_layers": cfg.num_dense_layers, "moe_layers": cfg.num_moe_layers}
  return {
    name: {
      "latent": jnp.zeros((n, num_rows, max_len, cfg.kv_lora_rank), dt),
      "rope": jnp.zeros((n, num_rows, max_len, cfg.qk_rope_head_dim), dt),
    }
    for name, n in sizes.items()
    if n
  }


def forward_cached(model: K2Model, cache: dict, tokens_BT, positions_BT, last_index_B):
  """Runs new tokens through the model against `cache` (B rows).

  Args:
    tokens_BT: int32 new tokens per row.
    positions_BT: int32 absolute position of each new token (>= T for padding: ignored).
    last_index_B: index t of the token whose next-token logits are wanted (the last real one).
  Returns:
    (logits [B, S] float32 at `last_index_B`, updated cache).
  """
  x_BTD, new_cache = hidden_cached(model, cache, tokens_BT, positions_BT)
  x_BD = jnp.take_along_axis(x_BTD, last_index_B[:, None, None], axis=1)[:, 0]
  return lm_logits(model, x_BD), new_cache


def lm_logits(model: K2Model, x_BD):
  """float32 next-token logits of final hidden states x (any leading axes; the last one D)."""
  cdt = jnp.dtype(model.cfg.compute_dtype)
  x_BD = model.final_norm(x_BD)
  return jnp.dot(x_BD, model.lm_head.w[...].astype(cdt), preferred_element_type=jnp.float32).astype(jnp.float32)


def hidden_cached(model: K2Model, cache: dict, tokens_BT, positions_BT):
  """`forward_cached`'s pass over every new token: (final hidden states [B, T, D] before the norm, cache)."""
  cfg = model.cfg
  cdt = jnp.dtype(cfg.compute_dtype)
  x_BTD = jnp.take(model.embed.embedding[...], tokens_BT, axis=0).astype(cdt)
  cos_BTk, sin_BTk = rope_lib.rope_cos_sin(cfg, positions_BT)
  max_len = next(iter(cache.values()))["latent"].shape[2]
  valid_BTS = jnp.arange(max_len)[None, None, :] <= positions_BT[:, :, None]
  token_valid_BT = positions_BT < max_len
  side = (cos_BTk, sin_BTk, positions_BT, valid_BTS, token_valid_BT)
  new_cache = {}
  for name in STACKS:
    if name in cache:
      x_BTD, new_cache[name] = _run_stack(getattr(model, name), x_BTD, cache[name], side)
  return x_BTD, new_cache


def _run_stack(stack: Block, x_BTD, cache_stack: dict, side):
  """The stack's layers over x; each writes its new tokens into its own slice of the stack's cache.

  The cache rides in the scan's carry and is updated in place: a cache scanned in as xs and out as ys
  would be a second whole cache among the step's temporaries (XLA cannot alias a while loop's stacked
  outputs to its inputs): 1.1x the cache on CPU (tests/engine/test_decode_memory.py), and for configs/rl.py:1t
  on v5p-1024 (AOT, XLA's figures) 22.48 GiB of temporaries per device beside a 21.45 GiB cache, 1.07 now."""
  graphdef, state = nnx.split(stack)

  def body(carry, xs):
    x, latent, rope = carry
    layer_state, i = xs
    layer = nnx.merge(graphdef, layer_state)
    at = lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)  # noqa: E731
    x, latent_NTR, rope_NTK = _layer(layer, x, at(latent), at(rope), *side)
    latent = jax.lax.dynamic_update_index_in_dim(latent, latent_NTR, i, 0)
    rope = jax.lax.dynamic_update_index_in_dim(rope, rope_NTK, i, 0)
    return (x, latent, rope), None

  n = cache_stack["latent"].shape[0]
  carry = (x_BTD, cache_stack["latent"], cache_stack["rope"])
  (x_BTD, latent, rope), _ = jax.lax.scan(body, carry, (state, jnp.arange(n)))
  return x_BTD, {"latent": latent, "rope": rope}


def _layer(layer: Block, x_BTD, latent_BSR, rope_BSK, cos_BTk, sin_BTk, positions_BT, valid_BTS, token_valid_BT):
  """`Block.__call__` with the cached attention step in place of MLA's full attention."""
  h_BTD, latent_BSR, rope_BSK = mla_cached(
    layer.attn, layer.attn_norm(x_BTD), latent_BSR, rope_BSK, cos_BTk, sin_BTk, positions_BT, valid_BTS
  )
  return _mlp(layer, x_BTD + h_BTD, token_valid_BT), latent_BSR, rope_BSK


def _mlp(layer: Block, x_BTD, token_valid_BT):
  """The block's second half: the MoE (or dense MLP) on the normed residual, added to it."""
  if hasattr(layer, "moe"):
    h_BTD, _ = layer.moe(layer.mlp_norm(x_BTD), token_valid_BT)
  else:
    h_BTD = layer.mlp(layer.mlp_norm(x_BTD))
  return x_BTD + h_BTD


def mla_cached(attn: MLA, x_BTD, latent_BSR, rope_BSK, cos_BTk, sin_BTk, positions_BT, valid_BTS):
  """MLA for new tokens x against a cache row per batch entry; returns (out, latent, rope)."""
  q_nope_BTHK, q_rope_BTHK = attn.queries(x_BTD, cos_BTk, sin_BTk)
  latent_new_BTR, rope_new_BTK = attn.latent_and_rope_key(x_BTD, cos_BTk, sin_BTk)
  latent_BSR = _write_rows(latent_BSR, latent_new_BTR.astype(latent_BSR.dtype), positions_BT)
  rope_BSK = _write_rows(rope_BSK, rope_new_BTK.astype(rope_BSK.dtype), positions_BT)
  return _attend(attn, q_nope_BTHK, q_rope_BTHK, latent_BSR, rope_BSK, valid_BTS), latent_BSR, rope_BSK


def _attend(attn: MLA, q_nope_BTHK, q_rope_BTHK, latent_BSR, rope_BSK, valid_BTS):
  """Absorbed MLA attention of the queries over keys (latent, rope) [B, S, ...] where valid_BTS."""
  cfg, dt = attn.cfg, q_nope_BTHK.dtype
  B, T = q_nope_BTHK.shape[:2]
  H, Kn, V, Rkv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
  # Absorb W_kv_b: per head h, columns h*(Kn+V)+[0,Kn) make k_nope and the rest v (mla.py layout).
  w_kv_b_RHK = attn.w_kv_b[...].astype(dt).reshape(Rkv, H, Kn + V)
  w_uk_RHK, w_uv_RHV = w_kv_b_RHK[..., :Kn], w_kv_b_RHK[..., Kn:]
  q_lat_BTHR = jnp.einsum("bthk,rhk->bthr", q_nope_BTHK, w_uk_RHK)
  logits_BHTS = (
    jnp.einsum("bthr,bsr->bhts", q_lat_BTHR, latent_BSR.astype(dt), preferred_element_type=jnp.float32)
    + jnp.einsum("bthk,bsk->bhts", q_rope_BTHK, rope_BSK.astype(dt), preferred_element_type=jnp.float32)
  ) * attn.scale
  probs_BHTS = jax.nn.softmax(jnp.where(valid_BTS[:, None], logits_BHTS, _NEG), axis=-1)
  o_lat_BTHR = jnp.einsum("bhts,bsr->bthr", probs_BHTS.astype(dt), latent_BSR.astype(dt))
  out_BTHV = jnp.einsum("bthr,rhv->bthv", o_lat_BTHR, w_uv_RHV)
  return out_BTHV.reshape(B, T, H * V) @ attn.w_o[...].astype(dt)


def hidden_fresh(model: K2Model, tokens_BT, positions_BT, max_len: int, cache_dtype):
  """`hidden_cached` for rows that start at position 0 (whole prompts, nothing cached before them): each
  token attends only to the new tokens at positions <= its own, so attention spans the T new tokens, not
  the cache's max_len, and no cache row is read. Returns (final hidden states [B, T, D] before the norm,
  {stack: {"latent": [L, B, T, Rkv], "rope": [L, B, T, Kr]}}: the new tokens' cache entries, in
  `cache_dtype`, to be written at positions 0..T-1 of their rows, `write_fresh`).
  Padding tokens (position >= max_len) are no token's key."""
  cfg = model.cfg
  cdt = jnp.dtype(cfg.compute_dtype)
  x_BTD = jnp.take(model.embed.embedding[...], tokens_BT, axis=0).astype(cdt)
  cos_BTk, sin_BTk = rope_lib.rope_cos_sin(cfg, positions_BT)
  valid_BTS = positions_BT[:, None, :] <= positions_BT[:, :, None]
  token_valid_BT = positions_BT < max_len
  entries = {}
  for name in STACKS:
    if not getattr(cfg, "num_dense_layers" if name == "dense_layers" else "num_moe_layers"):
      continue
    graphdef, state = nnx.split(getattr(model, name))

    def body(x, layer_state, graphdef=graphdef):
      layer = nnx.merge(graphdef, layer_state)
      h = layer.attn_norm(x)
      q_nope, q_rope = layer.attn.queries(h, cos_BTk, sin_BTk)
      latent, rope = (a.astype(cache_dtype) for a in layer.attn.latent_and_rope_key(h, cos_BTk, sin_BTk))
      x = x + _attend(layer.attn, q_nope, q_rope, latent, rope, valid_BTS)
      return _mlp(layer, x, token_valid_BT), (latent, rope)

    x_BTD, (latent, rope) = jax.lax.scan(body, x_BTD, state)
    entries[name] = {"latent": latent, "rope": rope}
  return x_BTD, entries


def _write_rows(cache_BSX, new_BTX, positions_BT):
  """cache[b, positions[b, t]] = new[b, t]; out-of-range positions (padding) are dropped."""
  return jax.vmap(lambda row_SX, new_TX, pos_T: row_SX.at[pos_T].set(new_TX, mode="drop"))(
    cache_BSX, new_BTX, positions_BT
  )


def read_row(cache: dict, row) -> dict:
  """One cache row as {stack: {"latent": [L,T,Rkv], "rope": [L,T,Kr]}} (a copy)."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, row, axis=1, keepdims=False), cache)


def write_row(cache: dict, row_value: dict, row) -> dict:
  """`cache` with row `row` replaced by `row_value` (the inverse of `read_row`)."""
  return jax.tree.map(
    lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), row, axis=1), cache, row_value
  )
