"""The block-FP8 codec against a direct numpy reading of the format's equation."""

import ml_dtypes
import numpy as np
import pytest

from k2jax.convert import blockops, fp8
from k2jax.convert.errors import CheckpointError


def _reference_dequant(q, s, block):
  """W = float32(q) * repeat(scale, block) cropped: MaxText's repeat-and-crop form."""
  full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[: q.shape[0], : q.shape[1]]
  return q.astype(np.float32) * full


@pytest.mark.parametrize("shape", [(576, 700), (130, 256), (64, 64)])
def test_roundtrip_within_e4m3_rounding_and_ragged_blocks(shape):
  rng = np.random.default_rng(0)
  w = rng.normal(size=shape).astype(np.float32) * rng.uniform(0.01, 3.0, size=(shape[0], 1)).astype(np.float32)
  w[:128, :128] = 0.0  # an all-zero block
  q, s = fp8.quantize(w)
  assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32
  assert s.shape == fp8.scale_shape(shape, (128, 128))
  assert np.all(np.isfinite(s)) and np.all(s > 0)
  assert s[0, 0] == 1.0 and np.all(q[:128, :128].astype(np.float32) == 0)
  back = fp8.dequantize(q, s)
  np.testing.assert_array_equal(back, _reference_dequant(q, s, (128, 128)))
  # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 of the value, plus the subnormal step of the block
  sub = np.repeat(np.repeat(s, 128, 0), 128, 1)[: shape[0], : shape[1]] * 2.0**-9
  assert np.all(np.abs(back - w) <= np.abs(w) * 2.0**-4 + sub)
  # re-quantizing the dequantized weight gives the same bytes
  q2, _ = fp8.quantize(back)
  np.testing.assert_array_equal(q2.view(np.uint8), q.view(np.uint8))


def test_unaligned_slice_equals_slice_of_whole():
  rng = np.random.default_rng(1)
  q, s = fp8.quantize(rng.normal(size=(576, 7 * 64)).astype(np.float32))
  whole = fp8.dequantize(q, s)
  for r0, r1, c0, c1 in [(112, 224, 0, 448), (500, 576, 70, 300), (0, 1, 447, 448)]:
    part = fp8.dequantize(q[r0:r1, c0:c1], s, origin=(r0, c0))
    np.testing.assert_array_equal(part, whole[r0:r1, c0:c1])


def test_quant_config_validation():
  good = fp8.QuantConfig().to_hf()
  assert fp8.QuantConfig.from_hf(good, "c.json").block == (128, 128)
  for bad, word in [
    ({**good, "quant_method": "awq"}, "quant_method"),
    ({**good, "weight_block_size": [128]}, "weight_block_size"),
    ({**good, "weight_block_size": [0, 128]}, "weight_block_size"),
    ({**good, "fmt": "e5m2"}, "fmt"),
    ({**good, "activation_scheme": "static"}, "activation_scheme"),
  ]:
    with pytest.raises(CheckpointError, match=word):
      fp8.QuantConfig.from_hf(bad, "c.json")


def test_quantized_keys_are_the_release_linears():
  assert fp8.is_quantized_key("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
  assert fp8.is_quantized_key("model.layers.3.mlp.experts.7.down_proj.weight")
  for key in (
    "model.layers.3.mlp.gate.weight",
    "lm_head.weight",
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.3.mlp.gate.e_score_correction_bias",
  ):
    assert not fp8.is_quantized_key(key)


def test_fast_e4m3_cast_equals_ml_dtypes_at_every_midpoint():
  """`to_e4m3_bits` (round-to-odd to bf16, then a table) is ml_dtypes' round-to-nearest-even cast: on every
  e4m3 value, every midpoint between two and their float32 neighbours (where double rounding would
  differ), and random values of every magnitude."""
  vals = np.arange(256, dtype=np.uint8).view(fp8.E4M3).astype(np.float32)
  vals = np.sort(vals[np.isfinite(vals)])
  mid = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)
  rng = np.random.default_rng(0)
  x = np.concatenate(
    [vals, mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf), np.nextafter(vals, 0)]
    + [(rng.standard_normal(1 << 18) * 10.0 ** rng.uniform(-12, 2.6, 1 << 18)).astype(np.float32)]
  )
  x = np.clip(x, -fp8.E4M3_MAX, fp8.E4M3_MAX)
  np.testing.assert_array_equal(fp8.to_e4m3_bits(x), x.astype(fp8.E4M3).view(np.uint8))


def test_quantize_equals_the_plain_numpy_reading():
  """scale = amax / 448 per block (1.0 for an all-zero block), codes = e4m3(clip(w / scale)); bf16 input
  widened exactly."""
  rng = np.random.default_rng(2)
  for shape in [(576, 700), (130, 256), (1, 5)]:
    w = (rng.standard_normal(shape) * rng.uniform(1e-4, 3, (shape[0], 1))).astype(ml_dtypes.bfloat16)
    w[:64, :100] = 0
    q, s = fp8.quantize(w)
    w32 = w.astype(np.float32)
    pad = np.zeros((s.shape[0] * 128, s.shape[1] * 128), np.float32)
    pad[: shape[0], : shape[1]] = np.abs(w32)
    amax = pad.reshape(s.shape[0], 128, s.shape[1], 128).max(axis=(1, 3))
    np.testing.assert_array_equal(s, np.where(amax > 0, amax / np.float32(448), np.float32(1)))
    full = np.repeat(np.repeat(s, 128, 0), 128, 1)[: shape[0], : shape[1]]
    want = np.clip(w32 / full, -448, 448).astype(fp8.E4M3)
    assert q.dtype == fp8.E4M3 and q.tobytes() == want.tobytes(), shape


def test_xla_quantizer_is_bitwise_the_numpy_one():
  """`blockops.quantize_fp8` (one XLA:CPU call, the writer's for large jobs) gives the bytes of
  `fp8.quantize` on ragged bf16 and float32 weights, all-zero blocks and values that land exactly on every
  e4m3 midpoint (a block whose amax is 448 has scale 1.0: its values are cast as they are), and refuses
  NaN and inf like it."""
  rng = np.random.default_rng(3)
  vals = np.arange(256, dtype=np.uint8).view(fp8.E4M3).astype(np.float32)
  vals = np.sort(vals[np.isfinite(vals)])
  mid = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)
  edge = np.concatenate([vals, mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)])
  for shape, dtype in [((576, 700), ml_dtypes.bfloat16), ((300, 1000), np.float32), ((130, 129), np.float32)]:
    w = (rng.standard_normal(shape) * rng.uniform(1e-4, 30, (shape[0], 1))).astype(dtype)
    w[:128, 128:256] = 0
    if dtype == np.float32 and shape[0] >= 256:
      w[128:256, :128] = np.resize(edge, (128, 128))  # its amax is 448
    q, s = fp8.quantize(w)
    q2, s2 = blockops.quantize_fp8(w, (128, 128))
    assert q2.dtype == np.uint8 and q2.tobytes() == q.view(np.uint8).tobytes(), shape
    assert s2.dtype == np.float32 and s2.tobytes() == s.tobytes(), shape
  for bad in (np.nan, np.inf, -np.inf):
    w = np.ones((200, 300), np.float32)
    w[150, 7] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
      blockops.quantize_fp8(w, (128, 128))
