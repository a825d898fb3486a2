"""The routed experts' grouped GEMM per compile target (k2jax/model/moe_gemm.py).

Without a GPU: the GPU choices are proven by lowering for CUDA on a CPU host (`sharding.target_platform`),
counting ops in the StableHLO: `chlo.ragged_dot` is XLA's dense E-times rewrite on GPU, the tokamax
kernels are `__gpu$xla.gpu.triton` custom calls (count the op, not the string "ragged_dot": kernel names
contain it). Their numerics on a GPU are checked by bench/gpu.py against the reference.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k2jax import sharding
from k2jax.model import moe_gemm, presets
from k2jax.model.block import MoE
from k2jax.model.config import ConfigError
from tests.cross_lowering import NEEDS_GPU_MESH

TRITON = r"custom_call @__gpu\$xla\.gpu\.triton"


def test_auto_resolves_per_compile_target():
  assert [moe_gemm.resolve("auto", p) for p in ("cpu", "gpu", "tpu")] == ["tiled", "tokamax", "ragged_dot"]
  with sharding.target_platform("gpu"):
    assert moe_gemm.resolve("auto") == "tokamax"
  assert moe_gemm.resolve("auto") == "tiled"  # this host, outside the override


@pytest.mark.parametrize(
  "impl,platform,names", [("tokamax", "cpu", "gpu/tpu"), ("tokamax_triton", "tpu", "gpu"), ("jax_triton", "cpu", "gpu")]
)
def test_a_kernel_for_another_target_is_refused_with_the_choices_that_run(impl, platform, names):
  with pytest.raises(moe_gemm.MoEGemmError, match=f"a {names} kernel and the compile target is {platform}.*'tiled'"):
    moe_gemm.resolve(impl, platform)


def test_unknown_choice_names_the_field():
  with pytest.raises(moe_gemm.MoEGemmError, match="moe_gemm: one of"):
    moe_gemm.resolve("cutlass", "gpu")
  with pytest.raises(ConfigError, match="moe_gemm"):
    dataclasses.replace(presets.get("tiny"), moe_gemm="cutlass")


def test_jax_triton_without_its_process_option_is_refused_not_lowered_densely():
  x, w, g = jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([4, 4], jnp.int32)
  assert not jax.config.jax_ragged_dot_use_gpu_pallas_triton_lowering
  with sharding.target_platform("gpu"), pytest.raises(moe_gemm.MoEGemmError, match="accel.configure"):
    moe_gemm.grouped_dot(x, w, g, "jax_triton")


def _moe_grad_text(gemm: str, platform: str = "gpu") -> str:
  cfg = dataclasses.replace(presets.get("tiny"), compute_dtype="bfloat16", moe_gemm=gemm)
  graphdef, state = nnx.split(MoE(cfg, stack=None, rngs=nnx.Rngs(0)))

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x, jnp.ones(x.shape[:2], bool))[0].astype(jnp.float32))

  x = jax.ShapeDtypeStruct((2, 64, cfg.hidden_size), jnp.bfloat16)
  with sharding.target_platform(platform):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(state, x).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


def test_gpu_moe_layer_gradient_is_tokamax_kernels_and_no_dense_ragged_dot():
  pytest.importorskip("tokamax")
  text = _moe_grad_text("auto")
  assert text.count("chlo.ragged_dot") == 0
  # gate, up, down: forward, dlhs and drhs each.
  assert len(re.findall(TRITON, text)) == 9
  # The reference choice keeps XLA's op (the E-times rewrite on GPU): the count above is not vacuous.
  ref = _moe_grad_text("ragged_dot")
  assert ref.count("chlo.ragged_dot") > 0 and not re.findall(TRITON, ref)


def test_ragged_dot_choice_equals_the_cpu_kernel_on_cpu():
  """The explicit choices that run here compute the same layer (and gradients) as `auto`'s CPU kernel."""
  base = presets.get("tiny")
  x = jax.random.normal(jax.random.key(1), (2, 16, base.hidden_size), jnp.float32)
  cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)

  def run(gemm):
    cfg = dataclasses.replace(base, moe_gemm=gemm)
    graphdef, state = nnx.split(MoE(cfg, stack=None, rngs=nnx.Rngs(0)))

    def loss(state, x):
      return jnp.sum(nnx.merge(graphdef, state)(x, jnp.ones(x.shape[:2], bool))[0] * cot)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)

  (l0, (gs0, gx0)), (l1, (gs1, gx1)) = run("auto"), run("ragged_dot")
  np.testing.assert_allclose(l0, l1, rtol=1e-5)
  np.testing.assert_allclose(gx0, gx1, rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(gs0), jax.tree.leaves(gs1)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  (l2, _) = run("tiled")
  np.testing.assert_allclose(l0, l2, rtol=1e-6)


def test_tokamax_asked_for_on_a_cpu_target_fails_before_tracing():
  cfg = dataclasses.replace(presets.get("tiny"), moe_gemm="tokamax")
  moe = MoE(cfg, stack=None, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 8, cfg.hidden_size))
  with pytest.raises(moe_gemm.MoEGemmError, match="compile target is cpu"):
    moe(x, jnp.ones((1, 8), bool))


@NEEDS_GPU_MESH
@pytest.mark.parametrize("preset,dispatch", [("fsdp_ep", "ragged"), ("fsdp_ep_tp", "fixed")])
def test_gpu_expert_parallel_layer_runs_the_kernels_inside_shard_map(preset, dispatch):
  """Under expert parallelism the kernels run per device inside shard_map (check_vma off there, see
  expert_parallel.ep_experts; tests/sharding/test_ragged_dispatch checks that setting's gradients)."""
  pytest.importorskip("tokamax")
  cfg = dataclasses.replace(presets.get("tiny"), compute_dtype="bfloat16", moe_dispatch=dispatch)
  graphdef, state = nnx.split(MoE(cfg, stack=None, rngs=nnx.Rngs(0)))

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x, jnp.ones(x.shape[:2], bool))[0].astype(jnp.float32))

  x = jax.ShapeDtypeStruct((8, 32, cfg.hidden_size), jnp.bfloat16)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "expert": 4, "tensor": 1})
  with sharding.target_platform("gpu"), sharding.use(mesh, preset):
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(state, x).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("chlo.ragged_dot") == 0 and len(re.findall(TRITON, text)) == 9
  assert ("ragged_all_to_all" in text) == (dispatch == "ragged")
