"""Muon as Moonshot runs it (ML §2, K2 §2.1), as an optax direction transform.

Per matrix W in R^{A x B} (the last two axes; every leading axis is a batch axis):
  M_t = mu * M_{t-1} + G_t                       plain-sum momentum, M_0 = 0
  N_t = mu * M_t + G_t  (Nesterov) or M_t        Newton-Schulz input
  O_t = NS5(N_t / (||N_t||_F + eps))             quintic, (a, b, c) = (3.4445, -4.7750, 2.0315)
  U_t = rms_scale * sqrt(max(A, B)) * O_t        "Match Adam RMS" (ML Lemma 1)
Weight decay and the learning rate are chained after this in build.py (W -= lr * (U + wd * W)).

Why not `optax.contrib.scale_by_muon` (optax 0.2.8):
  * its momentum is a bias-corrected EMA with a (1 - beta) Nesterov term; it differs from the plain sum
    in the first ~1/(1 - mu) = 20 steps even after NS's Frobenius normalisation;
  * it reshapes every leaf to (prod(batch), A, B): flattening the [L, E] batch axes of a sharded expert
    stack forces a reshard; here NS is a batched matmul over the untouched leading axes;
  * its NS loop is unrolled (`unroll=True`, ~2.5 GB extra HBM at scale, fixed only after 0.2.8);
  * it cannot distribute whole matrices over devices (`OwnerSharding` below).
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k2jax import sharding as sharding_lib
from k2jax.model import transformer as transformer_lib
from k2jax.optim.labels import path_name

DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)


@dataclasses.dataclass(frozen=True)
class OwnerSharding:
  """Distribute whole matrices over `axes` of `mesh` for Newton-Schulz.

  Same-shape matrices of all leaves in the group are stacked into one [N, A, B] batch, padded to a
  multiple of the owner count and sharded on N: each device orthogonalises N / n_owners whole matrices
  instead of every FSDP shard running the same NS on the full matrix (pitfall 7 of the reference).
  The reshard in and out is one all-to-all-like collective each way; bench/optim.py measures it.
  """

  mesh: Mesh
  axes: tuple[str, ...]

  def __post_init__(self):
    missing = [a for a in self.axes if a not in self.mesh.axis_names]
    if missing:
      raise ValueError(f"OwnerSharding axes {missing} are not mesh axes {self.mesh.axis_names}")

  @property
  def explicit(self) -> bool:
    return all(t == jax.sharding.AxisType.Explicit for t in self.mesh.axis_types)

  @property
  def n_owners(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.axes)

  def constrain(self, x_NAB, *, replicated=False):
    sharding = NamedSharding(self.mesh, P() if replicated else P(self.axes, None, None))
    if self.explicit:
      return jax.sharding.reshard(x_NAB, sharding)  # explicit-sharding meshes (make_mesh default)
    return jax.lax.with_sharding_constraint(x_NAB, sharding)


class MuonState(NamedTuple):
  """Plain-sum momentum, one buffer per Muon leaf (same shape; dtype `mu_dtype` or the param's)."""

  mu: optax.Updates


def newton_schulz(x, *, steps=5, coeffs=DEFAULT_NS_COEFFS, eps=1e-7, dtype=None):
  """Quintic Newton-Schulz orthogonalisation of the last two axes of `x` (leading axes batched).

  X0 = x / (||x||_F + eps) per matrix; wide orientation (A <= B) so the Gram XX^T is the small side;
  X <- a X + (b G + c G^2) X with G = X X^T. `dtype` is the iteration dtype (Moonshot uses bf16);
  the result has x's dtype.
  """
  a, b, c = coeffs
  x = _explicit_gather_matrix_axes(x)
  tall = x.shape[-2] > x.shape[-1]
  out_dtype = x.dtype
  x_MN = jnp.swapaxes(x, -1, -2) if tall else x
  x_MN = x_MN.astype(dtype or out_dtype)
  norm = jnp.sqrt(jnp.sum(jnp.square(x_MN.astype(jnp.float32)), axis=(-2, -1), keepdims=True))
  x_MN = x_MN / (norm + eps).astype(x_MN.dtype)

  def body(_, x_MN):
    g_MM = x_MN @ jnp.swapaxes(x_MN, -1, -2)
    return a * x_MN + (b * g_MM + c * (g_MM @ g_MM)) @ x_MN

  # A rolled loop: unrolling buys nothing here and costs memory (optax pitfall, reference §8.1).
  x_MN = jax.lax.fori_loop(0, steps, body, x_MN)
  x_MN = x_MN.astype(out_dtype)
  return jnp.swapaxes(x_MN, -1, -2) if tall else x_MN


def stacked_newton_schulz(tree, **ns):
  """`newton_schulz` of every leaf, same-shape matrices of different leaves in ONE batch.

  Leaves whose wide orientation ([..., A, B], A <= B) has the same shape, dtype and sharding are
  stacked on a new leading axis, so each NS product is one batched dot_general over all of them
  (e.g. an MoE layer's w_gate^T, w_up^T and w_down: [3, L, E, A, B]), not one per leaf. The stack
  adds an axis and moves no data between devices (batch and matrix axes keep their sharding).

  Stacking is a CPU measure (fewer, larger dots at the matmul rate). Compiling for TPU/GPU it is off:
  there XLA overlaps the per-leaf NS chains, and one stack of K2's 3 x 60 layers x 48 local experts
  holds every leaf's NS temporaries at once (XLA:TPU asked 226 GiB per chip for `1t` on v5p-1024).
  """
  leaves, treedef = jax.tree.flatten(tree)
  if sharding_lib.platform() != "cpu":
    return jax.tree.unflatten(treedef, [newton_schulz(x, **ns) for x in leaves])
  groups: dict = {}
  for i, x in enumerate(leaves):
    tall = x.shape[-2] > x.shape[-1]
    wide_shape = x.shape[:-2] + ((x.shape[-1], x.shape[-2]) if tall else x.shape[-2:])
    groups.setdefault((wide_shape, x.dtype, _wide_sharding(x, tall)), []).append((i, tall))
  out = list(leaves)
  for members in groups.values():
    if len(members) == 1:
      i, _ = members[0]
      out[i] = newton_schulz(leaves[i], **ns)
      continue
    wide = [jnp.swapaxes(leaves[i], -1, -2) if tall else leaves[i] for i, tall in members]
    ortho = newton_schulz(jnp.stack(wide), **ns)
    for j, (i, tall) in enumerate(members):
      out[i] = jnp.swapaxes(ortho[j], -1, -2) if tall else ortho[j]
  return jax.tree.unflatten(treedef, out)


def layout_newton_schulz(x, name: str, **ns):
  """`newton_schulz` of a stacked parameter leaf (`name` its dotted path, e.g. 'moe_layers.attn.w_o'),
  with whole matrices spread over the devices that hold its FSDP shards.

  Under an active k2jax mesh the leaf's layout follows from its logical axes
  (`model.transformer.param_logical_axes`) and the rules preset. Left to the partitioner, a matrix
  axis sharded over FSDP makes every device either compute the partial Gram X X^T of every matrix of
  the stack and all-reduce it (K2 1t experts on v5p-1024: f32[60, 48, 2048, 2048] = 45 GiB per
  device) or gather the whole stack (attention: [60, 7168, 8192]). Here, per device under
  `shard_map`, the local matrices of the stack (zero-padded to a multiple of f, the matrix axis's
  shard count: zero matrices stay zero through NS) are split into f groups, one all-to-all over those
  axes gives each device whole matrices of one group, NS runs on them and the inverse all-to-all
  restores the layout. Same function per matrix as `newton_schulz` (which no mesh, an unknown leaf,
  or a layout this does not cover keep; `scale_by_muon` uses this off CPU only).
  """
  ctx = sharding_lib.current()
  axes = transformer_lib.param_logical_axes().get(name)
  if ctx is None or axes is None or len(axes) != x.ndim or x.ndim < 3:
    return newton_schulz(x, **ns)
  spec = sharding_lib.logical_to_spec(axes, ctx.preset)
  sizes = dict(ctx.mesh.shape)
  mesh_axes = lambda d: sharding_lib.spec_mesh_axes(spec[d])  # noqa: E731
  sharded = [d for d in (x.ndim - 2, x.ndim - 1) if math.prod(sizes[a] for a in mesh_axes(d)) > 1]
  if len(sharded) > 1:
    return newton_schulz(x, **ns)
  f = math.prod(sizes[a] for d in sharded for a in mesh_axes(d))
  m_axis = spec[sharded[0]] if sharded else None

  def local(x):
    if not sharded:
      return newton_schulz(x, **ns)
    m = sharded[0] - (x.ndim - 3)  # the sharded matrix axis of [n, A, B]
    x_nAB = x.reshape(-1, *x.shape[-2:])
    n = x_nAB.shape[0]
    if n % f:
      x_nAB = jnp.concatenate([x_nAB, jnp.zeros((f - n % f, *x_nAB.shape[1:]), x_nAB.dtype)])
    whole = jax.lax.all_to_all(x_nAB, m_axis, 0, m, tiled=True)  # [n / f, A, B]: whole matrices
    o_nAB = jax.lax.all_to_all(newton_schulz(whole, **ns), m_axis, m, 0, tiled=True)
    return o_nAB[:n].reshape(x.shape)

  return jax.shard_map(local, mesh=ctx.mesh, in_specs=spec, out_specs=spec)(x)


def _wide_sharding(x, tall: bool):
  """Hashable (mesh, spec) of x's sharding in the wide orientation (matrix axes swapped if tall)."""
  sharding = jax.typeof(x).sharding
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return None
  spec = tuple(spec) + (None,) * (x.ndim - len(spec))
  if tall:
    spec = spec[:-2] + (spec[-1], spec[-2])
  mesh = getattr(sharding, "mesh", None)
  return (tuple(getattr(mesh, "shape", {}).items()) if mesh is not None else None, spec)


def _explicit_gather_matrix_axes(x):
  """On an explicit-sharding mesh, gather the matrix axes (batch axes keep their sharding).

  NS contracts over both matrix axes, which explicit mode refuses to partition implicitly; under
  GSPMD (AxisType.Auto) the partitioner decides and this is a no-op.
  """
  sharding = jax.typeof(x).sharding
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not mesh.axis_names or not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return x
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  if spec[-2:] == (None, None):
    return x
  return jax.sharding.reshard(x, P(*spec[:-2], None, None))


def shape_scale(shape, rms_scale: float) -> float:
  """Moonshot's per-matrix update scale rms_scale * sqrt(max(A, B)) (batch axes excluded)."""
  return rms_scale * math.sqrt(max(shape[-2], shape[-1]))


def scale_by_muon(
  *,
  momentum=0.95,
  nesterov=True,
  ns_steps=5,
  ns_coeffs=DEFAULT_NS_COEFFS,
  ns_eps=1e-7,
  ns_dtype=None,
  rms_scale=0.2,
  rms_mode="shape",
  mu_dtype=None,
  owners: OwnerSharding | None = None,
  layout: bool = False,
) -> optax.GradientTransformation:
  """Muon direction (see module docstring); leaves are [..., A, B] matrices with batch axes.

  Args:
    momentum: mu of the plain-sum momentum.
    nesterov: feed mu * M_t + G_t (True, Moonlight/Keller) or M_t to Newton-Schulz.
    ns_steps, ns_coeffs, ns_eps, ns_dtype: Newton-Schulz settings (see `newton_schulz`).
    rms_scale: target update RMS.
    rms_mode: 'shape' scales by rms_scale * sqrt(max(A, B)) (Moonshot; exact only for an exactly
      orthogonal O: the 5-step quintic leaves singular values in ~[0.7, 1.2] and the realised RMS
      ~10-18% below rms_scale); 'measured' divides by the realised RMS of each matrix so every update
      has RMS exactly rms_scale (ML §3.1 "Update Norm"; one extra reduction per matrix).
    mu_dtype: momentum dtype (default: the gradient's).
    owners: if given, distribute whole matrices over devices for NS (`OwnerSharding`).
    layout: compiling for TPU/GPU under a k2jax mesh, run NS leaf by leaf on whole matrices spread over
      the devices by the model's parameter layout (`layout_newton_schulz`); CPU keeps the stacked NS.
  """
  if rms_mode not in ("shape", "measured"):
    raise ValueError(f"rms_mode must be 'shape' or 'measured', got {rms_mode!r}")

  def init_fn(params):
    return MuonState(mu=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype or p.dtype), params))

  def update_fn(updates, state, params=None):
    del params
    mu = jax.tree.map(lambda m, g: (momentum * m + g).astype(m.dtype), state.mu, updates)
    ns_in = jax.tree.map(lambda m, g: momentum * m + g, mu, updates) if nesterov else mu
    ns = dict(steps=ns_steps, coeffs=ns_coeffs, eps=ns_eps, dtype=ns_dtype)
    if layout and owners is None and sharding_lib.platform() != "cpu":
      ortho = jax.tree_util.tree_map_with_path(lambda p, x: layout_newton_schulz(x, path_name(p), **ns), ns_in)
    elif owners is None:
      ortho = stacked_newton_schulz(ns_in, **ns)
    else:
      ortho = _owner_newton_schulz(ns_in, owners, ns)
    out = jax.tree.map(lambda o, g: _rescale(o, rms_scale, rms_mode).astype(g.dtype), ortho, updates)
    return out, MuonState(mu=mu)

  return optax.GradientTransformation(init_fn, update_fn)


def _rescale(o, rms_scale, rms_mode):
  if rms_mode == "shape":
    return o * shape_scale(o.shape, rms_scale)
  rms = jnp.sqrt(jnp.mean(jnp.square(o.astype(jnp.float32)), axis=(-2, -1), keepdims=True))
  return o * (rms_scale / jnp.maximum(rms, 1e-30)).astype(o.dtype)


def _owner_newton_schulz(tree, owners: OwnerSharding, ns):
  """NS with same-(A, B)-shape matrices stacked into [N, A, B] and sharded on N over the owners."""
  leaves, treedef = jax.tree.flatten(tree)
  groups: dict = {}
  for i, x in enumerate(leaves):
    groups.setdefault((x.shape[-2:], x.dtype), []).append(i)
  out = list(leaves)
  for (ab, _), idx in groups.items():
    pieces = [leaves[i].reshape((-1,) + ab) for i in idx]
    if owners.explicit:  # explicit mode concatenates only equally sharded operands
      pieces = [owners.constrain(x, replicated=True) for x in pieces]
    stack_NAB = jnp.concatenate(pieces, axis=0)
    n = stack_NAB.shape[0]
    pad = -n % owners.n_owners
    if pad:  # zero matrices stay zero through NS (x / (0 + eps) = 0): padding is inert
      stack_NAB = jnp.concatenate([stack_NAB, jnp.zeros((pad,) + ab, stack_NAB.dtype)], axis=0)
    ortho_NAB = owners.constrain(newton_schulz(owners.constrain(stack_NAB), **ns))
    # Back to every leaf's layout: one all-gather of the orthogonalised stack (the volume of
    # Moonlight's gather of the inputs, ML §2.3), explicit so GSPMD need not guess a slice reshard.
    ortho_NAB = owners.constrain(ortho_NAB, replicated=True)
    start = 0
    for i in idx:
      count = math.prod(leaves[i].shape[:-2])
      out[i] = ortho_NAB[start : start + count].reshape(leaves[i].shape)
      start += count
  return jax.tree.unflatten(treedef, out)
