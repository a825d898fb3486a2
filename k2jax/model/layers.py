"""Small building blocks shared by the model: parameter creation with logical axes, RMSNorm, SwiGLU.

Every variable carries `axes` metadata (logical axis names). `k2jax.sharding` maps these names to mesh
axes with one rules table per preset, so sharding is declared here once and nowhere else.
Stacked layers carry a leading `layers` axis; matrices are always the last two axes, [in, out].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
  """The aux-loss-free balancing bias: selects experts, never trained, never decayed."""


def make_param(
  rngs: nnx.Rngs,
  shape: tuple[int, ...],
  axes: tuple[str, ...],
  *,
  stack: int | None,
  std: float | None,
  dtype,
  kind=nnx.Param,
) -> nnx.Variable:
  """A variable of `shape` (with a leading `layers` axis of size `stack` when given).

  std=None means ones (norm gains); std=0.0 means zeros.
  """
  if stack is not None:
    shape, axes = (stack, *shape), ("layers", *axes)
  if std is None:
    value = jnp.ones(shape, dtype)
  elif std == 0.0:
    value = jnp.zeros(shape, dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return kind(value, axes=axes)


class RMSNorm(nnx.Module):
  """RMSNorm in float32 with a learned gain (HF DeepseekV3RMSNorm)."""

  def __init__(self, dim: int, axis_name: str, *, eps: float, stack: int | None, rngs: nnx.Rngs, dtype=jnp.float32):
    self.eps = eps
    self.scale = make_param(rngs, (dim,), (axis_name,), stack=stack, std=None, dtype=dtype)

  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    # HF casts back to the input dtype before multiplying by the gain.
    return (self.scale[...].astype(jnp.float32) * xf.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


class SwiGLU(nnx.Module):
  """down(silu(x W_gate) * (x W_up)): the dense FFN and the shared expert."""

  def __init__(self, d_model: int, d_ff: int, ff_axis: str, *, stack: int | None, std: float, dtype, rngs: nnx.Rngs):
    self.w_gate = make_param(rngs, (d_model, d_ff), ("embed", ff_axis), stack=stack, std=std, dtype=dtype)
    self.w_up = make_param(rngs, (d_model, d_ff), ("embed", ff_axis), stack=stack, std=std, dtype=dtype)
    self.w_down = make_param(rngs, (d_ff, d_model), (ff_axis, "embed"), stack=stack, std=std, dtype=dtype)

  def __call__(self, x_BTD: jnp.ndarray) -> jnp.ndarray:
    dt = x_BTD.dtype
    g_BTF = x_BTD @ self.w_gate[...].astype(dt)
    u_BTF = x_BTD @ self.w_up[...].astype(dt)
    return (jax.nn.silu(g_BTF) * u_BTF) @ self.w_down[...].astype(dt)
