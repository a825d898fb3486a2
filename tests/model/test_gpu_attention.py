"""The GPU attention path (tokamax's Triton kernel via `k2jax.model.attention_gpu`), proven on CPU.

tokamax's Triton kernels do not run in Pallas interpret mode, so numerics are checked on tokamax's XLA
reference through the same wrapper (mask, residual max, padding) and the Triton kernel by lowering the
forward and backward for CUDA from this host.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tokamax")

from k2jax import sharding
from k2jax.model import attention_gpu, mla

# MLA's real head dims (nope 128 + rope 64 for q/k, 128 for v), tiny everything else.
B, T, H, KN, KR, V = 2, 24, 3, 128, 64, 128
SCALE = 0.11
# Row 0: two packed documents then padding; row 1: one document, then padding at the end.
SEG = np.array([[1] * 9 + [2] * 11 + [0] * 4, [3] * 21 + [0] * 3], np.int32)


def _inputs(seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 6)
  shapes = [(B, T, H, KN), (B, T, H, KR), (B, T, H, KN), (B, T, KR), (B, T, H, V), (B, T, H, V)]
  return [jax.random.normal(k, s).astype(dtype) for k, s in zip(ks, shapes)]


def _attend(impl):
  return functools.partial(mla.flash_mla_attention, scale=SCALE, impl=impl)


def _einsum(qn, qr, kn, kr, v, seg):
  return mla.einsum_attention(qn, qr, kn, kr, v, seg, SCALE)


def _grads(fn, args, w, seg):
  def loss(qn, qr, kn, kr, v):
    return jnp.sum(fn(qn, qr, kn, kr, v, seg)[0].astype(jnp.float32) * w)

  return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*args)


def test_segment_starts_reproduce_the_attention_mask():
  seg = jnp.asarray(SEG)
  k_start = attention_gpu.segment_starts(seg)
  s_T, t_T = jnp.arange(T)[None, :], jnp.arange(T)[:, None]
  valid = (s_T >= k_start[:, :, None]) & (s_T <= t_T)
  np.testing.assert_array_equal(valid, mla.attention_mask(seg))


def test_tokamax_reference_equals_einsum_outputs_max_logit_and_grads():
  *args, w = _inputs()
  seg = jnp.asarray(SEG)
  want_out, want_max = _einsum(*args, seg)
  out, max_logit = jax.jit(_attend("tokamax_xla"))(*args, seg)
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
  np.testing.assert_allclose(max_logit, want_max, atol=1e-5, rtol=0)
  assert max_logit.dtype == jnp.float32 and max_logit.shape == (H,)
  assert np.all(np.asarray(out)[SEG == 0] == 0.0)  # padding rows exactly 0
  got_g = jax.jit(lambda *a: _grads(_attend("tokamax_xla"), a, w, seg))(*args)
  want_g = jax.jit(lambda *a: _grads(_einsum, a, w, seg))(*args)
  for g, ref in zip(got_g, want_g):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, ref, atol=1e-4, rtol=0)


def test_all_padding_gives_minus_inf_max_and_zero_output():
  *args, _ = _inputs(1)
  seg = jnp.zeros((B, T), jnp.int32)
  out, max_logit = jax.jit(_attend("tokamax_xla"))(*args, seg)
  assert np.all(np.asarray(out) == 0.0)
  assert np.all(np.asarray(max_logit) == -np.inf)


def test_sharded_wrapper_equals_unsharded():
  *args, w = _inputs(2)
  seg = jnp.asarray(SEG)
  want_out, want_max = _einsum(*args, seg)
  want_g = _grads(_einsum, args, w, seg)
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 1}, devices=jax.devices()[:2])
  with sharding.use(mesh, "fsdp"):
    out, max_logit = jax.jit(_attend("tokamax_xla"))(*args, seg)
    got_g = jax.jit(lambda *a: _grads(_attend("tokamax_xla"), a, w, seg))(*args)
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
  np.testing.assert_allclose(max_logit, want_max, atol=1e-5, rtol=0)
  for g, ref in zip(got_g, want_g):
    np.testing.assert_allclose(g, ref, atol=1e-4, rtol=0)


def _lower_for_cuda(kind, dtype=jnp.bfloat16):
  """StableHLO text of the attention forward + backward as compiled for a GPU, from this CPU host."""
  *args, w = _inputs(3, dtype)
  seg = jnp.asarray(SEG)

  def step(*a):
    impl = mla.attention_impl(kind)  # decided while tracing, for the compile target
    out, max_logit = _attend(impl)(*a, seg)
    return _grads(_attend(impl), a, w, seg), max_logit, out

  with sharding.target_platform("gpu"):
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    return jax.jit(step).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kind", ["auto", "flash", "flash_triton"])
def test_gpu_target_lowers_to_triton_kernels_without_a_BHTS_tensor(kind):
  text = _lower_for_cuda(kind)
  calls = text.count("custom_call @__gpu$xla.gpu.triton(")
  assert calls == 3, calls  # forward (out + max), the forward under grad, its backward (dq, dk, dv)
  # No [B, H, T, S] tensor anywhere (the backward's mask is [B, 1, T, S], broadcast over heads).
  assert not re.search(rf"tensor<{B}x{H}x{T}x{T}x", text)
  assert not re.search(rf"tensor<{H}x{T}x{T}x", text)


def test_flash_xla_stays_reachable_on_gpu():
  text = _lower_for_cuda("flash_xla")
  assert "__gpu$xla.gpu.triton" not in text
  assert "stablehlo.while" in text  # the blocked scan over kv blocks


def test_gpu_choice_resolves_per_compile_target():
  assert mla.attention_impl("flash_xla") == "xla"
  with sharding.target_platform("gpu"):
    assert mla.attention_impl("auto") == "triton"
    assert mla.attention_impl("flash") == "triton"
    assert mla.attention_impl("flash_xla") == "xla"
    assert mla.attention_impl("einsum") == "einsum"
  with sharding.target_platform("tpu"):
    assert mla.attention_impl("auto") == "pallas"


@pytest.mark.parametrize("target", ["cpu", "tpu"])
def test_gpu_kernel_on_another_target_is_an_error(target):
  with sharding.target_platform(target), pytest.raises(ValueError, match="flash_triton.*GPU kernel"):
    mla.attention_impl("flash_triton")


def test_triton_without_a_gpu_or_a_cross_compile_is_refused():
  *args, _ = _inputs()
  with pytest.raises(attention_gpu.GpuAttentionError, match="runs on a GPU.*flash_xla"):
    _attend("triton")(*args, jnp.asarray(SEG))


def test_bad_dtype_and_head_dim_name_the_fallback():
  q = jnp.zeros((1, 8, 1, 192), jnp.float64 if jax.config.x64_enabled else jnp.int8)
  seg = jnp.ones((1, 8), jnp.int32)
  with pytest.raises(attention_gpu.GpuAttentionError, match="flash_xla"):
    attention_gpu.tokamax_attention(q, q, q[..., :128], seg, scale=1.0, implementation="xla")
  big = jnp.zeros((1, 8, 1, 320), jnp.float32)
  with pytest.raises(attention_gpu.GpuAttentionError, match="head dims <= 256.*flash_xla"):
    attention_gpu.tokamax_attention(big, big, big[..., :128], seg, scale=1.0, implementation="xla")
  with pytest.raises(attention_gpu.GpuAttentionError, match="integer"):
    attention_gpu.tokamax_attention(big[..., :192], big[..., :192], big[..., :128], seg * 1.0, scale=1.0)


def test_old_gpu_is_refused_naming_the_fallback(monkeypatch):
  class _OldGpu:
    platform, device_kind, compute_capability = "gpu", "Tesla V100", "7.0"

  monkeypatch.setattr(attention_gpu.jax, "devices", lambda *a: [_OldGpu()])
  with pytest.raises(attention_gpu.GpuAttentionError, match=r"compute capability >= 8.0.*7.0.*flash_xla"):
    attention_gpu.check_device()


def test_model_on_a_gpu_target_runs_the_kernel_and_returns_max_logits():
  """K2Model's loss gradient with attention='auto', lowered for CUDA: every layer's attention is the
  tokamax kernel (forward with residuals and its VJP), and max_logits [L, H] come out of the step."""
  from flax import nnx

  from k2jax.model import K2Model, presets

  cfg = presets.get("tiny", num_hidden_layers=2, first_k_dense_replace=1, vocab_size=64, attention="auto")
  model = K2Model(cfg, rngs=nnx.Rngs(0))
  ids = jnp.zeros((2, 16), jnp.int32)
  seg = jnp.array([[1] * 6 + [2] * 10, [1] * 12 + [0] * 4])
  pos = jnp.array([list(range(6)) + list(range(10)), list(range(12)) + [0] * 4])

  def step(m):
    out = m(ids, seg, pos)
    return jnp.sum(out.logits**2), out.max_logits

  with sharding.target_platform("gpu"):
    fn = nnx.jit(nnx.grad(step, has_aux=True))
    lowered = fn.trace(model).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
  main = next(line for line in text.splitlines() if "func.func public @main" in line)
  assert f"tensor<2x{cfg.num_attention_heads}xf32>" in main.split("->")[-1]  # max_logits [L, H] is returned
  assert "pallas_flash_attention_fwd_res" in text and "pallas_flash_attention_vjp" in text
