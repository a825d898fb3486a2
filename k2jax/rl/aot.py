"""Compile a colocated RL iteration for a TPU slice without TPUs: `launch/rl.py --aot=v5p-1024`.

The programs are the ones `Learner` runs with the embedded engine on a serving mesh (`engine.sharding`),
traced over the slice's compile-only devices, wired as the hardware is (`k2jax.train.aot.slice_devices`):

  generate  the engine's decode step (every slot) and its prefill of one slot at the longest bucket
            (max_seq_len), jitted by `runner.jit_steps` exactly as `ModelRunner` does: the bf16 weights in
            the serving layout + the KV cache of `engine.max_slots` rows of `engine.max_seq_len` tokens are
            their arguments. Besides them the device holds what the trainer keeps there while the engine
            works (`colocate.*`, phases.py: its params and router bias unless `offload_params`, the
            optimizer state unless `offload_opt_state`) and the prefix cache's rows (replicated, one full
            row per entry), so generate_peak = max(decode, prefill) + those.
  update    `programs.make_update` (the K2 objective + PTX, MuonClip), jitted by the training core as
            `Learner` does (`Layout.jitted`, params donated: the engine holds its own copy), with the whole
            state back on the device and the engine's cache and weights released.
  reshard   per device, the bytes of the serving layout it must receive that its training shards do not
            already hold (from each leaf's two shardings, served dtype), max over devices; and the
            collective bytes of the compiled reshard program (the served-dtype training-layout weights
            with the serving shardings out, what `jax.device_put` runs; `hlo_stats`) as a check.
  offload   bytes per device the phases move to pinned_host before generating and back after.

Per-device peaks are `k2jax.train.aot.peak_bytes` (XLA's buffer assignment); a program over XLA:TPU's
HBM check reports the bytes it asked for and fits=false.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from ml_collections import config_dict

from k2jax import sharding
from k2jax.engine import decode, runner
from k2jax.engine.inference import check_shards
from k2jax.engine.placement import make_placement
from k2jax.model.config import ConfigError
from k2jax.model.transformer import K2Model
from k2jax.rl import batching
from k2jax.rl.learner import from_config_dict
from k2jax.rl.programs import make_optimizer, make_update, serving_config, trainer_mesh_shape
from k2jax.train import aot, core, hlo_stats
from k2jax.train.checkpoint import abstract_like, merge_dicts

GIB = aot.GIB


def compile_rl(config: config_dict.ConfigDict, slice_name: str, progress=lambda part: None) -> dict:
  """Compile the colocated RL iteration of `config` (configs/rl.py) for TPU slice `slice_name`; returns
  the report dict (`aot.format_report` prints it), ending in fits=true|false for the whole iteration.
  `progress(part)` gets each phase's part of the report as soon as it is compiled (minutes apart at 1T)."""
  lc = from_config_dict(config, "/nonexistent-aot-workdir", (), check_files=False)
  if not lc.engine.sharding or lc.engine_url:
    raise ConfigError(
      "engine.sharding / rollout.engine_url: --aot compiles the colocated iteration (the embedded engine on a "
      f"serving mesh over the trainer's devices), this config has engine.sharding={lc.engine.sharding!r} and "
      f"rollout.engine_url={lc.engine_url!r}; set engine.sharding=tp|ep|tp_ep and rollout.engine_url=''"
    )
  s = aot.tpu_slice(slice_name)
  devices = aot.slice_devices(s)
  optimizer, schedule = make_optimizer(lc)
  shape = trainer_mesh_shape(lc, len(devices))
  lay = core.layout(
    lc.model, optimizer, mesh=sharding.make_mesh(shape, devices=devices), preset=lc.mesh.rules, seed=lc.seed
  )
  state = abstract_like(lay.abstract_state, lay.shardings)
  report = {
    "slice": slice_name,
    "topology": s.topology,
    "wrap": ",".join(str(w).lower() for w in s.wrap),  # compiled as the slice is wired
    "wiring": s.wiring,
    "num_devices": len(devices),
    "trainer_mesh": sharding.mesh_text(shape),
    "trainer_rules": lc.mesh.rules,
    "platform": sharding.platform(lay.mesh),
    "num_layers": lc.model.num_hidden_layers,
    "rollout_rows": lc.rows,
    "ptx_rows": lc.ptx.batch_size if lc.ptx else 0,
    "train_seq_len": lc.seq_len,
    "hbm_gib_per_device": round(s.hbm_bytes / GIB, 2),
  }
  progress(report)
  gen = _generation(lc, devices, state, s.hbm_bytes)
  progress(gen["report"])
  report.update(gen["report"])
  report.update(_offload(lc, state))
  upd = _update(lc, lay, state, optimizer, schedule, s.hbm_bytes)
  progress(upd)
  report.update(upd)
  report.update(_reshard(gen["serving"], state))
  report["fits"] = bool(report["generate_fits"] and report["update_fits"])
  return report


def _compiled_peak(lowered) -> tuple[int | None, dict]:
  """(XLA's per-device peak, or None past the HBM check; its figures)."""
  compiled, oom = aot.compile_or_oom(lowered)
  if compiled is None:
    return None, {"xla_required_temp_gib": oom[0], "xla_available_gib": oom[1]}
  mem = compiled.memory_analysis()
  return aot.peak_bytes(mem), {"temp_gib": round(mem.temp_size_in_bytes / GIB, 2)}


def _generation(lc, devices, state, hbm: int) -> dict:
  """The engine's decode and prefill programs on its serving mesh, and what else the device holds then."""
  cfg = serving_config(lc.model)
  placement = make_placement(lc.engine.sharding, lc.engine.mesh, devices)
  max_len = min(lc.engine.max_seq_len, cfg.max_position_embeddings)
  check_shards(lc.engine, placement.batch_shards)
  graphdef, weights = nnx.split(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  shardings = placement.state_shardings(weights)
  steps = runner.jit_steps(graphdef, lc.engine.num_top_logprobs, placement, shardings)
  weights = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), weights, shardings)
  n = lc.engine.max_slots
  cache = jax.eval_shape(lambda: decode.init_cache(cfg, n, max_len))
  cache = abstract_like(cache, jax.tree.map(lambda _: placement.cache_sharding(), cache))
  rep = placement.replicated
  host = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
  greedy = lambda b: runner.sampling_arrays(*([0.0] * b, [1.0] * b, [0] * b, [0] * b, [0] * b))  # noqa: E731
  sampling = lambda b: jax.tree.map(lambda a: host(a.shape, a.dtype), greedy(b))  # noqa: E731
  t0 = time.perf_counter()
  with placement.use():
    dec = steps.decode.lower(
      weights, cache, host((n, 1), jnp.int32), host((n, 1), jnp.int32), host((n,), jnp.int32), sampling(n)
    )
    pre = steps.prefill.lower(
      weights,
      cache,
      host((1,), jnp.int32),
      host((1, max_len), jnp.int32),
      host((1, max_len), jnp.int32),
      host((1,), jnp.int32),
      sampling(1),
    )
    row = jax.eval_shape(steps.read_row, cache, host((), jnp.int32))
  decode_peak, dec_info = _compiled_peak(dec)
  prefill_peak, pre_info = _compiled_peak(pre)
  # Resident beside the engine's programs: the prefix cache's rows (read_row's replicated output, one full
  # row per entry) and the trainer's state that the phases leave on the device.
  prefix = lc.engine.prefix_cache_entries * sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(row))
  trainer = _trainer_resident(lc, state)
  r = {
    "engine_sharding": lc.engine.sharding,
    "engine_mesh": sharding.mesh_text(placement.mesh.shape),
    "engine_slots": n,
    "engine_max_seq_len": max_len,
    "engine_weights_gib_per_device": round(aot.shard_bytes(weights) / GIB, 2),
    "kv_cache_gib_per_device": round(aot.shard_bytes(cache) / GIB, 2),
    "prefix_rows_gib_per_device": round(prefix / GIB, 2),
    "trainer_resident_gib_per_device": round(trainer / GIB, 2),
    "generate_compile_s": round(time.perf_counter() - t0, 1),
  }
  for name, peak, info in (("decode", decode_peak, dec_info), ("prefill", prefill_peak, pre_info)):
    r[f"{name}_program_peak_gib_per_device"] = round(peak / GIB, 2) if peak is not None else "n/a"
    r.update({f"{name}_{k}_per_device": v for k, v in info.items()})
  if decode_peak is None or prefill_peak is None:  # XLA refused a program: the iteration does not fit
    r.update(generate_fits=False, generate_peak_gib_per_device="n/a", generate_headroom_gib_per_device="n/a")
  else:
    peak = max(decode_peak, prefill_peak) + prefix + trainer
    r["generate_peak_bytes_per_device"] = peak
    r["generate_peak_gib_per_device"] = round(peak / GIB, 2)
    r["generate_headroom_gib_per_device"] = round((hbm - peak) / GIB, 2)
    r["generate_fits"] = peak <= hbm
  return {"report": r, "serving": weights}


def _trainer_resident(lc, state) -> int:
  """Per-device bytes of the trainer's state left on the device during generation (`colocate.*`)."""
  keep = [state.step, state.skipped_steps, state.bias]
  keep += [] if lc.colocate.offload_params else [state.params]
  keep += [] if lc.colocate.offload_opt_state else [state.opt_state]
  return aot.shard_bytes(keep)


def _update(lc, lay, state, optimizer, schedule, hbm: int) -> dict:
  """The learner's RL update step, the whole state on the device, the engine's memory released."""
  batch = batching.empty_train_arrays(rows=lc.rows, seq_len=lc.seq_len)
  on_rows = lambda a: jax.ShapeDtypeStruct(  # noqa: E731
    a.shape, a.dtype, sharding=sharding.batch_sharding(lay.mesh, lay.preset, ndim=a.ndim)
  )
  batch = {k: on_rows(v) for k, v in batch.items()}
  old_BT = on_rows(np.zeros((lc.rows, lc.seq_len), np.float32))
  ptx = None
  if lc.ptx:
    shape = (lc.ptx.batch_size, lc.ptx.seq_len)
    ptx = {k: on_rows(np.zeros(shape, dt)) for k, dt in (("tokens_BT", np.int32), ("segment_ids_BT", np.int32))}
    ptx["loss_mask_BT"] = on_rows(np.zeros(shape, np.float32))
  t0 = time.perf_counter()
  with lay.use():
    step = lay.jitted(make_update(lc, lay.mdef, optimizer, schedule), donate_params=True)
    lowered = step.lower(state, batch, old_BT, ptx)
  peak, info = _compiled_peak(lowered)
  r = {"update_state_gib_per_device": round(aot.shard_bytes(state) / GIB, 2)}
  r.update({f"update_{k}_per_device": v for k, v in info.items()})
  r["update_compile_s"] = round(time.perf_counter() - t0, 1)
  if peak is None:
    required = aot.shard_bytes(state) + info["xla_required_temp_gib"] * GIB
    r.update(update_peak_gib_per_device=round(required / GIB, 2), update_fits=False)
    r["update_headroom_gib_per_device"] = round((hbm - required) / GIB, 2)
    return r
  r["update_peak_bytes_per_device"] = peak
  r["update_peak_gib_per_device"] = round(peak / GIB, 2)
  r["update_headroom_gib_per_device"] = round((hbm - peak) / GIB, 2)
  r["update_fits"] = peak <= hbm
  return r


def receive_bytes(shape, itemsize: int, src: NamedSharding, dst: NamedSharding) -> dict:
  """Device -> bytes of its `dst` shard that its `src` shard does not already hold (what a reshard from
  `src` to `dst` must bring to it), for an array of `shape` with `itemsize`-byte elements."""
  have, want = src.devices_indices_map(tuple(shape)), dst.devices_indices_map(tuple(shape))
  out = {}
  for d, w in want.items():
    overlap = 1
    for dim, (a, b) in enumerate(zip(have[d], w)):
      lo = max(a.start or 0, b.start or 0)
      hi = min(shape[dim] if a.stop is None else a.stop, shape[dim] if b.stop is None else b.stop)
      overlap *= max(hi - lo, 0)
    out[d] = (_volume(w, shape) - overlap) * itemsize
  return out


def _volume(index, shape) -> int:
  return math.prod((shape[i] if s.stop is None else s.stop) - (s.start or 0) for i, s in enumerate(index))


def _reshard(serving, state) -> dict:
  """Bytes per device the push moves from the training layout to the serving one (served dtype)."""
  served = nnx.to_pure_dict(serving)
  train = merge_dicts(
    jax.tree.map(lambda x, s: (x, s), state.params, _shardings(state.params)),
    jax.tree.map(lambda x, s: (x, s), state.bias, _shardings(state.bias)),
  )
  per_device: dict = {}
  sources, by_leaf = {}, {}
  for path, dst in jax.tree_util.tree_leaves_with_path(served):
    (_, src) = _at(train, path)
    got = receive_bytes(dst.shape, dst.dtype.itemsize, src, dst.sharding)
    for d, b in got.items():
      per_device[d] = per_device.get(d, 0) + b
    by_leaf[jax.tree_util.keystr(path)] = max(got.values())
    sources[jax.tree_util.keystr(path)] = jax.ShapeDtypeStruct(dst.shape, dst.dtype, sharding=src)
  # The reshard program itself (the cast happens before it, where the training shards are).
  dst_shardings = {jax.tree_util.keystr(p): x.sharding for p, x in jax.tree_util.tree_leaves_with_path(served)}
  t0 = time.perf_counter()
  try:
    compiled = jax.jit(lambda t: t, out_shardings=dst_shardings).lower(sources).compile()
    stats = hlo_stats.hlo_stats(compiled.as_text())
    collective = sum(stats[f"{k}_bytes"] for k in hlo_stats.COLLECTIVES)
  except ValueError as e:  # jit needs one device order in and out; device_put reshards across orders itself
    if "incompatible devices" not in str(e):
      raise
    collective = "n/a(the_two_meshes_order_the_devices_differently:no_single_program)"
  values = list(per_device.values())
  return {
    "reshard_bytes_per_device": max(values),
    "reshard_mean_bytes_per_device": int(sum(values) / len(values)),
    "reshard_gib_per_device": round(max(values) / GIB, 2),
    "reshard_program_collective_bytes_per_device": collective,
    "reshard_compile_s": round(time.perf_counter() - t0, 1),
    "reshard_leaf_bytes": by_leaf,  # leaf -> its max over devices (not printed: `format_report` skips dicts)
  }


def _shardings(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def _at(tree: dict, path):
  for k in path:
    tree = tree[k.key]
  return tree


def _offload(lc, state) -> dict:
  """Bytes per device the phases move device -> pinned_host before generating (and back after)."""
  moved = ([state.opt_state] if lc.colocate.offload_opt_state else []) + (
    [state.params] if lc.colocate.offload_params else []
  )
  b = aot.shard_bytes(moved)
  return {
    "offload_opt_state": lc.colocate.offload_opt_state,
    "offload_params": lc.colocate.offload_params,
    "offload_bytes_per_device": b,
    "offload_round_trip_bytes_per_device": 2 * b,
  }
