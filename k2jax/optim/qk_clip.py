"""QK-Clip with the MLA split (K2 §2.1 "Taming Muon with QK-Clip", Algorithm 1).

After the optimizer step, for every attention layer l and head h with S_max[l, h] > tau,
gamma = tau / S_max (else 1), applied to the freshly updated weights:
  w_q_b  [L, Rq,  H*(Kn+Kr)]: q_nope columns h*(Kn+Kr)+[0,Kn) * sqrt(gamma), q_rope columns
                              h*(Kn+Kr)+[Kn,Kn+Kr) * gamma
  w_kv_b [L, Rkv, H*(Kn+V)]:  k_nope columns h*(Kn+V)+[0,Kn) * sqrt(gamma), value columns untouched
The shared k_rope (w_kv_a columns [Rkv, Rkv+Kr)) is never touched, so heads cannot affect each
other, and q_nope.k_nope + q_rope.k_rope scales by exactly gamma: on the same inputs the head's new max
logit is tau. Momentum is not changed. (JAX matrices are [in, out], so HF's output *rows* are columns.)

S_max is the signed max pre-softmax logit (after the softmax scale) over the whole global batch of
this step: the model's `max_logits` [num_hidden_layers, H]; take the max over microbatches yourself.
Under `jit` a max over a globally sharded batch is already global (inside `shard_map` it needs pmax).
Rows [0, n_dense_layers) belong to `dense_layers`, the rest to `moe_layers`.
"""

import dataclasses

import jax
import jax.numpy as jnp

from k2jax.optim.labels import path_name


@dataclasses.dataclass(frozen=True)
class QKClipSpec:
  """MLA geometry QK-Clip needs; build it from the model config with `from_config`."""

  n_heads: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  n_dense_layers: int
  n_layers: int

  @classmethod
  def from_config(cls, cfg) -> "QKClipSpec":
    return cls(
      n_heads=cfg.num_attention_heads,
      qk_nope_head_dim=cfg.qk_nope_head_dim,
      qk_rope_head_dim=cfg.qk_rope_head_dim,
      v_head_dim=cfg.v_head_dim,
      n_dense_layers=cfg.first_k_dense_replace,
      n_layers=cfg.num_hidden_layers,
    )


def clip_factors(max_logits_LH, tau: float):
  """gamma_LH = tau / S_max where S_max > tau, else exactly 1 (a non-positive S_max never clips)."""
  max_logits_LH = max_logits_LH.astype(jnp.float32)
  clip = max_logits_LH > tau
  return jnp.where(clip, tau / jnp.where(clip, max_logits_LH, 1.0), 1.0)


def clipped_heads(max_logits_LH, tau: float):
  """Number of (layer, head) pairs QK-Clip rescales this step (the `qk_clipped_heads` metric)."""
  return jnp.sum(max_logits_LH > tau).astype(jnp.int32)


def column_scales(gamma_LH, spec: QKClipSpec):
  """Per-output-column factors: ({'w_q_b': [L, H*(Kn+Kr)], 'w_kv_b': [L, H*(Kn+V)]})."""
  n_layers, n_heads = gamma_LH.shape
  root_LH1 = jnp.sqrt(gamma_LH)[..., None]
  q_LHK = jnp.concatenate(
    [
      jnp.broadcast_to(root_LH1, (n_layers, n_heads, spec.qk_nope_head_dim)),
      jnp.broadcast_to(gamma_LH[..., None], (n_layers, n_heads, spec.qk_rope_head_dim)),
    ],
    axis=-1,
  )
  kv_LHK = jnp.concatenate(
    [
      jnp.broadcast_to(root_LH1, (n_layers, n_heads, spec.qk_nope_head_dim)),
      jnp.ones((n_layers, n_heads, spec.v_head_dim), gamma_LH.dtype),
    ],
    axis=-1,
  )
  return {"w_q_b": q_LHK.reshape(n_layers, -1), "w_kv_b": kv_LHK.reshape(n_layers, -1)}


def _layer_rows(name: str, spec: QKClipSpec):
  """(weight kind, slice of max_logits rows) for a clipped leaf name, or None for other leaves."""
  for group, rows in (
    ("dense_layers", slice(0, spec.n_dense_layers)),
    ("moe_layers", slice(spec.n_dense_layers, spec.n_layers)),
  ):
    for kind in ("w_q_b", "w_kv_b"):
      if name == f"{group}.attn.{kind}":
        return kind, rows
  return None


def _check(max_logits_LH, spec: QKClipSpec, names):
  if max_logits_LH.shape != (spec.n_layers, spec.n_heads):
    raise ValueError(
      f"max_logits has shape {max_logits_LH.shape}, expected [num_hidden_layers, "
      f"heads] = {(spec.n_layers, spec.n_heads)}"
    )
  if not any(n.endswith(".attn.w_q_b") for n in names):
    raise ValueError("QK-Clip found no '{dense_layers,moe_layers}.attn.w_q_b' in the param tree")


def qk_clip(params, max_logits_LH, spec: QKClipSpec, *, tau: float):
  """Return params with QK-Clip applied (pure; the reference form of `clip_updates`)."""
  return _map_clipped(params, max_logits_LH, spec, tau, lambda p, s: (p * s).astype(p.dtype))


def clip_updates(updates, params, max_logits_LH, spec: QKClipSpec, *, tau: float):
  """Rewrite `updates` so that `optax.apply_updates(params, updates)` is the clipped new weight.

  Clipped columns get u' = s * (p + u) - p (equal to the clipped weight up to one rounding of the
  add); every other column keeps u untouched, so unclipped heads, value and k_rope weights are
  bitwise what the unclipped optimizer gives.
  """

  def rewrite(u, p, s):
    return jnp.where(s == 1.0, u, (s * (p + u) - p).astype(u.dtype))

  return _map_clipped(updates, max_logits_LH, spec, tau, rewrite, params)


def _map_clipped(tree, max_logits_LH, spec, tau, fn, params=None):
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  names = [path_name(p) for p, _ in flat]
  _check(max_logits_LH, spec, names)
  scales = column_scales(clip_factors(max_logits_LH, tau), spec)
  param_leaves = jax.tree.leaves(params) if params is not None else [None] * len(flat)
  out = []
  for name, (_, x), p in zip(names, flat, param_leaves):
    where = _layer_rows(name, spec)
    if where is None:
      out.append(x)
      continue
    kind, rows = where
    s_L1C = scales[kind][rows][:, None, :].astype(x.dtype)
    if s_L1C.shape[0] != x.shape[0] or s_L1C.shape[-1] != x.shape[-1]:
      raise ValueError(
        f"{name}: shape {x.shape} does not match {s_L1C.shape[0]} layers x "
        f"{s_L1C.shape[-1]} head columns of the QK-Clip spec"
      )
    out.append(fn(x, s_L1C) if p is None else fn(x, p, s_L1C))
  return jax.tree.unflatten(jax.tree.structure(tree), out)
