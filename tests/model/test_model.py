"""Model properties: causality, packing, scan == unrolled, remat, max-logit semantics, parameter counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k2jax.model import K2Model, presets
from k2jax.model.mla import attention_mask

CFG = presets.get(
  "tiny",
  num_hidden_layers=3,
  first_k_dense_replace=1,
  vocab_size=128,
  rope_scaling=(
    ("factor", 4.0),
    ("mscale", 1.0),
    ("mscale_all_dim", 1.0),
    ("original_max_position_embeddings", 16),
    ("type", "yarn"),
  ),
)


def _model(cfg=CFG, seed=0):
  m = K2Model(cfg, rngs=nnx.Rngs(seed))
  # Larger weights than the 0.02 init so attention and routing are not near-uniform.
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)
  params = jax.tree.map(lambda p: p * 8.0 if p.ndim >= 2 else p, params)
  return nnx.merge(graphdef, params, rest)


def test_causality_by_gradient():
  """With ids = arange(T) (distinct tokens), embedding row j is used only at position j: the logits at
  t must have zero gradient with respect to rows j > t and non-zero for rows j <= t."""
  model = _model()
  T, t = 12, 5
  ids = jnp.arange(T)[None]
  grads = nnx.jit(nnx.grad(lambda m: m(ids).logits[0, t].sum()))(model)
  g_norm = np.abs(np.asarray(grads.embed.embedding[...])).sum(-1)
  assert np.all(g_norm[t + 1 : T] == 0.0)
  assert np.all(g_norm[: t + 1] > 0.0)


def test_packing_equals_separate_runs():
  model = _model()
  a = jax.random.randint(jax.random.key(2), (7,), 0, CFG.vocab_size)
  b = jax.random.randint(jax.random.key(3), (6,), 0, CFG.vocab_size)
  ids = jnp.concatenate([a, b, jnp.zeros(3, jnp.int32)])[None]
  seg = jnp.array([[1] * 7 + [2] * 6 + [0] * 3])
  pos = jnp.array([list(range(7)) + list(range(6)) + [0] * 3])
  packed = model(ids, seg, pos)
  la, lb = model(a[None]).logits[0], model(b[None]).logits[0]
  np.testing.assert_allclose(packed.logits[0, :7], la, atol=2e-5)
  np.testing.assert_allclose(packed.logits[0, 7:13], lb, atol=2e-5)
  # padding tokens are not counted as routed tokens
  assert int(packed.expert_counts.sum()) == 13 * CFG.num_experts_per_tok * CFG.num_moe_layers
  assert np.all(np.isfinite(np.asarray(packed.logits)))


def test_scan_equals_unrolled_and_remat():
  model = _model()
  ids = jax.random.randint(jax.random.key(4), (2, 10), 0, CFG.vocab_size)
  state = nnx.state(model)
  outs = {}
  for scan, remat in [(True, "none"), (False, "none"), (True, "full")]:
    m = nnx.merge(nnx.graphdef(K2Model(CFG.replace(scan_layers=scan, remat_policy=remat), rngs=nnx.Rngs(0))), state)

    def loss(m):
      return jnp.mean(m(ids).logits ** 2)

    l, g = nnx.jit(nnx.value_and_grad(loss))(m)  # one program per layout (op by op: ~1000 tiny compiles)
    outs[(scan, remat)] = (l, jax.tree.leaves(g))
  base_l, base_g = outs[(True, "none")]
  for key, (l, g) in outs.items():
    np.testing.assert_allclose(l, base_l, rtol=1e-6, err_msg=str(key))
    for x, y in zip(g, base_g):
      np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4 * float(np.abs(y).max()), err_msg=str(key))


def test_max_logits_are_max_over_valid_positions():
  model = _model()
  ids = jax.random.randint(jax.random.key(5), (2, 9), 0, CFG.vocab_size)
  seg = jnp.array([[1] * 5 + [2] * 4, [1] * 6 + [0] * 3])
  pos = jnp.array([list(range(5)) + list(range(4)), list(range(6)) + [0] * 3])
  out = model(ids, seg, pos)
  assert out.max_logits.shape == (CFG.num_hidden_layers, CFG.num_attention_heads)
  # Recompute layer 0's logits by hand from its parameters.
  from k2jax.model import rope as rope_lib

  attn = model.dense_layers
  p = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(nnx.state(attn)))
  x = jnp.take(model.embed.embedding[...], ids, axis=0)

  def rms(v, g, eps):
    return g * v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + eps)

  h = rms(x, p["attn_norm"]["scale"], CFG.rms_norm_eps)
  H, Kn, Kr = CFG.num_attention_heads, CFG.qk_nope_head_dim, CFG.qk_rope_head_dim
  q = (rms(h @ p["attn"]["w_q_a"], p["attn"]["q_norm"]["scale"], 1e-6) @ p["attn"]["w_q_b"]).reshape(2, 9, H, -1)
  kva = h @ p["attn"]["w_kv_a"]
  c = rms(kva[..., : CFG.kv_lora_rank], p["attn"]["kv_norm"]["scale"], 1e-6)
  k_nope = (c @ p["attn"]["w_kv_b"]).reshape(2, 9, H, -1)[..., :Kn]
  cos, sin = rope_lib.rope_cos_sin(CFG, pos)
  q_rope = rope_lib.apply_rope(q[..., Kn:], cos, sin, CFG.rope_interleave)
  k_rope = rope_lib.apply_rope(kva[..., None, CFG.kv_lora_rank :], cos, sin, CFG.rope_interleave)
  s = (
    jnp.einsum("bthk,bshk->bhts", q[..., :Kn], k_nope) + jnp.einsum("bthk,bsk->bhts", q_rope, k_rope[:, :, 0])
  ) * rope_lib.softmax_scale(CFG)
  valid = np.asarray(attention_mask(seg))
  want = np.max(np.where(valid[:, None], np.asarray(s), -np.inf), axis=(0, 2, 3))
  np.testing.assert_allclose(out.max_logits[0], want, rtol=1e-5)
  assert rope_lib.softmax_scale(CFG) != CFG.qk_head_dim**-0.5  # YaRN mscale is in effect


def test_1t_parameter_counts_without_allocation():
  from k2jax.model.config import K2Config

  cfg = presets.get("1t")
  assert cfg == K2Config()  # the dataclass defaults are Kimi K2
  model = nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  assert total == 1_026_408_209_408
  per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
  activated = total - (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert * cfg.num_moe_layers
  assert activated == 32_861_477_888
  bias = nnx.state(model, nnx.Not(nnx.Param))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(bias)) == 60 * 384
  # presets
  assert (
    0.9e9
    < sum(
      int(np.prod(x.shape))
      for x in jax.tree.leaves(
        nnx.state(nnx.eval_shape(lambda: K2Model(presets.get("small"), rngs=nnx.Rngs(0))), nnx.Param)
      )
    )
    < 1.5e9
  )


def test_axes_metadata_on_every_variable():
  model = nnx.eval_shape(lambda: K2Model(CFG, rngs=nnx.Rngs(0)))
  for path, var in nnx.graph.iter_graph(model):
    if isinstance(var, nnx.Variable):
      axes = var.get_metadata()["axes"]
      assert len(axes) == len(var.shape), path
