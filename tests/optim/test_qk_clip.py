"""QK-Clip: column layout on a synthetic tree, and exactness on the real tiny model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import SPEC, synthetic_params
from flax import nnx

from k2jax.optim import QKClipSpec, muonclip, muonclip_metrics, qk_clip


def test_mla_split_columns():
  """q_nope * sqrt(g), q_rope * g, k_nope * sqrt(g); v and w_kv_a (k_rope) untouched."""
  params = jax.tree.map(jnp.asarray, synthetic_params(0))
  max_logits = jnp.array([[50.0, 5.0], [5.0, 40.0], [-3.0, 20.0]])  # rows: dense, moe0, moe1
  out = qk_clip(params, max_logits, SPEC, tau=10.0)
  gamma = {(0, 0): 0.2, (1, 1): 0.25, (2, 1): 0.5}
  Kn, Kr, V = SPEC.qk_nope_head_dim, SPEC.qk_rope_head_dim, SPEC.v_head_dim
  for layer in range(3):
    group, li = ("dense_layers", 0) if layer == 0 else ("moe_layers", layer - 1)
    for h in range(2):
      g = gamma.get((layer, h), 1.0)
      q0, k0 = (params[group]["attn"][n][li] for n in ("w_q_b", "w_kv_b"))
      q1, k1 = (out[group]["attn"][n][li] for n in ("w_q_b", "w_kv_b"))
      qs, ks = h * (Kn + Kr), h * (Kn + V)
      np.testing.assert_allclose(q1[:, qs : qs + Kn], q0[:, qs : qs + Kn] * np.sqrt(g), rtol=1e-6)
      np.testing.assert_allclose(q1[:, qs + Kn : qs + Kn + Kr], q0[:, qs + Kn : qs + Kn + Kr] * g, rtol=1e-6)
      np.testing.assert_allclose(k1[:, ks : ks + Kn], k0[:, ks : ks + Kn] * np.sqrt(g), rtol=1e-6)
      np.testing.assert_array_equal(k1[:, ks + Kn : ks + Kn + V], k0[:, ks + Kn : ks + Kn + V])
  for group in ("dense_layers", "moe_layers"):
    np.testing.assert_array_equal(out[group]["attn"]["w_kv_a"], params[group]["attn"]["w_kv_a"])


def test_bad_max_logits_shape_is_named():
  params = jax.tree.map(jnp.asarray, synthetic_params(0))
  with pytest.raises(ValueError, match="max_logits has shape"):
    qk_clip(params, jnp.ones((2, 2)), SPEC, tau=10.0)


@pytest.mark.slow
def test_lr0_step_clips_real_model_to_tau():
  """Tiny k2jax model, fixed batch, lr=0: clipped heads' recomputed max logit == tau (1e-4).

  Clipping layer l changes layer l's attention output and so the inputs of layers > l; the exact-tau
  property holds on unchanged inputs, so each case pushes one layer's heads over tau: the first
  (dense) layer, then the last (MoE) layer.
  """
  from k2jax.model import K2Model, presets

  cfg = presets.get("tiny")
  spec = QKClipSpec.from_config(cfg)
  forward = nnx.jit(lambda m, ids: m(ids).max_logits)
  ids_BT = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  for group, li, layer in (("dense_layers", 0, 0), ("moe_layers", 1, cfg.num_hidden_layers - 1)):
    model = K2Model(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    for name in ("w_q_b", "w_kv_b"):  # blow up one layer's q and k so its logits are O(10)
      var = params[group]["attn"][name]
      var[...] = var[...].at[li].multiply(12.0)
    nnx.update(model, params)
    before_LH = np.asarray(forward(model, ids_BT))
    tau = float(np.median(before_LH[layer]))
    clipped = before_LH > tau
    assert clipped[layer].sum() >= 1 and clipped.sum() == clipped[layer].sum(), before_LH

    opt = muonclip(0.0, qk_clip_tau=tau, qk_clip_spec=spec)
    grads = jax.tree.map(lambda x: jnp.ones_like(x) * 0.3, params)
    updates, state = opt.update(grads, opt.init(params), params, max_logits=jnp.asarray(before_LH))
    new_params = optax.apply_updates(params, updates)
    assert int(muonclip_metrics(state)["qk_clipped_heads"]) == int(clipped.sum())
    nnx.update(model, new_params)
    after_LH = np.asarray(forward(model, ids_BT))

    np.testing.assert_allclose(after_LH[clipped], tau, rtol=1e-4)
    # Layers up to the clipped one see unchanged inputs: unclipped heads there are bitwise equal.
    np.testing.assert_array_equal(
      after_LH[: layer + 1][~clipped[: layer + 1]], before_LH[: layer + 1][~clipped[: layer + 1]]
    )
    _assert_untouched_bitwise(params, new_params, clipped, cfg)


def _assert_untouched_bitwise(old, new, clipped_LH, cfg):
  Kn, Kr, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  n_dense = cfg.first_k_dense_replace
  for path, x_old in jax.tree_util.tree_flatten_with_path(old)[0]:
    x_new = _get(new, path)
    name = jax.tree_util.keystr(path)
    if "w_q_b" not in name and "w_kv_b" not in name:
      np.testing.assert_array_equal(x_new, x_old, err_msg=name)  # incl. w_kv_a (k_rope)
      continue
    width = Kn + (Kr if "w_q_b" in name else V)
    rows = range(n_dense) if "dense_layers" in name else range(n_dense, cfg.num_hidden_layers)
    for li, layer in enumerate(rows):
      for h in range(cfg.num_attention_heads):
        cols = slice(h * width + (0 if not clipped_LH[layer, h] else Kn), (h + 1) * width)
        if clipped_LH[layer, h] and "w_q_b" in name:
          continue  # every column of a clipped head's query moves
        np.testing.assert_array_equal(x_new[li][:, cols], x_old[li][:, cols], err_msg=name)


def _get(tree, path):
  for key in path:
    if hasattr(key, "key"):
      tree = tree[key.key]
    else:  # an nnx Variable's `.value` key
      tree = tree[...] if key.name == "value" else getattr(tree, key.name)
  return tree
