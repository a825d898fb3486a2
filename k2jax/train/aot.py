"""Compile the real train step for a TPU slice on a host without TPUs: `launch/train.py --aot=v5p-1024`.

The step is `loop.make_step`'s, the one `run()` jits (`core.Layout.jitted`), traced under a mesh over the slice's
compile-only devices (`jax.experimental.topologies`, needs libtpu: `pip install -e '.[tpu]'`), so
every kernel choice follows the TPU target (`sharding.platform`). XLA:TPU then reports per-device
memory (`memory_analysis`), and the compiled HLO gives collective bytes and matmul FLOPs per step
(`hlo_stats`). A step that does not fit fails XLA's own HBM check at compile time; its message gives
the bytes required, reported as `fits=false`.

  r = compile_step(get_config("1t"), "v5p-1024")
  print(format_report(r))        # key=value lines, ending in fits=true|false
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import jax
import jax.numpy as jnp
from ml_collections import config_dict

from k2jax import memory, sharding
from k2jax.train import hlo_stats
from k2jax.model.config import ConfigError
from k2jax.train.config import TrainConfig, check_runtime, from_config_dict, pipeline_spec
from k2jax.train.step import BATCH_KEYS

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  """A TPU slice as libtpu names it, plus the HBM per device that XLA:TPU compiles against."""

  topology: str  # libtpu topology, e.g. 'v5:8x8x8' (chips per axis)
  chip_config: str  # 'megacore': one JAX device per chip with two TensorCores (v4, v5p)
  num_devices: int
  hbm_bytes: int  # XLA's per-device limit, read from its CompileTimeHbmOom message ("available HBM")
  wrap: tuple[bool, bool, bool] = (False, False, False)  # wraparound links per axis (a torus where True)

  @property
  def wiring(self) -> str:
    """'torus' (every axis wraps), 'mesh' (none does) or the axes that wrap, e.g. 'wrap=y'."""
    if all(self.wrap[: self.topology.count("x") + 1]):
      return "torus"
    return "mesh" if not any(self.wrap) else "wrap=" + "".join(a for a, w in zip("xyz", self.wrap) if w)


# XLA:TPU's available HBM per device (libtpu 0.0.50): v5p 95.73 GiB, v6e 31.24, v5e 15.75, v4 30.75.
_HBM = {"v5": 95.73, "v6e": 31.24, "v5e": 15.75, "v4": 30.75}
# Slice shapes (chips per axis) of the Cloud TPU accelerator types; vN-C counts TensorCores on v4/v5p.
_SHAPES_3D = {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8", 512: "4x8x8"}
_SHAPES_3D |= {1024: "8x8x8", 2048: "8x8x16", 4096: "8x16x16", 8192: "16x16x16"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


def _wrap(shape: str) -> tuple[bool, bool, bool]:
  """Which axes of a slice have wraparound links, as Cloud TPU wires them (MaxText's
  `accelerator_to_spec_map.py` gives the same table): a v4/v5p slice of a full 4x4x4 cube or more is a 3D
  torus and anything smaller has no wraparound; a v5e/v6e axis wraps only when it spans the whole 16-chip
  side of the pod (8x16: y; 16x16: x and y). XLA's collectives route over the wrap links, so a compile
  without them plans a slower, different program (`get_topology_desc(..., wrap=...)`)."""
  dims = [int(d) for d in shape.split("x")]
  if len(dims) == 3:
    return (True, True, True) if min(dims) >= 4 else (False, False, False)
  return (dims[0] == 16, dims[1] == 16, False)


def tpu_slice(name: str) -> TpuSlice:
  """'v5p-1024' | 'v4-128' | 'v6e-256' | 'v5e-64' -> TpuSlice (a clear error for anything else)."""
  m = re.fullmatch(r"(v5p|v4|v6e|v5e|v5litepod)-(\d+)", name)
  if m:
    gen, n = ("v5e" if m.group(1) == "v5litepod" else m.group(1)), int(m.group(2))
    if gen in ("v5p", "v4") and n in _SHAPES_3D:
      chip = "v5" if gen == "v5p" else "v4"
      shape = _SHAPES_3D[n]
      return TpuSlice(f"{chip}:{shape}", "megacore", n // 2, int(_HBM[chip] * GIB), _wrap(shape))
    if gen in ("v6e", "v5e") and n in _SHAPES_2D:
      shape = _SHAPES_2D[n]
      return TpuSlice(f"{gen}:{shape}", "default", n, int(_HBM[gen] * GIB), _wrap(shape))
  known = [f"v5p-{n}" for n in _SHAPES_3D] + [f"v4-{n}" for n in _SHAPES_3D]
  known += [f"{g}-{n}" for g in ("v6e", "v5e") for n in _SHAPES_2D]
  raise ValueError(f"--aot: unknown TPU slice {name!r}; known: {', '.join(known)}")


def parse_target(name: str) -> tuple[int, TpuSlice]:
  """'v5p-1024' -> (1, its TpuSlice); '2xv5p-1024' -> (2, ...): that many slices joined over DCN."""
  m = re.fullmatch(r"(\d+)x(.+)", name)
  n = int(m.group(1)) if m else 1
  if n < 1:
    raise ValueError(f"--aot: {name!r} names {n} slices")
  return n, tpu_slice(m.group(2) if m else name)


def slice_devices(s: TpuSlice, num_slices: int = 1) -> list:
  """Compile-only devices of `num_slices` slices `s`, wired as the hardware is (`s.wrap`; no TPU needed, libtpu
  must import); with several, each device's `slice_index` names its slice."""
  # Compiling only: another process holding libtpu's lockfile (a TPU job, a second compile) is fine.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # noqa: PLC0415 (initialises the TPU plugin)

  bounds = (1, 1, 1) if s.num_devices == 1 else (2, 2, 1)
  desc = topologies.get_topology_desc(
    s.topology, "tpu", chip_config_name=s.chip_config, chips_per_host_bounds=bounds, num_slices=num_slices, wrap=s.wrap
  )
  return list(desc.devices)


def libtpu_available() -> str | None:
  """None when libtpu imports, else why not (tests skip with this)."""
  try:
    import libtpu  # noqa: F401, PLC0415
  except ImportError as e:
    return (
      f"libtpu does not import ({e}); install jax[tpu] (Python >= 3.12 for jax 0.12 wheels): pip install -e '.[tpu]'"
    )
  return None


def _abstract_batch(tc: TrainConfig, batch_sharding) -> dict:
  shape = (tc.data.global_batch_size, tc.data.seq_len)
  return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding) for k in BATCH_KEYS}


def _abstract_with_shardings(abstract, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def shard_bytes(tree, memory_kind: str = "device") -> int:
  """Per-device bytes of the leaves of a tree of ShapeDtypeStructs with NamedShardings in `memory_kind`."""
  total = 0
  for x in jax.tree.leaves(tree):
    if (x.sharding.memory_kind or "device") != memory_kind:
      continue
    shard = x.sharding.shard_shape(x.shape)
    total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
  return total


def compile_step(config: config_dict.ConfigDict, slice_name: str, *, keep_hlo: bool = False) -> dict:
  """Compile `run()`'s train step of `config` for TPU slice `slice_name`; returns the report dict
  (with the compiled HLO text under 'hlo' when `keep_hlo`; `format_report` leaves it out)."""
  from k2jax.train import core, loop  # noqa: PLC0415 (they pull in checkpointing and data: only when compiling)

  tc = from_config_dict(config)
  num_slices, s = parse_target(slice_name)
  dcn = tc.mesh.dcn_shape
  if math.prod(dcn.values()) != num_slices:
    raise ConfigError(
      f"--aot={slice_name}: {num_slices} slice(s), but the mesh's DCN level (mesh.dcn_*) spans "
      f"{math.prod(dcn.values())}: set e.g. --config.mesh.dcn_data={num_slices}"
    )
  devices = slice_devices(s, num_slices)
  mesh_shape = check_runtime(tc, len(devices), 1)
  mesh = sharding.make_mesh({a: n // dcn[a] for a, n in mesh_shape.items()}, devices=devices, dcn_shape=dcn)
  preset = tc.mesh.rules
  t0 = time.perf_counter()
  optimizer, schedule = loop.make_optimizer(tc)
  pipeline = pipeline_spec(tc, mesh_shape)
  lay = core.layout(
    tc.model,
    optimizer,
    mesh=mesh,
    preset=preset,
    seed=tc.seed,
    offload_opt_state=tc.optim.offload_state,
    pipeline=pipeline,
  )
  with lay.use():
    state = _abstract_with_shardings(lay.abstract_state, lay.shardings)
    step_fn = lay.jitted(loop.make_step(tc, lay.mdef, optimizer, schedule, pipeline=pipeline))
    lowered = step_fn.lower(state, _abstract_batch(tc, lay.batch_sharding))
  report = {
    "slice": slice_name,
    "slices": num_slices,
    "topology": s.topology,
    "wrap": ",".join(str(w).lower() for w in s.wrap),  # what the compile was told: the hardware's wiring
    "wiring": s.wiring,
    "num_devices": len(devices),
    "mesh": sharding.mesh_text(mesh_shape),
    "rules_preset": preset,
    "platform": sharding.platform(mesh),
    "num_layers": tc.model.num_hidden_layers,
    "num_microbatches": tc.data.num_microbatches,
    "tokens_per_device_per_microbatch": tc.data.global_batch_size
    * tc.data.seq_len
    // (tc.data.num_microbatches * len(devices)),
    "state_bytes_per_device": shard_bytes(state),
    "host_state_bytes_per_device": shard_bytes(state, "pinned_host"),
    "hbm_bytes_per_device": s.hbm_bytes,
  }
  compiled, oom = compile_or_oom(lowered)
  if compiled is None:
    report["compile_s"] = round(time.perf_counter() - t0, 1)
    report["xla_required_temp_gib_per_device"], report["xla_available_gib_per_device"] = oom
    report["peak_gib_per_device"] = round(report["state_bytes_per_device"] / GIB + oom[0], 2)
    report["fits"] = False
    return report
  report["compile_s"] = round(time.perf_counter() - t0, 1)
  mem = compiled.memory_analysis()
  peak = peak_bytes(mem)
  report.update(
    argument_bytes_per_device=mem.argument_size_in_bytes,
    output_bytes_per_device=mem.output_size_in_bytes,
    alias_bytes_per_device=mem.alias_size_in_bytes,
    temp_bytes_per_device=mem.temp_size_in_bytes,
    host_argument_bytes_per_device=getattr(mem, "host_argument_size_in_bytes", 0),
    xla_peak_memory_bytes_per_device=getattr(mem, "peak_memory_in_bytes", -1),
    peak_bytes_per_device=peak,
    peak_gib_per_device=round(peak / GIB, 2),
    temp_gib_per_device=round(mem.temp_size_in_bytes / GIB, 2),
  )
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  report["xla_cost_flops_loop_bodies_once"] = float(cost.get("flops", 0.0))
  report["xla_cost_bytes_accessed_loop_bodies_once"] = float(cost.get("bytes accessed", 0.0))
  # The program's device d is the mesh's d-th device: replica groups spanning slices cross DCN.
  slice_of = [getattr(d, "slice_index", 0) or 0 for d in mesh.devices.flat] if num_slices > 1 else None
  stats = hlo_stats.hlo_stats(compiled.as_text(), slice_of=slice_of)
  report["unknown_trip_counts"] = stats.pop("unknown_trip_counts")
  report["flops_per_device"] = stats.pop("matmul_flops")
  report["custom_call_flops_per_device"] = stats.pop("custom_call_flops")
  for kind in hlo_stats.COLLECTIVES:
    report[f"{kind}_bytes_per_device"] = stats.pop(f"{kind}_bytes")
  if slice_of is not None:
    report["dcn_bytes_per_device"] = stats.pop("dcn_bytes")
    for kind in hlo_stats.COLLECTIVES:
      report[f"dcn_{kind}_bytes_per_device"] = stats.pop(f"dcn_{kind}_bytes")
    for key in sorted(k for k in stats if k.startswith("dcn_megascale_")):
      report[key.removesuffix("_bytes") + "_bytes_per_device"] = stats.pop(key)
  if keep_hlo:
    report["hlo"] = compiled.as_text()
  report["headroom_gib_per_device"] = round((s.hbm_bytes - peak) / GIB, 2)
  report["fits"] = peak <= s.hbm_bytes
  return report


def compile_or_oom(lowered):
  """(compiled, None), or (None, (required temp GiB, available GiB)) when XLA:TPU's compile-time HBM check
  refuses the program (its CompileTimeHbmOom message); any other compile error raises."""
  try:
    return lowered.compile(), None
  except jax.errors.JaxRuntimeError as e:
    oom = re.search(r"required for HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", str(e))
    if oom is None:
      raise
    return None, (float(oom.group(1)), float(oom.group(2)))


def peak_bytes(mem) -> int:
  """Per-device HBM a compiled step needs: what XLA's buffer assignment allocates on the device
  (`total_allocation_bytes`: the device arguments, one block for every temporary, constants), else
  arguments + outputs - aliased + temporaries + code.

  Not that sum where XLA reports the allocation: XLA:TPU's `temp_size_in_bytes` is larger than its own
  whole allocation. Measured here (libtpu 0.0.50, `1t` flash/ragged on v5p-1024): temp 51.15 GiB and
  arguments 16.27, while the dumped buffer assignment (`*buffer-assignment.txt`) allocates 48.96 GiB in
  all (16.27 of parameters, one 32.69 GiB temp block), and the HBM check goes by the allocation: on v5p-512
  (64 microbatches) arguments + temp came to 106.8 GiB, past the 95.73 GiB limit, the allocation to 81.78,
  and the step compiled. (`peak_memory_in_bytes`, 48.44 there, is ~0.5 GiB under the allocation and
  counts host-memory buffers too: 48.44 again with 8.2 GiB of optimizer state offloaded to the host,
  when the allocation fell to 40.76.)"""
  total = getattr(mem, "total_allocation_bytes", 0)
  if total:
    return int(total)
  return (
    mem.argument_size_in_bytes
    + mem.output_size_in_bytes
    - mem.alias_size_in_bytes
    + mem.temp_size_in_bytes
    + mem.generated_code_size_in_bytes
  )


def planner_over_xla(config: config_dict.ConfigDict, report: dict) -> float:
  """k2jax.memory.plan's per-device total over XLA's peak for the same config and mesh."""
  tc = from_config_dict(config)
  p = memory.plan(
    tc.model,
    {a: int(n) for a, n in (kv.split("=") for kv in report["mesh"].split(","))},
    tc.mesh.rules,
    report["tokens_per_device_per_microbatch"],
    seq_len=tc.data.seq_len,
    num_devices=report["num_devices"],
    device_memory_bytes=report["hbm_bytes_per_device"],
    num_microbatches=tc.data.num_microbatches,
    accelerator=True,
    offload_opt_state=tc.optim.offload_state,
  )
  return p["total_bytes_per_device"] / (report["peak_gib_per_device"] * GIB)


def format_report(report: dict) -> str:
  """`key=value` lines; booleans lower case (fits=true|false); the HLO text and dict values left out."""
  fmt = lambda v: str(v).lower() if isinstance(v, bool) else f"{v:.6e}" if isinstance(v, float) and v > 1e6 else v  # noqa: E731
  return "\n".join(f"{k}={fmt(v)}" for k, v in report.items() if k != "hlo" and not isinstance(v, dict))


def lower_step_for_gpu(config: config_dict.ConfigDict, num_devices: int = 1):
  """`run()`'s train step of `config` lowered for CUDA on this host (any host: no GPU needed), on a mesh of
  `num_devices` of this host's devices (the config's `mesh.*` and `pipeline.*` over them), with every kernel chosen
  for a GPU target (`sharding.target_platform`). Returns jax's `Lowered`; `.as_text()` is the StableHLO a GPU
  would compile (tests check which kernels and collectives are in it)."""
  from k2jax.train import core, loop  # noqa: PLC0415

  tc = from_config_dict(config)
  devices = jax.devices()[:num_devices]
  shape = check_runtime(tc, len(devices), 1)
  mesh = sharding.make_mesh(shape, devices=devices)
  pipeline = pipeline_spec(tc, shape)
  optimizer, schedule = loop.make_optimizer(tc)
  lay = core.layout(
    tc.model, optimizer, mesh=mesh, preset=tc.mesh.rules, seed=tc.seed, offload_opt_state=False, pipeline=pipeline
  )
  with sharding.target_platform("gpu"), lay.use():
    state = _abstract_with_shardings(lay.abstract_state, lay.shardings)
    step_fn = lay.jitted(loop.make_step(tc, lay.mdef, optimizer, schedule, pipeline=pipeline))
    return step_fn.trace(state, _abstract_batch(tc, lay.batch_sharding)).lower(lowering_platforms=("cuda",))
