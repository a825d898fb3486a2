"""Meshes and sharding rules: logical axis names -> the mesh axes `stage, data, fsdp, expert, tensor`.

`stage` is the pipeline axis (k2jax.model.pipeline): no logical name maps to it; the pipeline spreads its
stages over it and the trainer shards a pipelined stack's layers over it (k2jax.train.partition).

Sharding is declared once: every model variable carries `axes` metadata (logical names, e.g.
('layers', 'experts', 'embed', 'expert_mlp')); a named rules preset maps each logical name to mesh
axes; activations are constrained through `constrain(x, names)`. Presets (each a complete table):

  fsdp         weights' `embed` dim over fsdp; the batch over every axis (expert, tensor act as data)
  fsdp_ep      + routed experts over `expert` (tokens travel by all-to-all, expert_parallel.py)
  fsdp_ep_tp   + heads, FFN widths and vocab over `tensor` (Megatron-style column/row split)

Context-parallel presets (`*_cp`): the same tables, plus the sequence (`act_length`) sharded over the
`expert` axis everywhere outside the MoE core (k2jax/model/context_parallel.py):

  fsdp_cp      fsdp + sequence over `expert` (experts replicated: no EP)
  fsdp_ep_cp   fsdp_ep + sequence over `expert`: the EP devices are the CP devices (MaxText's ep-as-cp)
  fsdp_ep_tp_cp  fsdp_ep_tp + sequence over `expert`

Why the expert axis plays context, not a new `context` mesh axis: outside the MoE core the expert axis
only splits the batch (no attention weight is sharded over it), so turning that split from rows into
sequence chunks moves no weight bytes and keeps the MoE exactly as it was: a token is routed from the
device that holds it, over the same all-to-all group. A separate `context` axis of size c at the same
device count must either replicate the routed experts c times (K2: 1T parameters, c x the expert memory)
or shard experts over (context, expert), which is this layout with a larger all-to-all group (MaxText's
cp-as-ep). The CP axis is a property of the rules (`act_length`), so another axis is a one-line rule.

Serving presets (the inference engine's layout, chosen independently of the trainer's; no FSDP: every
weight is whole on the devices that use it, so a decode step gathers no weights):

  tp           heads, FFN widths, expert widths and vocab over `tensor`; experts replicated; requests
               (cache slots, tokens) over `data`
  ep           routed experts over `expert`; attention data parallel: requests over `data, expert`
               (SGLang's DP attention + EP MoE for DeepSeek)
  tp_ep        both: heads and widths over `tensor`, experts over `expert`, requests over `data, expert`

MLA caches one latent per token shared by all heads, so no preset shards the KV cache by heads: it is
sharded by request (cache slot) over the `act_batch` axes and replicated over `tensor`.

Usage:
  mesh = make_mesh({"fsdp": -1, "expert": 4})           # -1: the rest of the devices
  shard_model(model, mesh, "fsdp_ep")
  with use(mesh, "fsdp_ep"):                            # active for tracing: MoE takes the EP path
    out = jitted_forward(...)

The active (mesh, preset) is read at trace time. jax puts the mesh of `jax.set_mesh` in jit's cache
key but not the preset, so trace a jitted function once per preset (a fresh `jax.jit` per preset).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Outermost first: `stage` before `data` (MaxText's order), so consecutive stages sit on different hosts.
MESH_AXES = ("stage", "data", "fsdp", "expert", "tensor")

PARAM_AXES = (
  "layers",
  "vocab",
  "embed",
  "q_lora",
  "q_heads",
  "kv_lora_rope",
  "kv_lora",
  "kv_heads",
  "o_heads",
  "mlp",
  "shared_mlp",
  "experts",
  "experts_router",
  "expert_mlp",
)
# Activations: act_batch is the (flattened) token/batch dim, the rest are feature dims.
# act_kv_length: a key sequence gathered over the context axis: never sharded, but it keeps act_batch off
# the context axis (MaxText's activation_kv_length).
ACT_AXES = ("act_batch", "act_length", "act_kv_length", "act_embed", "act_heads", "act_mlp", "act_vocab")
LOGICAL_AXES = PARAM_AXES + ACT_AXES

# FSDP shards every large matrix on one dim: `embed` where it has one, else the LoRA rank (w_q_b,
# w_kv_b are [rank, heads*dim]; [L, 1536, 12288] x 60 layers is 4.5 GB in float32 for K2).
_BASE = {name: None for name in LOGICAL_AXES}
_FSDP = {**_BASE, "embed": ("fsdp",), "q_lora": ("fsdp",), "kv_lora": ("fsdp",)}
RULES: dict[str, dict[str, tuple[str, ...] | None]] = {
  "fsdp": {**_FSDP, "act_batch": ("data", "fsdp", "expert", "tensor")},
  "fsdp_ep": {**_FSDP, "experts": ("expert",), "act_batch": ("data", "fsdp", "expert", "tensor")},
  "fsdp_ep_tp": {
    **_FSDP,
    "experts": ("expert",),
    "vocab": ("tensor",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "o_heads": ("tensor",),
    "mlp": ("tensor",),
    "shared_mlp": ("tensor",),
    "expert_mlp": ("tensor",),
    "act_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_batch": ("data", "fsdp", "expert"),
  },
}
_TP = {
  "vocab": ("tensor",),
  "q_heads": ("tensor",),
  "kv_heads": ("tensor",),
  "o_heads": ("tensor",),
  "mlp": ("tensor",),
  "shared_mlp": ("tensor",),
  "expert_mlp": ("tensor",),
  "act_heads": ("tensor",),
  "act_mlp": ("tensor",),
  "act_vocab": ("tensor",),
}
# Context parallelism: `act_length` claims the CP axis before `act_batch` (logical_to_spec), so a [B, T]
# activation has B over the other batch axes and T over the CP axis, while a flat [N] token dim (the MoE's)
# keeps every batch axis. The CP axis is last in act_batch: a device's N block is then its own [B, T]
# block flattened (context_parallel.tokens_to_rows).
CP_AXIS = "expert"
RULES.update(
  fsdp_cp={**RULES["fsdp"], "act_batch": ("data", "fsdp", "tensor", CP_AXIS), "act_length": (CP_AXIS,)},
  fsdp_ep_cp={**RULES["fsdp_ep"], "act_batch": ("data", "fsdp", "tensor", CP_AXIS), "act_length": (CP_AXIS,)},
  fsdp_ep_tp_cp={**RULES["fsdp_ep_tp"], "act_length": (CP_AXIS,)},
)
SERVING_PRESETS = ("tp", "ep", "tp_ep")
RULES.update(
  tp={**_BASE, **_TP, "act_batch": ("data",)},
  ep={**_BASE, "experts": ("expert",), "act_batch": ("data", "expert")},
  tp_ep={**_BASE, **_TP, "experts": ("expert",), "act_batch": ("data", "expert")},
)


class ShardingError(ValueError):
  """A mesh shape, preset or tensor dimension does not fit; the message names it."""


def _check_rules():
  for name, table in RULES.items():
    missing, extra = set(LOGICAL_AXES) - set(table), set(table) - set(LOGICAL_AXES)
    if missing or extra:
      raise ShardingError(f"rules preset {name!r}: missing {sorted(missing)}, unknown {sorted(extra)}")
    for logical, axes in table.items():
      if axes is not None and not set(axes) <= set(MESH_AXES):
        raise ShardingError(f"rules preset {name!r}: {logical} -> {axes} names a non-mesh axis")


_check_rules()


def rules(preset: str) -> dict[str, tuple[str, ...] | None]:
  if preset not in RULES:
    raise ShardingError(f"unknown sharding rules preset {preset!r}; known: {sorted(RULES)}")
  return RULES[preset]


# ----------------------------------------------------------------------------------------- meshes
def resolve_mesh_shape(mesh_shape: Mapping[str, int] | Sequence[int], num_devices: int) -> dict[str, int]:
  """{axis: size} for every mesh axis; a dict may omit axes (size 1); one size may be -1 (the rest)."""
  if isinstance(mesh_shape, Mapping):
    unknown = set(mesh_shape) - set(MESH_AXES)
    if unknown:
      raise ShardingError(f"mesh_shape: unknown axes {sorted(unknown)}; the mesh axes are {MESH_AXES}")
    shape = {a: int(mesh_shape.get(a, 1)) for a in MESH_AXES}
  else:
    if len(mesh_shape) != len(MESH_AXES):
      raise ShardingError(f"mesh_shape: {tuple(mesh_shape)} needs {len(MESH_AXES)} sizes {MESH_AXES}")
    shape = dict(zip(MESH_AXES, (int(s) for s in mesh_shape)))
  rest = [a for a, s in shape.items() if s == -1]
  bad = [a for a, s in shape.items() if s == 0 or s < -1]
  if bad or len(rest) > 1:
    raise ShardingError(f"mesh_shape {shape}: sizes must be >= 1 with at most one -1")
  known = math.prod(s for s in shape.values() if s != -1)
  if rest:
    if num_devices % known:
      raise ShardingError(
        f"mesh_shape {shape}: {num_devices} devices are not divisible by {known}, "
        f"so '{rest[0]}': -1 has no integer size"
      )
    shape[rest[0]] = num_devices // known
  if math.prod(shape.values()) != num_devices:
    raise ShardingError(f"mesh_shape {shape}: product {math.prod(shape.values())} != {num_devices} devices")
  return shape


def make_mesh(
  mesh_shape: Mapping[str, int] | Sequence[int], devices=None, *, dcn_shape: Mapping[str, int] | None = None
) -> Mesh:
  """A `jax.sharding.Mesh` with axes MESH_AXES over `devices` (default: all).

  `dcn_shape` ({axis: slices}, product = the number of slices) adds a level over the data-center network: each
  axis's size is then `mesh_shape[a] * dcn_shape[a]`, `mesh_shape` laid out inside each slice (ICI) and
  `dcn_shape` across slices (jax's hybrid device mesh), so only the axes named in `dcn_shape` cross DCN."""
  devices = jax.devices() if devices is None else list(devices)
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  slices = dcn_slices(dcn_shape)
  from jax.experimental import mesh_utils  # noqa: PLC0415

  if slices == 1:
    shape = resolve_mesh_shape(mesh_shape, len(devices))
    sizes = tuple(shape[a] for a in MESH_AXES)
    try:
      return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
      # jax.make_mesh splits a physical axis only on v5e: on a v5p 8x8x8 torus a 32-way axis (1t_128k's context
      # degree) needs one, and the topology-aware mapper lays it out when allowed to.
      grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
      return Mesh(grid, MESH_AXES, axis_types=axis_types)

  granules = slice_count(devices)
  if granules != slices:
    raise ShardingError(
      f"mesh dcn_shape {dict(dcn_shape)}: {slices} slices asked for, the devices form {granules} "
      f"({'slice_index' if _has_slice_index(devices) else 'process'} groups); a DCN level needs one slice per "
      "entry of the DCN product"
    )
  ici = resolve_mesh_shape(mesh_shape, len(devices) // slices)
  dcn = {a: int(dcn_shape.get(a, 1)) for a in MESH_AXES}
  grid = mesh_utils.create_hybrid_device_mesh(
    tuple(ici[a] for a in MESH_AXES),
    tuple(dcn[a] for a in MESH_AXES),
    devices,
    process_is_granule=not _has_slice_index(devices),
    # As make_mesh above on one slice: an ICI axis may span part of a physical axis (fsdp 128 on 16x16).
    allow_split_physical_axes=True,
  )
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def mesh_text(sizes: Mapping[str, int]) -> str:
  """'data=1,fsdp=64,expert=8,tensor=1' for reports: every axis, `stage` only when pipelining (size > 1)."""
  return ",".join(f"{a}={n}" for a, n in sizes.items() if a != "stage" or n != 1)


def dcn_slices(dcn_shape: Mapping[str, int] | None) -> int:
  """The number of slices a DCN shape spans (1: no DCN level); unknown axes and sizes < 1 are refused."""
  if not dcn_shape:
    return 1
  unknown = set(dcn_shape) - set(MESH_AXES)
  if unknown or any(int(v) < 1 for v in dcn_shape.values()):
    raise ShardingError(f"dcn_shape {dict(dcn_shape)}: axes must be in {MESH_AXES} with sizes >= 1")
  return math.prod(int(v) for v in dcn_shape.values())


def _has_slice_index(devices) -> bool:
  """TPU devices name their slice (`slice_index`); CPU devices of several processes say 0 for all."""
  return all(d.platform == "tpu" and getattr(d, "slice_index", None) is not None for d in devices)


def slice_count(devices) -> int:
  """Slices among `devices`: distinct `slice_index` values (TPU), else distinct processes (the granule jax's
  hybrid mesh falls back to: one process per slice)."""
  if _has_slice_index(devices):
    return len({d.slice_index for d in devices})
  return len({d.process_index for d in devices})


# ------------------------------------------------------------------------------ logical -> spec
def logical_to_spec(names: Sequence[str | None], preset: str) -> P:
  """PartitionSpec for one array with logical axis `names` (None = never sharded).

  A mesh axis shards at most one dimension: a later dimension whose rule names an already used mesh
  axis drops it (e.g. `act_batch` takes `tensor` only where no feature dim does).
  """
  table, used, out = rules(preset), set(), [None] * len(names)
  for name in names:
    if name is not None and name not in table:
      raise ShardingError(f"logical axis {name!r} has no rule in preset {preset!r}; known: {sorted(table)}")
  # The sequence dim takes the context-parallel axis first (a gathered key sequence reserves it unsharded);
  # then the others in order.
  first = ("act_length", "act_kv_length")
  order = [i for i, n in enumerate(names) if n in first] + [i for i, n in enumerate(names) if n not in first]
  for i in order:
    if names[i] is None:
      continue
    if names[i] == "act_kv_length":
      used.update(table["act_length"] or ())
      continue
    axes = tuple(a for a in (table[names[i]] or ()) if a not in used)
    used.update(axes)
    out[i] = None if not axes else axes[0] if len(axes) == 1 else axes
  return P(*out)


def spec_mesh_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, 'x' or ('x', 'y'))."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def check_divisible(shape, spec: P, mesh_sizes: Mapping[str, int], what: str) -> None:
  for dim, (size, entry) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
    n = math.prod(mesh_sizes[a] for a in spec_mesh_axes(entry))
    if size % n:
      raise ShardingError(
        f"{what}: dim {dim} of shape {tuple(shape)} (size {size}) is not divisible "
        f"by mesh axes {spec_mesh_axes(entry)} of total size {n}"
      )


def _path_name(path) -> str:
  """'moe_layers.moe.experts.w_gate' for a key path (a trailing nnx `.value` key is dropped)."""
  parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  return ".".join(parts[:-1] if len(parts) > 1 and parts[-1] == "value" else parts)


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def param_specs(state, preset: str):
  """`state` (nnx.State, abstract or concrete) with each Variable's value replaced by its PartitionSpec."""

  def spec(path, var):
    axes = var.get_metadata().get("axes")
    if axes is None:
      raise ShardingError(f"{_path_name(path)}: variable has no `axes` metadata")
    if len(axes) != len(var.get_value().shape):
      raise ShardingError(f"{_path_name(path)}: axes {axes} do not match shape {var.get_value().shape}")
    return var.replace(logical_to_spec(axes, preset))

  return jax.tree_util.tree_map_with_path(spec, state, is_leaf=_is_var)


def param_shardings(abstract_state, mesh: Mesh, preset: str):
  """Tree like `abstract_state` whose Variables hold `NamedSharding`s; checks divisibility per tensor."""
  sizes = dict(mesh.shape)

  def sharding(path, var):
    spec = logical_to_spec(var.get_metadata()["axes"], preset)
    check_divisible(var.get_value().shape, spec, sizes, _path_name(path))
    return var.replace(NamedSharding(mesh, spec))

  param_specs(abstract_state, preset)  # validates metadata first, with clear errors
  return jax.tree_util.tree_map_with_path(sharding, abstract_state, is_leaf=_is_var)


def shard_model(model: nnx.Module, mesh: Mesh, preset: str) -> nnx.Module:
  """Moves every variable of `model` to its sharding under `preset` (in place); returns `model`."""
  state = nnx.state(model)
  shardings = param_shardings(state, mesh, preset)
  if jax.process_count() == 1:
    nnx.update(model, jax.device_put(state, shardings))
    return model
  # Multi-process: every process holds the same full values; each places only its own shards.
  place = lambda x, s: jax.make_array_from_callback(  # noqa: E731
    x.shape, s, lambda idx, x=np.asarray(x): x[idx]
  )
  nnx.update(model, jax.tree.map(place, state, shardings))
  return model


def dump_partition_specs(abstract_state, preset: str) -> str:
  """`path shape spec` lines for every variable: the reviewable golden of a preset's layout."""
  lines = []
  leaves = jax.tree_util.tree_flatten_with_path(param_specs(abstract_state, preset), is_leaf=_is_var)[0]
  shapes = dict(
    (_path_name(p), v.get_value().shape)
    for p, v in jax.tree_util.tree_flatten_with_path(abstract_state, is_leaf=_is_var)[0]
  )
  for path, var in leaves:
    name = _path_name(path)
    lines.append(f"{name} {tuple(shapes[name])} {var.get_value()}")
  return "\n".join(sorted(lines)) + "\n"


def opt_state_shardings(abstract_opt_state, abstract_params, mesh: Mesh, preset: str):
  """NamedShardings for an optimizer state (e.g. `jax.eval_shape(opt.init, params)`).

  A state leaf whose path ends with a parameter's path and has its shape (momentum, Adam moments)
  gets that parameter's sharding; every other leaf (step counts, scalars) is replicated. Pass the
  result as `out_shardings` of the jitted `opt.init`: zeros have no data to propagate from.
  """
  by_name = {}
  for path, var in jax.tree_util.tree_flatten_with_path(
    param_shardings(abstract_params, mesh, preset), is_leaf=_is_var
  )[0]:
    by_name[_path_name(path)] = var.get_value()
  shapes = {_path_name(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}

  def one(path, x):
    name = _path_name(path)
    for pname, sharding in by_name.items():
      if (name == pname or name.endswith("." + pname)) and tuple(shapes[pname]) == tuple(x.shape):
        return sharding
    return NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def batch_sharding(mesh: Mesh, preset: str, ndim: int = 2) -> NamedSharding:
  """Sharding of a [B, T, ...] input batch (token ids, segment ids, positions): rows over the batch axes,
  and under a context-parallel preset the sequence over the CP axis (ndim >= 2)."""
  names = ("act_batch",) if ndim == 1 else ("act_batch", "act_length") + (None,) * (ndim - 2)
  return NamedSharding(mesh, logical_to_spec(names, preset))


# ------------------------------------------------------------------------------ active context
@dataclasses.dataclass(frozen=True)
class Context:
  mesh: Mesh
  preset: str

  @property
  def rules(self) -> dict[str, Any]:
    return rules(self.preset)

  def axis_size(self, logical: str) -> int:
    return math.prod(self.mesh.shape[a] for a in (self.rules[logical] or ()))

  @property
  def context_axis(self) -> str | None:
    """The mesh axis that shards the sequence (context parallelism), or None when it has size 1."""
    return context_axis(self.mesh, self.preset)


def context_axis(mesh: Mesh, preset: str) -> str | None:
  """The context-parallel mesh axis of (mesh, preset): its `act_length` axis when larger than 1, else None."""
  axes = rules(preset)["act_length"] or ()
  if len(axes) > 1:
    raise ShardingError(f"rules preset {preset!r}: act_length -> {axes}; context parallelism takes one mesh axis")
  return axes[0] if axes and mesh.shape[axes[0]] > 1 else None


_CTX: contextvars.ContextVar[Context | None] = contextvars.ContextVar("k2jax_sharding", default=None)


@contextlib.contextmanager
def use(mesh: Mesh, preset: str):
  """Makes (mesh, preset) active for tracing (`constrain`, the MoE dispatch) and `jax.set_mesh`."""
  rules(preset)
  if tuple(mesh.axis_names) != MESH_AXES:
    raise ShardingError(f"mesh axes {tuple(mesh.axis_names)} are not {MESH_AXES}; build it with make_mesh")
  token = _CTX.set(Context(mesh, preset))
  try:
    with jax.set_mesh(mesh):
      yield
  finally:
    _CTX.reset(token)


def current() -> Context | None:
  """The active context, or None when no mesh is active or the mesh has a single device."""
  ctx = _CTX.get()
  return ctx if ctx is not None and ctx.mesh.size > 1 else None


def platform(target=None) -> str:
  """'cpu', 'gpu' or 'tpu': the platform a computation is compiled for, to choose kernels by.

  `target` is a Mesh or a sequence of devices; by default the active k2jax mesh (`use`, any size), else
  jax's active (abstract) mesh (`jax.set_mesh`, also inside `jit`), else jax's default backend.
  Ahead-of-time compilation for a TPU topology from a CPU host traces under a mesh of TPU devices while
  `jax.default_backend()` says 'cpu': kernels follow the mesh.
  """
  if target is None and _TARGET.get() is not None:
    return _TARGET.get()
  if target is None:
    ctx = _CTX.get()
    if ctx is not None:
      target = ctx.mesh
    else:
      abstract = jax.sharding.get_abstract_mesh()
      device = None if abstract.empty else getattr(abstract, "abstract_device", None)
      return _platform_name(getattr(device, "platform", None) or jax.default_backend())
  devices = target.devices.flat if isinstance(target, Mesh) else target
  kinds = {_platform_name(d.platform) for d in devices}
  if len(kinds) != 1:
    raise ShardingError(f"platform: devices span platforms {sorted(kinds)}; one mesh must be one platform")
  return kinds.pop()


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("k2jax_target_platform", default=None)
PLATFORMS = ("cpu", "gpu", "tpu")


@contextlib.contextmanager
def target_platform(name: str):
  """Traces inside choose kernels for `name` ('cpu' | 'gpu' | 'tpu'), whatever devices this host has.

  For cross-compiles from a host without that accelerator: `jax.jit(f).trace(...).lower(
  lowering_platforms=("cuda",))` or `jax.export(..., platforms=["cuda"])` of the GPU program on a CPU host
  (tests, export checks). A TPU ahead-of-time compile needs none of it: its mesh's devices say 'tpu'.
  """
  if name not in PLATFORMS:
    raise ValueError(f"target_platform: one of {PLATFORMS}, got {name!r}")
  token = _TARGET.set(name)
  try:
    with contextlib.ExitStack() as stack:
      stack.enter_context(_abstract_gpu())
      for hook in _CROSS_COMPILE_HOOKS:
        stack.enter_context(hook())
      yield
  finally:
    _TARGET.reset(token)


# The GPU a cross-compile lowers for when this host has none. jax >= 0.11 asks Pallas' Triton lowering for the
# GPU's kind (its compute capability picks the Triton target), from an abstract device when no GPU is present
# ("No supported GPU devices found, please specify an abstract GPU device"); jax 0.10 lowered without one.
CROSS_COMPILE_GPU_KIND = "NVIDIA H100 80GB HBM3"


def _gpu_device():
  """The abstract GPU a cross-compile lowers for where jax asks for one (jax >= 0.11, no GPU attached), or None."""
  if jax.__version_info__ < (0, 11) or jax.default_backend() == "gpu" or _TARGET.get() != "gpu":
    return None
  from jax._src.mesh import AbstractDevice  # not public in jax 0.11; its error message names it as the way

  return AbstractDevice(device_kind=CROSS_COMPILE_GPU_KIND, num_cores=None, platform="cuda")


def _abstract_gpu():
  """A one-device abstract mesh of the cross-compile's GPU around a cross-compile (jax >= 0.11), else nothing."""
  device = _gpu_device()
  if device is None:
    return contextlib.nullcontext()
  # Auto axes: the device is all this mesh is for, not sharding-in-types (Explicit axes need every op's
  # out_sharding rule; ragged_dot has none).
  mesh = jax.sharding.AbstractMesh((1,), ("_cross_compile",), (jax.sharding.AxisType.Auto,), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


# Context managers entered for the whole of a `target_platform` block: kernel libraries that check this
# host's devices at trace time (tokamax) turn that check off in them. The whole block, because a custom
# VJP's backward kernels are traced later than its forward, when `jax.grad` transposes.
_CROSS_COMPILE_HOOKS: list = []


def register_cross_compile_hook(hook) -> None:
  """Adds `hook() -> context manager` to what every `target_platform` block enters (idempotent)."""
  if hook not in _CROSS_COMPILE_HOOKS:
    _CROSS_COMPILE_HOOKS.append(hook)


def cross_compiling() -> bool:
  """Whether a `target_platform` override is active (kernels must not check this host's devices)."""
  return _TARGET.get() is not None


def _platform_name(p: str) -> str:
  return "gpu" if p in ("cuda", "rocm", "gpu") else p


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` of activation `x` by logical `names`; identity with no active mesh."""
  ctx = current()
  if ctx is None:
    return x
  if len(names) != x.ndim:
    raise ShardingError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
  spec = logical_to_spec(names, ctx.preset)
  check_divisible(x.shape, spec, dict(ctx.mesh.shape), f"activation {tuple(names)}")
  return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))
