"""Hand the trainer's weights to the rollout engine after an update, without a host round trip.

Colocated (an engine in this process with `update_weights_from_params`, e.g. `k2jax.engine.InferenceEngine`):
the engine gets a device-to-device copy of the model's pure state dict on its own placement (`serve_sharding`,
resharded from the trainer's mesh; a copy because the next train step donates the trainer's arrays).
Nothing goes to the host, nothing to disk.

Remote (SGLang over HTTP): HF safetensors on storage both sides see, then `/update_weights_from_disk`.
Every JAX process writes only the tensors it owns, straight from its devices, one HF tensor at a time:
  1. hash   one jitted pass over the sharded state gives two 32-bit position-weighted sums per HF tensor
            (integer sums: independent of the sharding); only tensors whose hashes changed since the last
            successful push are written (all on the first push and on `push(full=True)`).
  2. export per leaf and layer, a jitted reshard on the trainer's own mesh to the HF layout: layer l of a
            [L(, E), in, out] leaf becomes [E or 1, out, in] in the served dtype, split over the mesh axes
            that divide E and whole in every other dim, so each device shard holds whole HF tensors
            (device memory: one layer of one leaf at a time; unsplit chunks are spread over the processes).
  3. write  each process streams its tensors into `model-p<process>-<k>.safetensors` (the header is known
            before any data: names, dtypes and shapes come from the plan), fetching one HF tensor at a
            time, so host memory stays at about one tensor; process 0 writes the index of all files.
  4. update after a barrier, process 0 calls the engine's `update_weights(dir, version)`.
Versions increase by one per push that changed something. The directory `<root>/v<version>/` holds only
changed tensors (slime's `from_disk_delta`, reference §3.1); SGLang's disk loader takes the files listed in
the index. The engine must not be generating during the update (updates run between rollout phases).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from k2jax.convert.hf import _get
from k2jax.convert.layout import Entry, entries
from k2jax.model.config import K2Config

INDEX_NAME = "model.safetensors.index.json"
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32"}


@dataclasses.dataclass(frozen=True)
class WeightSyncConfig:
  root: str  # shared directory visible to trainer and engine (remote engines only)
  max_shard_bytes: int = 4 * 2**30  # each process splits its tensors into files of at most this size
  keep_last: int = 2  # version directories kept on disk (older ones are deleted)

  def __post_init__(self):
    if self.keep_last < 1 or self.max_shard_bytes <= 0:
      raise ValueError(f"invalid WeightSyncConfig {self}")


@dataclasses.dataclass(frozen=True)
class _Chunk:
  """One export: layer `layer` of a leaf (None: the whole global leaf) as [len(names), *hf_shape]."""

  entry: Entry
  layer: int | None
  names: tuple[str, ...]  # HF key of row i
  hf_shape: tuple[int, ...]
  dtype: np.dtype
  sharding: NamedSharding  # of the exported array
  writer: tuple[Any, ...]  # device whose shard of row i is written (its process writes it)

  @property
  def tensor_bytes(self) -> int:
    return math.prod(self.hf_shape) * self.dtype.itemsize


class WeightSync:
  """Tracks what the engine holds and the monotonically increasing weight version (see module docstring).

  `engine` is None on the processes of a multi-process run that do not talk to the engine (all but 0).
  """

  def __init__(
    self, config: WeightSyncConfig, engine: Any, model: K2Config, *, initial_version: int = 0, serve_sharding=None
  ):
    self.config, self.engine, self.model = config, engine, model
    self.version = initial_version
    self.colocated = callable(getattr(engine, "update_weights_from_params", None))
    self.serve_sharding = serve_sharding or SingleDeviceSharding(jax.local_devices()[0])
    self._hashes: dict[str, tuple[int, int]] = {}
    self._plan: list[_Chunk] | None = None
    self._hash_fn = None
    self._export_fns: dict[tuple[str, ...], Any] = {}

  def push(self, state: dict, full: bool = False) -> int:
    """Hands `state` (the model's pure state dict, sharded device arrays) to the engine; returns the version."""
    if self.colocated:
      self.version += 1
      self.engine.update_weights_from_params(copy_to(state, self.serve_sharding), self.version)
      return self.version
    return self._push_remote(state, full)

  # ---- remote: per-process streamed safetensors ----------------------------------------------------
  def _push_remote(self, state: dict, full: bool) -> int:
    plan = self._plan or self._make_plan(state)
    hashes = self._tensor_hashes(state)
    changed = {n for n, h in hashes.items() if full or not self._hashes or self._hashes.get(n) != h}
    if not changed:
      return self.version  # the engine already holds exactly these weights
    version = self.version + 1
    path = os.path.join(self.config.root, f"v{version:08d}")
    tmp = path + ".tmp"
    primary = jax.process_index() == 0
    if primary:
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(tmp)
    _barrier(f"weight_sync_mkdir_{version}")
    files = self._files(plan, changed)
    mine = [f for f in files if f[1] == jax.process_index()]
    self._write(state, plan, changed, mine, tmp)
    _barrier(f"weight_sync_written_{version}")
    try:
      if primary:
        weight_map = {name: fname for fname, _, tensors in files for name, _ in tensors}
        total = sum(lf.tensor_bytes for lf in plan for n in lf.names if n in changed)
        meta = {
          "total_size": total,
          "k2jax_weight_version": str(version),
          "k2jax_delta": str(len(changed) < len(hashes)),
        }
        with open(os.path.join(tmp, INDEX_NAME), "w") as f:
          json.dump({"metadata": meta, "weight_map": weight_map}, f, indent=1, sort_keys=True)
        if os.path.exists(path):  # left over from a failed push of the same version
          shutil.rmtree(path)
        os.replace(tmp, path)
        self.engine.update_weights(path, version)
    except BaseException:
      shutil.rmtree(path, ignore_errors=True)
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    self.version = version
    self._hashes.update({n: hashes[n] for n in changed})
    if primary:
      self._prune()
    return version

  def _make_plan(self, state: dict) -> list[_Chunk]:
    """Export layout of every chunk, from shapes and the trainer's mesh alone (the same on every process)."""
    plan, n_proc, unsplit = [], jax.process_count(), 0
    for entry in entries(self.model):
      leaf = _get(state, entry.path)
      mesh = _mesh(leaf)
      keys = [k for _, k in entry.keys(self.model)]
      n_lead = {"global": 0, "layer": 1, "expert": 2}[entry.kind]
      inner = tuple(leaf.shape[n_lead:])
      hf_shape = inner[::-1] if entry.transpose else inner
      rows = leaf.shape[1] if entry.kind == "expert" else 1
      axes, size = [], 1  # mesh axes that split the rows (experts) evenly
      for a in sorted(mesh.axis_names, key=lambda a: a != "expert"):
        if mesh.shape[a] > 1 and rows % (size * mesh.shape[a]) == 0:
          axes.append(a)
          size *= mesh.shape[a]
      sh = NamedSharding(mesh, P(tuple(axes)) if axes else P())
      order = list(mesh.devices.flat)
      holders: dict[int, list] = {}  # row -> the devices holding it, in mesh order
      if axes:
        index_map = sh.devices_indices_map((rows, *hf_shape))
        for dev in order:
          for r in range(*index_map[dev][0].indices(rows)):
            holders.setdefault(r, []).append(dev)
      for c in range(len(keys) // rows):
        if axes:  # rotate over the replicas of each row, so every process writes its share
          writer = tuple(holders[r][(c * rows + r) % len(holders[r])] for r in range(rows))
        else:  # whole on every device: one process per chunk, in turn
          p = unsplit % n_proc
          unsplit += 1
          writer = (next(d for d in order if d.process_index == p),) * rows
        layer = None if entry.kind == "global" else c
        names = tuple(keys[c * rows : (c + 1) * rows])
        plan.append(_Chunk(entry, layer, names, hf_shape, np.dtype(leaf.dtype), sh, writer))
    self._plan = plan
    return plan

  def _tensor_hashes(self, state: dict) -> dict[str, tuple[int, int]]:
    ents = entries(self.model)
    if self._hash_fn is None:
      paths = [e.path for e in ents]
      counts = [len(e.keys(self.model)) for e in ents]
      replicated = NamedSharding(self._plan[0].sharding.mesh, P())
      self._hash_fn = jax.jit(
        lambda st: [_hash_rows(_get(st, p), n) for p, n in zip(paths, counts)], out_shardings=replicated
      )
    out = jax.device_get(self._hash_fn(state))
    return {
      name: (int(h[0][i]), int(h[1][i])) for e, h in zip(ents, out) for i, (_, name) in enumerate(e.keys(self.model))
    }

  def _files(self, plan: list[_Chunk], changed: set[str]) -> list[tuple[str, int, list[tuple[str, _Chunk]]]]:
    """(file name, writing process, [(HF name, leaf)]) for every file of this push, in write order."""
    out = []
    for p in range(jax.process_count()):
      groups: list[list[tuple[str, _Chunk]]] = [[]]
      size = 0
      for lf in plan:
        for name, w in zip(lf.names, lf.writer):
          if w.process_index != p or name not in changed:
            continue
          if groups[-1] and size + lf.tensor_bytes > self.config.max_shard_bytes:
            groups.append([])
            size = 0
          groups[-1].append((name, lf))
          size += lf.tensor_bytes
      out += [(f"model-p{p:05d}-{k + 1:05d}.safetensors", p, g) for k, g in enumerate(groups) if g]
    return out

  def _write(self, state: dict, plan: list[_Chunk], changed: set[str], mine: list, tmp: str) -> None:
    """Stream this process's tensors; every process runs every needed export (they are collective)."""
    streams = [_SafetensorsStream(os.path.join(tmp, fname), tensors) for fname, _, tensors in mine]
    stream_of = {name: st for st, (_, _, tensors) in zip(streams, mine) for name, _ in tensors}
    try:
      for ch in plan:
        if not any(n in changed for n in ch.names):
          continue
        leaf = _get(state, ch.entry.path)
        exported = self._export(ch)(leaf) if ch.layer is None else self._export(ch)(leaf, ch.layer)
        shards = {s.device: s for s in exported.addressable_shards}
        for r, name in enumerate(ch.names):
          if name in stream_of:
            shard = shards[ch.writer[r]]
            k = r - (shard.index[0].start or 0) if shard.index else r
            stream_of[name].write(name, np.asarray(shard.data[k]))
        del exported, shards
    finally:
      for st in streams:
        st.close()

  def _export(self, ch: _Chunk):
    """jit: (leaf[, layer]) -> [rows, *hf_shape] sharded per `ch.sharding` (one compile per leaf)."""
    key = ch.entry.path
    fn = self._export_fns.get(key)
    if fn is None:
      transpose, kind = ch.entry.transpose, ch.entry.kind

      def export(x, layer=None):
        x = x[None] if kind == "global" else jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=kind == "layer")
        return jnp.swapaxes(x, -1, -2) if transpose else x

      fn = self._export_fns[key] = jax.jit(export, out_shardings=ch.sharding)
    return fn

  def _prune(self) -> None:
    dirs = sorted(d for d in os.listdir(self.config.root) if d.startswith("v") and d[1:].isdigit())
    for d in dirs[: -self.config.keep_last]:
      shutil.rmtree(os.path.join(self.config.root, d), ignore_errors=True)


class _SafetensorsStream:
  """One safetensors file written tensor by tensor: the header (names, dtypes, shapes) comes first."""

  def __init__(self, path: str, tensors: list[tuple[str, _Chunk]]):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, lf in tensors:
      header[name] = {
        "dtype": _ST_DTYPES[lf.dtype.name],
        "shape": list(lf.hf_shape),
        "data_offsets": [offset, offset + lf.tensor_bytes],
      }
      offset += lf.tensor_bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    self._order = [name for name, _ in tensors]
    self._next = 0
    self._f = open(path, "wb")
    self._f.write(struct.pack("<Q", len(text)) + text)

  def write(self, name: str, a: np.ndarray) -> None:
    if self._order[self._next] != name:
      raise RuntimeError(f"safetensors stream: expected {self._order[self._next]!r}, got {name!r}")
    a = np.ascontiguousarray(a)
    self._f.write(a.reshape(-1).view(np.uint8).data)
    self._next += 1

  def close(self) -> None:
    self._f.close()
    if self._next != len(self._order):
      raise RuntimeError(f"{self._f.name}: wrote {self._next} of {len(self._order)} tensors")


def _hash_rows(leaf: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
  """Two position-weighted uint32 sums per HF tensor ([count] each); wrap-around integer sums, so the
  result does not depend on how the leaf is sharded or the order of the reduction."""
  x = leaf.reshape(count, -1)
  if x.dtype.itemsize == 4:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  elif x.dtype.itemsize == 2:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  else:
    raise ValueError(f"weight sync: cannot hash a {x.dtype} leaf")
  pos = jax.lax.iota(jnp.uint32, x.shape[1])
  m1 = (pos * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15)) | jnp.uint32(1)
  m2 = ((pos ^ jnp.uint32(0x5BD1E995)) * jnp.uint32(0x85EBCA6B) + jnp.uint32(0xC2B2AE35)) | jnp.uint32(1)
  rot = (bits << jnp.uint32(7)) | (bits >> jnp.uint32(25))
  return jnp.sum(bits * m1, axis=1, dtype=jnp.uint32), jnp.sum((rot ^ bits) * m2, axis=1, dtype=jnp.uint32)


def _mesh(leaf) -> Mesh:
  """The trainer's mesh of `leaf` (a one-device mesh for an unsharded array)."""
  s = getattr(leaf, "sharding", None)
  if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
    return s.mesh
  devices = sorted(s.device_set, key=lambda d: d.id) if s is not None else [jax.devices()[0]]
  return Mesh(np.asarray(devices), ("x",))


def copy_to(state, shardings):
  """`state` copied device to device onto `shardings` (a sharding or a tree of them); no result shares a
  buffer with `state`, so the trainer may donate its arrays afterwards."""
  return jax.tree.map(_own_copy, state, jax.device_put(state, shardings, may_alias=False))


def _own_copy(src, dst):
  """`dst`, copied when it still shares a buffer with `src` (device_put hands back the source's own
  shard when moving a replicated array onto one of its devices, whatever `may_alias` says)."""
  src_buffers = {s.data.unsafe_buffer_pointer() for s in src.addressable_shards}
  if any(s.data.unsafe_buffer_pointer() in src_buffers for s in dst.addressable_shards):
    return jnp.copy(dst)
  return dst


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
