"""INT4 QAT of the routed experts (k2jax/model/int4.py): the release's grid, checked against a numpy reference
(ml_dtypes' bf16, numpy's true division and half-to-even rounding), the straight-through gradient, and the same
fake-quantized weights on every MoE path."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from k2jax import sharding
from k2jax.model import int4, presets
from k2jax.model.block import MoE
from k2jax.model.config import ConfigError

BF16 = ml_dtypes.bfloat16


def _reference(w_IO: np.ndarray):
  """numpy: per group of 32 along axis -2, s = bf16(fp32(amax) / 7), q = clip(rint(w / s), -7, 7) with the
  quotient in w's dtype, 0 for a zero scale."""
  n_in, out = w_IO.shape[-2:]
  q = np.zeros(w_IO.shape, np.int8)
  scales = np.zeros(w_IO.shape[:-2] + (-(-n_in // 32), out), BF16)
  for g in range(scales.shape[-2]):
    blk = w_IO[..., 32 * g : 32 * g + 32, :]
    s = (np.abs(blk).max(axis=-2).astype(np.float32) / np.float32(7)).astype(BF16)
    scales[..., g, :] = s
    div = np.where(s == 0, np.ones_like(s), s).astype(w_IO.dtype)
    q[..., 32 * g : 32 * g + 32, :] = np.clip(np.rint(blk / div[..., None, :]), -7, 7).astype(np.int8)
  return q, scales


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("shape", [(3, 64, 16), (2, 2, 96, 8), (2, 40, 8)])  # stacked layers; ragged last group
def test_quantize_matches_the_reference_and_fake_quant_is_dequant_of_quantize_bitwise(dtype, shape):
  rng = np.random.default_rng(0)
  w = (rng.standard_normal(shape) * np.exp(rng.uniform(-8, 2, shape[:-2] + (1, shape[-1])))).astype(dtype)
  w[..., 32:40, 0] = 0  # an all-zero group (the ragged last group when in = 40)
  q, s = jax.jit(int4.quantize)(jnp.asarray(w))
  q_ref, s_ref = _reference(w)
  np.testing.assert_array_equal(np.asarray(s).view(np.uint16), s_ref.view(np.uint16))
  np.testing.assert_array_equal(np.asarray(q), q_ref)
  assert np.abs(np.asarray(q)).max() == 7 and q.dtype == jnp.int8 and s.dtype == jnp.bfloat16
  fq = np.asarray(jax.jit(int4.fake_quant)(jnp.asarray(w)))
  assert fq.dtype == w.dtype
  np.testing.assert_array_equal(fq, np.asarray(int4.dequantize(q, s, w.dtype)))
  # The reference dequantization: fp32(q) * fp32(s) is exact, then one rounding to w's dtype.
  s_IO = np.repeat(s_ref.astype(np.float32), 32, axis=-2)[..., : shape[-2], :]
  np.testing.assert_array_equal(fq, (q_ref.astype(np.float32) * s_IO).astype(dtype))
  assert np.all(fq[..., 32:40, 0] == 0) and np.all(np.isfinite(fq))


def test_every_nonzero_group_codes_its_amax_to_seven_and_the_ragged_group_uses_its_own_amax():
  w = np.zeros((1, 40, 2), np.float32)
  w[0, :32, 0] = np.linspace(-1, 0.5, 32)
  w[0, 32:, 0] = [0.07, -0.35, 0.1, 0, 0, 0, 0, 0.2]  # the 8-wide last group: amax 0.35
  q, s = int4.quantize(jnp.asarray(w))
  assert np.asarray(s)[0, 1, 0] == (np.float32(0.35) / np.float32(7)).astype(BF16)
  np.testing.assert_array_equal(np.asarray(q)[0, 32:, 0], [1, -7, 2, 0, 0, 0, 0, 4])
  assert int(q[0, 0, 0]) == -7 and np.all(np.asarray(s)[0, :, 1] == 0) and np.all(np.asarray(q)[0, :, 1] == 0)


def test_dequantized_codes_are_a_fixed_point_of_quantize():
  """Masters imported from an INT4 release (dequantized to float32) re-quantize to the same codes and
  scales, so a QAT step with a zero update exports the release unchanged."""
  rng = np.random.default_rng(1)
  q = rng.integers(-7, 8, (4, 96, 24)).astype(np.int8)
  q[:, ::32, :] = rng.choice([-7, 7], (4, 3, 24))  # each group's amax codes to +-7, as the release's do
  s = np.exp(rng.uniform(-12, -2, (4, 3, 24))).astype(BF16)
  s[0, 0, 0] = 0
  q[0, :32, 0] = 0
  w = int4.dequantize(jnp.asarray(q), jnp.asarray(s), jnp.float32)
  q2, s2 = int4.quantize(w)
  np.testing.assert_array_equal(np.asarray(q2), q)
  np.testing.assert_array_equal(np.asarray(s2).view(np.uint16), s.view(np.uint16))
  np.testing.assert_array_equal(np.asarray(int4.fake_quant(w)), np.asarray(w))


def test_gradient_is_straight_through():
  w = jax.random.normal(jax.random.key(0), (2, 64, 8), jnp.float32)
  c = jax.random.normal(jax.random.key(1), w.shape, jnp.float32)
  g = jax.grad(lambda w: jnp.sum(jnp.sin(int4.fake_quant(w)) * c))(w)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(jnp.cos(int4.fake_quant(w)) * c))
  zero = jnp.zeros((1, 32, 4), jnp.bfloat16)
  gz = jax.grad(lambda w: jnp.sum(int4.fake_quant(w).astype(jnp.float32) * 3.0))(zero)
  assert gz.dtype == jnp.bfloat16 and np.all(np.asarray(gz, np.float32) == 3.0)


def test_dequantize_refuses_scales_that_do_not_fit():
  with pytest.raises(ValueError, match=r"expected \[\.\.\., 2, 8\]"):
    int4.dequantize(jnp.zeros((64, 8), jnp.int8), jnp.zeros((3, 8), jnp.bfloat16))


def test_qat_needs_routed_experts_and_a_known_scheme():
  with pytest.raises(ConfigError, match=r"expert_qat: 'int4' quantizes routed experts and this model has none"):
    presets.get("tiny", expert_qat="int4", first_k_dense_replace=2, num_hidden_layers=2)
  with pytest.raises(ConfigError, match=r"expert_qat: one of \('none', 'int4'\), got 'int8'"):
    presets.get("tiny", expert_qat="int8")
  assert presets.get("tiny").expert_qat == "none"


# ------------------------------------------------------------------------------------------ MoE paths
def _layer(qat: str, **kw):
  cfg = dataclasses.replace(presets.get("tiny"), expert_qat=qat, **kw)
  return nnx.split(MoE(cfg, stack=None, rngs=nnx.Rngs(0)))


def _on_grid(state):
  """The same parameters with the routed experts' weights replaced by their fake-quantized values."""
  state = jax.tree.map(lambda x: x, state)
  for name in ("w_gate", "w_up", "w_down"):
    state["experts"][name].set_value(int4.fake_quant(state["experts"][name].get_value()))
  return state


def _value_and_grad(graphdef, state, x, cot):
  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x, jnp.ones(x.shape[:2], bool))[0] * cot)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)


@pytest.mark.parametrize("gemm", ["auto", "ragged_dot"])  # the fused CPU kernel; XLA's ragged_dot (TPU's path)
def test_qat_layer_is_the_plain_layer_on_the_fake_quantized_weights_with_straight_through_gradients(gemm):
  """QAT changes only the routed experts' weights (shared expert and router untouched) and passes the
  gradient at the fake-quantized weights straight to the masters."""
  gq, state = _layer("int4", moe_gemm=gemm)
  gp, _ = _layer("none", moe_gemm=gemm)
  x = jax.random.normal(jax.random.key(1), (2, 16, 64), jnp.float32)
  cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  (lq, (gsq, gxq)), (lp, (gsp, gxp)) = _value_and_grad(gq, state, x, cot), _value_and_grad(gp, _on_grid(state), x, cot)
  (lf, _) = _value_and_grad(gp, state, x, cot)
  assert float(lq) == float(lp) and float(lq) != float(lf)  # fake-quant moved the output: the check bites
  np.testing.assert_array_equal(np.asarray(gxq), np.asarray(gxp))
  for a, b in zip(jax.tree.leaves(gsq), jax.tree.leaves(gsp)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_qat_under_expert_parallelism_matches_one_device():
  gq, state = _layer("int4", moe_dispatch="fixed")
  x = jax.random.normal(jax.random.key(3), (8, 8, 64), jnp.float32)
  cot = jax.random.normal(jax.random.key(4), x.shape, jnp.float32)
  (l0, (gs0, gx0)) = _value_and_grad(gq, state, x, cot)
  with sharding.use(sharding.make_mesh({"fsdp": 2, "expert": 4}), "fsdp_ep"):
    (l1, (gs1, gx1)) = _value_and_grad(gq, state, x, cot)
  gp, _ = _layer("none", moe_dispatch="fixed")
  (lf, _) = _value_and_grad(gp, state, x, cot)
  assert abs(float(l1) - float(l0)) <= 1e-4 * abs(float(l0)) and abs(float(lf) - float(l0)) > 1e-3 * abs(float(l0))
  np.testing.assert_allclose(gx1, gx0, rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(gs1), jax.tree.leaves(gs0)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_gpu_qat_layer_fake_quantizes_before_the_tokamax_kernels():
  """No GPU here: lowered for CUDA, the QAT layer's gradient still runs the 9 tokamax kernels (gate, up,
  down: forward, dlhs, drhs) and rounds each of the 3 expert weights to the grid first."""
  pytest.importorskip("tokamax")
  graphdef, state = _layer("int4", compute_dtype="bfloat16")

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x, jnp.ones(x.shape[:2], bool))[0].astype(jnp.float32))

  x = jax.ShapeDtypeStruct((2, 64, 64), jnp.bfloat16)
  with sharding.target_platform("gpu"):
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(state, x).lower(lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 9
  assert len(re.findall(r"call @round(?:_\d+)?\b", text)) == 3 and "stablehlo.round_nearest_even" in text


@pytest.mark.parametrize("n_in", [64, 41])  # 41: an odd input length and a ragged last group
def test_served_packed_codes_dequantize_to_the_fake_quantized_weights(n_in):
  w = jax.random.normal(jax.random.key(5), (2, 3, n_in, 8), jnp.float32)
  p, s = int4.to_served(w)
  assert p.dtype == jnp.uint8 and p.shape == (2, 3, (n_in + 1) // 2, 8) and s.shape == (2, 3, -(-n_in // 32), 8)
  np.testing.assert_array_equal(np.asarray(int4.unpack_codes(p, n_in)), np.asarray(int4.quantize(w)[0]))
  np.testing.assert_array_equal(np.asarray(int4.served_weight(p, s, n_in, jnp.float32)), np.asarray(int4.fake_quant(w)))


def test_qat_model_in_bf16_fake_quantizes_the_float32_masters_not_their_bf16_copy():
  """The whole model with bf16 compute (the layer stack's compute copy): the QAT forward and its expert
  gradients are the plain model's on the float32 masters' fake-quantized values, as an INT4 export stores."""
  from k2jax.model import K2Model

  cfg = presets.get("tiny", compute_dtype="bfloat16")
  graphdef_q, state = nnx.split(K2Model(cfg.replace(expert_qat="int4"), rngs=nnx.Rngs(0)))
  graphdef_p = nnx.graphdef(K2Model(cfg, rngs=nnx.Rngs(0)))
  on_grid = jax.tree.map(lambda x: x, state)
  for name in ("w_gate", "w_up", "w_down"):
    on_grid["moe_layers"]["moe"]["experts"][name].set_value(
      int4.fake_quant(state["moe_layers"]["moe"]["experts"][name].get_value())
    )
  ids = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)

  def loss(graphdef, state):
    return jnp.sum(nnx.merge(graphdef, state)(ids).logits * jnp.cos(jnp.arange(cfg.vocab_size)))

  (lq, gq), (lp, gp) = (
    jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(g, s)
    for g, s in ((graphdef_q, state), (graphdef_p, on_grid))
  )
  assert float(lq) == float(lp)
  for name in ("w_gate", "w_up", "w_down"):
    a, b = (g["moe_layers"]["moe"]["experts"][name].get_value() for g in (gq, gp))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
