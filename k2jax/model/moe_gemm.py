"""The routed experts' grouped GEMM, chosen per compile target: `grouped_dot(x, w, group_sizes, impl)`.

Contract (every implementation): y[rows of group e] = x[rows of group e] @ w[e] for contiguous row
groups of sizes `group_sizes`, rows past sum(group_sizes) give zeros, differentiable in x and w (dx and
dw both grouped); the same as `jax.lax.ragged_dot(x, w, group_sizes)`. The dispatch around it (sort by
expert, expert-parallel all-to-all, combine) does not depend on the choice.

`K2Config.moe_gemm` (IMPLS):
  auto            cpu: tiled; gpu: tokamax; tpu: ragged_dot.
  ragged_dot      `jax.lax.ragged_dot` as XLA lowers it. XLA:TPU has a native grouped matmul for it;
                  XLA:GPU rewrites it into a dense contraction against all E experts (E times the FLOPs,
                  an [M, E, K] temporary; ../shared/reference/gpu.md) and XLA:CPU likewise: the reference.
  tiled           `grouped_matmul.grouped_matmul`: batched dots over an [E, C, D] stack plus overflow
                  tiles, plain JAX (the CPU kernel; runs anywhere, measured only on CPU).
  tokamax         `tokamax.ragged_dot` kernels with their own VJPs (forward, dlhs, drhs): on GPU the
                  Mosaic-GPU kernel (SM90/SM100) where the GPU has it, else the Triton kernel (SM80+);
                  on TPU the Mosaic-TPU kernel. MaxText's `use_tokamax_gmm`.
  tokamax_triton  only tokamax's Triton kernel (GPU, compute capability >= 8.0).
  jax_triton      jax's own Pallas-Triton lowering of `ragged_dot` (config
                  `jax_ragged_dot_use_gpu_pallas_triton_lowering`). That config is read when the whole
                  program is lowered, not per call, so `k2jax.accel.configure` sets it for the process;
                  `grouped_dot` refuses this choice when it is not set rather than lowering densely.

Why `auto` takes tokamax on GPU: it is the one candidate whose kernels cover forward, dx and dw
without the E-times rewrite and also serve TPU with the same call; jax's Triton lowering is its own
smaller kernel set with a process-wide switch; cuDNN's ragged-dot fusion
(`xla_gpu_experimental_use_ragged_dot_fusion`) needs cuDNN >= 9.22 and has no dw mode in the image's
cuDNN. None of them has been timed on a GPU yet (docs/results.md): `bench/gpu.py` times every candidate
on the routed-expert layer, forward and backward, against a dense matmul of the activated FLOPs;
change `auto` from what it prints.

A GPU or TPU kernel asked for on another compile target is an error, and so is a GPU that lacks the
chosen kernel's compute capability: both name the choices that do run, never a silent dense path.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from k2jax import sharding as sharding_lib
from k2jax.model import grouped_matmul

IMPLS = ("auto", "ragged_dot", "tiled", "tokamax", "tokamax_triton", "jax_triton")
AUTO = {"cpu": "tiled", "gpu": "tokamax", "tpu": "ragged_dot"}
# Where each explicit choice runs (compile target platforms).
PLATFORMS = {
  "ragged_dot": ("cpu", "gpu", "tpu"),
  "tiled": ("cpu", "gpu", "tpu"),
  "tokamax": ("gpu", "tpu"),
  "tokamax_triton": ("gpu",),
  "jax_triton": ("gpu",),
}
# tokamax's implementation names per compile target, tried in order (the first whose checks pass). Named
# explicitly: tokamax's own "mosaic" alias picks GPU or TPU by this host's default device, which a
# cross-compile does not have. Never "xla": that is jax's ragged_dot again, the dense path avoided here.
_TOKAMAX_ORDER = {
  "tokamax": {"gpu": ("mosaic_gpu", "triton"), "tpu": ("mosaic_tpu",)},
  "tokamax_triton": {"gpu": ("triton",)},
}
PALLAS = ("tokamax", "tokamax_triton")  # Pallas kernels: no varying-axes types inside shard_map
TRITON_MIN_CAPABILITY = 8.0  # Triton kernels (tokamax's and jax's): Ampere and newer


class MoEGemmError(ValueError):
  """The chosen grouped GEMM cannot run on the compile target; the message names what can."""


def resolve(impl: str, platform: str | None = None) -> str:
  """`moe_gemm` -> the implementation that runs on `platform` (default: the compile target's)."""
  if impl not in IMPLS:
    raise MoEGemmError(f"moe_gemm: one of {IMPLS}, got {impl!r}")
  platform = platform or sharding_lib.platform()
  name = AUTO[platform] if impl == "auto" else impl
  if platform not in PLATFORMS[name]:
    runs = [n for n, p in PLATFORMS.items() if platform in p]
    raise MoEGemmError(
      f"moe_gemm={impl!r} is a {'/'.join(PLATFORMS[name])} kernel and the compile target is {platform}; "
      f"on {platform} use one of {['auto'] + runs}"
    )
  return name


def grouped_dot(x_MD, w_EDF, group_sizes_E, impl: str = "auto"):
  """x [M, D] @ w [E, D, F] per contiguous row group -> [M, F] in x's dtype (see the module contract)."""
  name = resolve(impl)
  if name == "tiled":
    return grouped_matmul.grouped_matmul(
      x_MD, w_EDF, group_sizes_E, grouped_matmul.default_tile(x_MD.shape[0], w_EDF.shape[0])
    )
  if name == "ragged_dot":
    if staged():
      return _unbatched_ragged_dot(x_MD, w_EDF, group_sizes_E)
    return jax.lax.ragged_dot(x_MD, w_EDF, group_sizes_E, precision=_precision(x_MD, w_EDF))
  if name == "jax_triton":
    if not jax.config.jax_ragged_dot_use_gpu_pallas_triton_lowering:
      raise MoEGemmError(
        "moe_gemm='jax_triton' needs jax's jax_ragged_dot_use_gpu_pallas_triton_lowering on for the whole "
        "program (k2jax.accel.configure(moe_gemm='jax_triton') before compiling); without it ragged_dot "
        "lowers densely"
      )
    check_gpu_capability(name)
    return jax.lax.ragged_dot(x_MD, w_EDF, group_sizes_E)
  check_gpu_capability(name)
  return _tokamax_ragged_dot(x_MD, w_EDF, group_sizes_E, _TOKAMAX_ORDER[name][sharding_lib.platform()])


def staged() -> bool:
  """Whether the active mesh has pipeline stages (k2jax/model/pipeline.py vmaps the layer stack over them)."""
  ctx = sharding_lib.current()
  return ctx is not None and dict(ctx.mesh.shape).get("stage", 1) > 1


# Inside pipeline stages the layer stack runs under `jax.vmap(spmd_axis_name="stage")`: a vmapped ragged_dot
# becomes a ragged dot with a batch dimension, which XLA:TPU refuses ("Failed to create RaggedConvSpec",
# libtpu 0.0.50, lowering 1t_pipeline for v5p-1024). Each device holds one stage's slice of that dimension, so
# these run it as a loop over the (local, size-1) batch instead, forward and both transposes: custom_vjp keeps
# autodiff away from the custom_vmap (which reverse mode cannot cross), and its backward pass is two more loops.
@jax.custom_batching.sequential_vmap
def _looped_ragged_dot(x_MD, w_EDF, group_sizes_E):
  return jax.lax.ragged_dot(x_MD, w_EDF, group_sizes_E, precision=_precision(x_MD, w_EDF))


@jax.custom_batching.sequential_vmap
def _looped_ragged_dot_dw(x_MD, g_MF, group_sizes_E, w_EDF):
  """d(x @ w per group)/dw applied to g: [E, D, F], ragged_dot's own transpose."""
  fwd = lambda w: jax.lax.ragged_dot(x_MD, w, group_sizes_E, precision=_precision(x_MD, w_EDF))  # noqa: E731
  return jax.linear_transpose(fwd, jax.ShapeDtypeStruct(w_EDF.shape, w_EDF.dtype))(g_MF.astype(x_MD.dtype))[0]


@jax.custom_vjp
def _unbatched_ragged_dot(x_MD, w_EDF, group_sizes_E):
  return _looped_ragged_dot(x_MD, w_EDF, group_sizes_E)


def _unbatched_fwd(x_MD, w_EDF, group_sizes_E):
  return _looped_ragged_dot(x_MD, w_EDF, group_sizes_E), (x_MD, w_EDF, group_sizes_E)


def _unbatched_bwd(res, g_MF):
  x_MD, w_EDF, group_sizes_E = res
  dx_MD = _looped_ragged_dot(g_MF.astype(x_MD.dtype), jnp.swapaxes(w_EDF, 1, 2), group_sizes_E)
  dw_EDF = _looped_ragged_dot_dw(x_MD, g_MF, group_sizes_E, w_EDF)
  return dx_MD.astype(x_MD.dtype), dw_EDF.astype(w_EDF.dtype), None


_unbatched_ragged_dot.defvjp(_unbatched_fwd, _unbatched_bwd)


def _precision(x, w):
  """None (jax's default, `jax_default_matmul_precision` included) for float32 operands, DEFAULT for narrower
  ones: XLA:TPU's Mosaic ragged-dot kernel fails to compile an fp32 contract precision on bf16 operands ("Bad
  lhs type", libtpu 0.0.50), which `jax_default_matmul_precision='highest'` asks for, and on bf16 operands it
  changes nothing (their products are exact in the float32 accumulator)."""
  return None if jax.numpy.float32 in (x.dtype, w.dtype) else jax.lax.Precision.DEFAULT


def check_gpu_capability(name: str) -> None:
  """Refuses a GPU kernel on a GPU older than it supports (only when running on one, not cross-compiling)."""
  if sharding_lib.cross_compiling() or sharding_lib.platform() != "gpu":
    return
  device = jax.devices()[0]
  cap = getattr(device, "compute_capability", None)
  if cap is not None and float(cap) < TRITON_MIN_CAPABILITY:
    raise MoEGemmError(
      f"moe_gemm={name!r} needs compute capability >= {TRITON_MIN_CAPABILITY} and {device.device_kind} has "
      f"{cap}; use moe_gemm='tiled' (batched dots, no kernel) or 'ragged_dot' (XLA's dense rewrite, E times the FLOPs)"
    )


def _tokamax_ragged_dot(x_MD, w_EDF, group_sizes_E, order):
  tokamax = import_tokamax()
  try:
    return tokamax.ragged_dot(x_MD, w_EDF, group_sizes_E, implementation=order)
  except (NotImplementedError, ExceptionGroup) as e:  # tokamax >= 0.0.13 groups the errors of every try
    raise MoEGemmError(
      f"tokamax has no grouped-GEMM kernel for this device or these shapes/dtypes (tried {order}: {e}); "
      "use moe_gemm='tiled' or 'ragged_dot'"
    ) from e


def import_tokamax():
  """tokamax, with absl's flags marked parsed if no launcher parsed them (tokamax reads its options
  from absl flags and would otherwise parse this process's argv, e.g. pytest's, and fail)."""
  try:
    import tokamax
  except ImportError as e:
    raise MoEGemmError("the tokamax kernels need the tokamax package: pip install 'k2jax[gpu]'") from e
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tokamax


def _tokamax_cross_compile():
  """tokamax checks this host's default device before it lowers a GPU kernel; inside a cross-compile
  (`sharding.target_platform`) the device is one this host lacks, so its own `cross_compile` option
  (thread-local) turns that check off there, and only there."""
  try:
    tokamax = import_tokamax()
  except MoEGemmError:
    return contextlib.nullcontext()  # not installed: no kernel of it will be traced either
  return tokamax.config.cross_compile(True)


sharding_lib.register_cross_compile_hook(_tokamax_cross_compile)
