"""Hand the trainer's weights to the rollout engine after an update, without a host round trip.

Colocated (an engine in this process with `update_weights_from_params`, e.g. `k2jax.engine.InferenceEngine`):
the engine gets the trainer's arrays themselves and places them on its own devices (`jax.device_put`, a
no-op when the engine serves on the trainer's placement, a reshard when it does not). Nothing goes to the
host or to disk, and nothing is copied that need not be. The engine may therefore hold the trainer's own
buffers: a trainer that hands its weights to a colocated engine must not donate them to its next step
(`WeightSync.shares_buffers`; `k2jax.train.core.Core.jit(..., donate_params=False)`).

Remote (SGLang over HTTP): HF safetensors on storage both sides see, then `/update_weights_from_disk`.
Every JAX process writes only the tensors it owns, one HF tensor at a time:
  1. plan   from shapes and the trainer's mesh alone (the same on every process): each HF tensor is read
            from the leaf's own device shards when they hold it whole, else from a per-layer export that
            reshards one layer of the leaf on the trainer's mesh so that each device holds whole tensors;
            of the devices holding a tensor, one writes it (rotating, so every process writes its share).
  2. write  each process streams its tensors into `model-p<process>-<k>.safetensors`: a tensor is fetched
            alone (CPU devices are read in place) and written in row blocks, transposed to the HF layout
            on the way, while its CRC-32 is computed; when the CRC equals the one of the weights the engine
            already holds, the tensor is cut from the file again (skipped; never on the first push or
            `push(full=True)`; RL updates change every tensor, so the write is rarely wasted). A writer
            thread overlaps the file system with the next block. Host memory: one tensor plus three
            blocks. The header goes last, into space reserved for it at the start of the file (padded
            with spaces, as safetensors allows).
  3. update after a barrier, process 0 writes the index from the files' headers and calls the engine's
            `update_weights(dir, version)`.
Versions increase by one per push that changed something. The directory `<root>/v<version>/` holds only
changed tensors (slime's `from_disk_delta`, reference §3.1); SGLang's disk loader takes the files listed in
the index. The engine must not be generating during the update (updates run between rollout phases).
A CRC-32 collision (2^-32 per changed tensor) leaves that tensor one push stale: the next push compares it
again.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import queue
import shutil
import struct
import threading
import zlib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k2jax.convert.hf import _get
from k2jax.convert.layout import Entry, entries
from k2jax.model.config import K2Config

INDEX_NAME = "model.safetensors.index.json"
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32"}
_BLOCK_BYTES = 256 << 10  # rows transposed, CRC'd and written per block (in cache from one to the next)


@dataclasses.dataclass(frozen=True)
class WeightSyncConfig:
  root: str  # shared directory visible to trainer and engine (remote engines only)
  max_shard_bytes: int = 4 * 2**30  # each process splits its tensors into files of at most this size
  keep_last: int = 2  # version directories kept on disk (older ones are deleted)

  def __post_init__(self):
    if self.keep_last < 1 or self.max_shard_bytes <= 0:
      raise ValueError(f"invalid WeightSyncConfig {self}")


@dataclasses.dataclass(frozen=True)
class _Tensor:
  name: str  # HF key
  index: tuple[int, ...]  # into the leading (layer, expert) axes of its source array
  writer: Any  # the device whose shard of the source is written (its process writes it)
  hf_shape: tuple[int, ...]
  dtype: np.dtype

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.hf_shape, dtype=np.int64)) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class _Source:
  """The array some HF tensors are read from: the leaf itself (`export` None), or layer `layer` of it
  (None: the whole global leaf) exported as [rows, *tensor] sharded per `export`."""

  entry: Entry
  layer: int | None
  export: NamedSharding | None
  tensors: tuple[_Tensor, ...]


class WeightSync:
  """Tracks what the engine holds and the monotonically increasing weight version (see module docstring).

  `engine` is None on the processes of a multi-process run that do not talk to the engine (all but 0).
  """

  def __init__(self, config: WeightSyncConfig, engine: Any, model: K2Config, *, initial_version: int = 0):
    self.config, self.engine, self.model = config, engine, model
    self.version = initial_version
    self.colocated = callable(getattr(engine, "update_weights_from_params", None))
    self._crcs: dict[str, int] = {}  # CRC-32 of each tensor this process wrote, as the engine holds it
    self._plan: list[_Source] | None = None
    self._export_fns: dict[tuple[str, ...], Any] = {}

  @property
  def shares_buffers(self) -> bool:
    """Whether the engine may serve the pushed arrays themselves (the trainer must not donate them); an
    engine on a serving mesh copies them into its own layout (`shares_pushed_buffers` False)."""
    return self.colocated and getattr(self.engine, "shares_pushed_buffers", True)

  def push(self, state: dict, full: bool = False) -> int:
    """Hands `state` (the model's pure state dict, sharded device arrays) to the engine; returns the version."""
    if self.colocated:
      self.version += 1
      self.engine.update_weights_from_params(state, self.version)
      return self.version
    return self._push_remote(state, full)

  # ---- remote: per-process streamed safetensors ----------------------------------------------------
  def _push_remote(self, state: dict, full: bool) -> int:
    plan = self._plan = self._plan or self._make_plan(state)
    version = self.version + 1
    path = os.path.join(self.config.root, f"v{version:08d}")
    tmp = path + ".tmp"
    primary = jax.process_index() == 0
    if primary:
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(tmp)
    _barrier(f"weight_sync_mkdir_{version}")
    crcs = self._write(state, plan, self._files(plan), tmp, full)
    if _global_sum(len(crcs)) == 0:  # the engine already holds exactly these weights
      if primary:
        shutil.rmtree(tmp, ignore_errors=True)
      return self.version
    _barrier(f"weight_sync_written_{version}")
    try:
      if primary:
        _write_index(tmp, version, model_bytes=sum(t.nbytes for src in plan for t in src.tensors))
        if os.path.exists(path):  # left over from a failed push of the same version
          shutil.rmtree(path)
        os.replace(tmp, path)
        self.engine.update_weights(path, version)
    except BaseException:
      shutil.rmtree(path, ignore_errors=True)
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    self.version = version
    self._crcs.update(crcs)
    if primary:
      self._prune()
    return version

  def _make_plan(self, state: dict) -> list[_Source]:
    """Where every HF tensor is read from and who writes it, from shapes and the trainer's mesh alone."""
    plan, turn = [], itertools.count()
    for entry in entries(self.model):
      leaf = _get(state, entry.path)
      keys = entry.keys(self.model)
      n_lead = len(keys[0][0])
      shape, dtype = tuple(leaf.shape[n_lead:]), np.dtype(leaf.dtype)
      hf_shape = shape[::-1] if entry.transpose else shape
      holders = _holders(leaf.sharding, leaf.shape, n_lead)
      if holders is not None:  # every device holds whole tensors: read the leaf's own shards
        tensors = [_Tensor(k, i, _pick(holders[i], next(turn)), hf_shape, dtype) for i, k in keys]
        plan.append(_Source(entry, None, None, tuple(tensors)))
        continue
      mesh = _mesh(leaf)
      rows = leaf.shape[1] if entry.kind == "expert" else 1
      axes, size = [], 1  # mesh axes that split the rows (experts) evenly
      for a in sorted(mesh.axis_names, key=lambda a: a != "expert"):
        if mesh.shape[a] > 1 and rows % (size * mesh.shape[a]) == 0:
          axes.append(a)
          size *= mesh.shape[a]
      export = NamedSharding(mesh, P(tuple(axes)) if axes else P())
      row_holders = _holders(export, (rows, *shape), 1)
      for c in range(len(keys) // rows):
        names = [k for _, k in keys[c * rows : (c + 1) * rows]]
        tensors = [_Tensor(k, (r,), _pick(row_holders[(r,)], next(turn)), hf_shape, dtype) for r, k in enumerate(names)]
        plan.append(_Source(entry, None if entry.kind == "global" else c, export, tuple(tensors)))
    return plan

  def _files(self, plan: list[_Source]) -> list[tuple[str, list[_Tensor]]]:
    """This process's files: (name, the tensors it may hold, in write order), each at most max_shard_bytes."""
    p = jax.process_index()
    groups: list[list[_Tensor]] = [[]]
    size = 0
    for t in (t for src in plan for t in src.tensors if t.writer.process_index == p):
      if groups[-1] and size + t.nbytes > self.config.max_shard_bytes:
        groups.append([])
        size = 0
      groups[-1].append(t)
      size += t.nbytes
    return [(f"model-p{p:05d}-{k + 1:05d}.safetensors", g) for k, g in enumerate(groups) if g]

  def _write(self, state: dict, plan: list[_Source], files: list, tmp: str, full: bool) -> dict[str, int]:
    """Streams this process's tensors; returns the CRC of each tensor written. Every process runs every
    export (they are collective programs on the trainer's mesh)."""
    pipe = _Pipe()
    streams = [_SafetensorsStream(os.path.join(tmp, fname), tensors, pipe) for fname, tensors in files]
    stream_of = {t.name: st for st, (_, tensors) in zip(streams, files) for t in tensors}
    written = {}
    try:
      for src in plan:
        array = _get(state, src.entry.path)
        if src.export is not None:
          array = self._export(src)(array) if src.layer is None else self._export(src)(array, src.layer)
        shards = {s.device: s for s in array.addressable_shards}
        transpose = src.entry.transpose
        for t in (t for t in src.tensors if t.name in stream_of):
          stream = stream_of[t.name]
          crc = stream.write(t.name, _host_tensor(shards[t.writer], t.index), transpose)
          if not full and self._crcs.get(t.name) == crc:
            stream.drop_last()
          else:
            written[t.name] = crc
        del array, shards
    finally:
      try:
        for st in streams:
          st.close()
      finally:
        pipe.close()
    return written

  def _export(self, src: _Source):
    """jit: (leaf[, layer]) -> [rows, *tensor] sharded per `src.export` (one compile per leaf)."""
    key = src.entry.path
    fn = self._export_fns.get(key)
    if fn is None:
      kind = src.entry.kind

      def export(x, layer=None):
        return x[None] if kind == "global" else jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=kind == "layer")

      fn = self._export_fns[key] = jax.jit(export, out_shardings=src.export)
    return fn

  def _prune(self) -> None:
    dirs = sorted(d for d in os.listdir(self.config.root) if d.startswith("v") and d[1:].isdigit())
    for d in dirs[: -self.config.keep_last]:
      shutil.rmtree(os.path.join(self.config.root, d), ignore_errors=True)


class _SafetensorsStream:
  """One safetensors file written tensor by tensor. The header is only known at the end (skipped tensors
  are left out), so the space the header of all candidate tensors would need is reserved up front; a
  header of fewer tensors at smaller offsets is never longer. File operations run in order on `pipe`'s
  thread, so the file system's write overlaps the transposition and CRC of the next block."""

  def __init__(self, path: str, tensors: list[_Tensor], pipe: _Pipe):
    self._dtypes = {t.name: _ST_DTYPES[t.dtype.name] for t in tensors}
    self._reserve = len(_header([(t.name, self._dtypes[t.name], t.hf_shape, t.nbytes) for t in tensors]))
    self._reserve += -self._reserve % 8  # the data starts 8-byte aligned
    self._pipe = pipe
    self._f = open(path, "wb")
    self._f.seek(8 + self._reserve)
    self._written: list[tuple[str, tuple[int, ...], int]] = []  # (name, HF shape, nbytes)
    self._end = 0  # data bytes written

  def write(self, name: str, a: np.ndarray, transpose: bool) -> int:
    """Appends `a` (k2jax layout; transposed to HF when `transpose`) in row blocks; returns its CRC-32."""
    hf = a.T if transpose else a
    rows = hf.reshape(hf.shape[0], -1) if hf.ndim > 1 else hf.reshape(1, -1)
    step = max(1, _BLOCK_BYTES // max(1, rows.shape[1] * rows.itemsize))
    crc = 0
    for i in range(0, rows.shape[0], step):
      block = np.ascontiguousarray(rows[i : i + step]).reshape(-1).view(np.uint8)
      crc = zlib.crc32(block, crc)
      self._pipe.submit(self._f.write, block)
    self._written.append((name, hf.shape, a.nbytes))
    self._end += a.nbytes
    return crc

  def drop_last(self) -> None:
    """Cuts the last tensor written out of the file again."""
    _, _, nbytes = self._written.pop()
    self._end -= nbytes
    self._pipe.submit(self._truncate, 8 + self._reserve + self._end)

  def close(self) -> None:
    header = None
    if self._written:
      text = _header([(n, self._dtypes[n], shape, nbytes) for n, shape, nbytes in self._written])
      header = struct.pack("<Q", self._reserve) + text.ljust(self._reserve, b" ")
    self._pipe.submit(self._finish, header)

  def _truncate(self, size: int) -> None:
    self._f.seek(size)
    self._f.truncate()

  def _finish(self, header: bytes | None) -> None:
    if header is not None:
      self._f.seek(0)
      self._f.write(header)
    self._f.close()
    if header is None:  # every candidate tensor was skipped
      os.remove(self._f.name)


class _Pipe:
  """Runs submitted calls in order on one thread, at most one waiting (bounded memory: the block being
  written, the one waiting, the one being prepared). numpy copies, CRCs and file writes release the GIL,
  so preparing and writing overlap. The first failure is raised by the next `submit` or by `close`."""

  def __init__(self):
    self._queue: queue.Queue = queue.Queue(maxsize=1)
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="k2jax-weight-sync-writer", daemon=True)
    self._thread.start()

  def submit(self, fn, *args) -> None:
    if self._error is not None:
      raise self._error
    self._queue.put((fn, args))

  def close(self) -> None:
    """Waits for every submitted call; raises the first failure."""
    self._queue.put(None)
    self._thread.join()
    if self._error is not None:
      raise self._error

  def _run(self) -> None:
    while (item := self._queue.get()) is not None:
      if self._error is None:
        try:
          item[0](*item[1])
        except BaseException as e:  # handed to the submitting thread
          self._error = e


def _header(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
  """The safetensors JSON header of (name, dtype, shape, nbytes) stored back to back."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, dtype, shape, nbytes in tensors:
    header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  return json.dumps(header, separators=(",", ":")).encode()


def _read_header(path: str) -> dict:
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  return header


def _write_index(directory: str, version: int, model_bytes: int) -> None:
  """The HF index of every safetensors file in `directory`, read from their headers (a delta when they
  hold fewer than the model's `model_bytes`)."""
  weight_map, total = {}, 0
  for fname in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
    for name, info in _read_header(os.path.join(directory, fname)).items():
      weight_map[name] = fname
      total += info["data_offsets"][1] - info["data_offsets"][0]
  meta = {"total_size": total, "k2jax_weight_version": str(version), "k2jax_delta": str(total < model_bytes)}
  with open(os.path.join(directory, INDEX_NAME), "w") as f:
    json.dump({"metadata": meta, "weight_map": weight_map}, f, indent=1, sort_keys=True)


def _holders(sharding, shape: tuple[int, ...], n_lead: int) -> dict[tuple[int, ...], list] | None:
  """Index into the `n_lead` leading axes -> the devices (by id) holding that tensor whole; None when some
  device holds only part of a tensor (the trailing axes are split)."""
  out: dict[tuple[int, ...], list] = {}
  for dev, index in sorted(sharding.devices_indices_map(tuple(shape)).items(), key=lambda kv: kv[0].id):
    ranges = [range(*s.indices(n)) for s, n in zip(index, shape)]
    if any(r != range(n) for r, n in zip(ranges[n_lead:], shape[n_lead:])):
      return None
    for lead in itertools.product(*ranges[:n_lead]):
      out.setdefault(lead, []).append(dev)
  return out


def _pick(holders: list, turn: int):
  """One of a tensor's holders, rotating, so replicated tensors are written by every process in turn."""
  return holders[turn % len(holders)]


def _host_tensor(shard, index: tuple[int, ...]) -> np.ndarray:
  """Tensor `index` (global, into the leading axes) of a device shard, on the host. A CPU device's buffer
  is host memory: read in place. Other devices copy this one tensor."""
  local = tuple(i - (s.start or 0) for i, s in zip(index, shard.index))
  if shard.device.platform == "cpu":
    return np.asarray(shard.data)[local]
  return np.asarray(shard.data[local])


def _mesh(leaf) -> Mesh:
  """The trainer's mesh of `leaf` (a one-device mesh for an unsharded array)."""
  s = getattr(leaf, "sharding", None)
  if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
    return s.mesh
  devices = sorted(s.device_set, key=lambda d: d.id) if s is not None else [jax.devices()[0]]
  return Mesh(np.asarray(devices), ("x",))


def _global_sum(n: int) -> int:
  """`n` summed over the JAX processes (a collective: every process calls it)."""
  if jax.process_count() == 1:
    return n
  from jax.experimental import multihost_utils

  return int(np.sum(multihost_utils.process_allgather(np.int32(n))))


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
