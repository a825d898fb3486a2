"""The one Hugging Face writer: every JAX process writes the HF tensors its devices hold, streamed.

Used by `k2jax.save_hf`, `launch/convert.py WORKDIR -> HF` and the remote weight push
(`k2jax.rl.weight_sync`). Every process calls it with the same sharded state (it runs collective
programs on the state's mesh):
  1. plan   from shapes and the mesh alone (the same on every process): each HF tensor is read from the
            leaf's own device shards when a device holds it whole, else from a per-layer export that
            reshards one layer of the leaf so that each device holds whole tensors (experts split over
            the mesh axes that divide them; one expert at a time when none does: never a replicated
            stacked expert tensor). Of the devices holding a tensor one writes it, rotating, so every
            process writes its share. Host (numpy) leaves are written by process 0.
  2. write  each process streams its tensors into its own files (`st_stream`): fetched one at a time,
            transposed to the HF layout on their device (a CPU device's tensors are read in place
            and transposed on the host, tile by tile), cast or block-FP8-quantized on the host in row
            blocks on `threads` threads (`pool.Workers`, consumed in order: the same bytes for any
            count) while a writer thread does the I/O. Host memory: about one tensor of prepared
            blocks (at most `in_flight_bytes`) plus each thread's working block and two more.
  3. agree  an all-gather of each process's first error: if any process failed, every process raises
            (and runs every collective program first, so none is left waiting in one).
`save_hf` then has process 0 write the index, config.json and the tokenizer into the same directory and
swap it into place (`export_dir.write_export`: atomic, refuses directories k2jax did not write). The
export directory must be on a filesystem all processes share: process 0 creates it and broadcasts its
path; a process that cannot see it fails the export (nothing is swapped in).

dtype: None (the param dtype), "float32", "bfloat16", or "fp8": the release's block-FP8 layout (reference
§1.2): F8_E4M3 weights + float32 `weight_scale_inv` [ceil(out/128), ceil(in/128)] for every projection
(`fp8.is_quantized_key`), bf16 embeddings, lm_head, norms and router weight; the router's
`e_score_correction_bias` is float32 whenever a dtype is given (a bf16 bias routes wrongly). "int4": the
Kimi-K2-Thinking layout (`int4.py`): routed experts as compressed-tensors pack-quantized triplets on the
QAT grid, everything else bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k2jax.convert import fp8, int4, pool
from k2jax.convert.errors import CheckpointError
from k2jax.convert.export_dir import broadcast_text, decode_text, encode_text, write_export
from k2jax.convert.layout import Entry, entries
from k2jax.convert.pool import Workers, resolve_threads
from k2jax.convert.hf_dir import get_path
from k2jax.convert.safetensors_io import read_header
from k2jax.convert.st_stream import (
  BLOCK_BYTES,
  FP8_BLOCK,
  OUT_DTYPES,
  WRITE_BUDGET_BYTES,
  Pipe,
  Record,
  SafetensorsStream,
  records,
)
from k2jax.model.config import ConfigError, K2Config

INDEX = "model.safetensors.index.json"
DTYPES = tuple(OUT_DTYPES)  # the `dtype` choices besides None


def out_dtype(entry: Entry, key: str, leaf_dtype, dtype: str | None) -> np.dtype:
  """The dtype HF tensor `key` of `entry` is stored in."""
  if entry.path[-1] == "bias":
    return np.dtype(np.float32) if dtype else np.dtype(leaf_dtype)
  if dtype is None:
    return np.dtype(leaf_dtype)
  if dtype == "fp8":
    return fp8.E4M3 if fp8.is_quantized_key(key) else OUT_DTYPES["bfloat16"]
  if dtype == "int4":
    return int4.INT4 if int4.is_int4_key(key) else OUT_DTYPES["bfloat16"]
  return OUT_DTYPES[dtype]


@dataclasses.dataclass(frozen=True)
class Tensor:
  name: str  # HF key
  index: tuple[int, ...]  # into the leading (layer, expert) axes of its source array
  writer: Any  # the device whose shard of the source is written (None: a host array, process 0 writes it)
  hf_shape: tuple[int, ...]
  out: np.dtype

  @functools.cached_property  # read for every tensor on every write (a push): computed once per plan
  def records(self) -> list[Record]:
    return records(self.name, self.hf_shape, self.out)

  @functools.cached_property
  def nbytes(self) -> int:
    return sum(r.nbytes for r in self.records)

  @property
  def process(self) -> int:
    return 0 if self.writer is None else self.writer.process_index


@dataclasses.dataclass(frozen=True)
class Source:
  """The array some HF tensors are read from: the leaf itself (`export` None), or `leaf[index]` exported
  as [rows, *tensor] sharded per `export` (rows: the experts of a layer, else 1)."""

  entry: Entry
  index: tuple[int, ...]
  export: NamedSharding | None
  tensors: tuple[Tensor, ...]


class Writer:
  """Writes a model's HF tensors from its (sharded) state; see the module docstring. The plan is made on
  the first `write` and kept: later states must have the same shapes and shardings (RL pushes do)."""

  def __init__(
    self,
    cfg: K2Config,
    dtype: str | None = None,
    max_shard_bytes: int = 4 << 30,
    naming: str = "global",
    *,
    threads: int = 0,
    in_flight_bytes: int = WRITE_BUDGET_BYTES,
  ):
    if dtype is not None and dtype not in DTYPES:
      raise ConfigError(f"dtype: expected one of {list(DTYPES)} or None, got {dtype!r}")
    if max_shard_bytes <= 0 or naming not in ("global", "process"):
      raise ConfigError(f"Writer: max_shard_bytes={max_shard_bytes} must be > 0, naming={naming!r} global|process")
    if in_flight_bytes <= 0:
      raise ConfigError(f"Writer: in_flight_bytes={in_flight_bytes} must be > 0")
    self.cfg, self.dtype, self.max_shard_bytes, self.naming = cfg, dtype, max_shard_bytes, naming
    # threads transposing, casting and quantizing blocks (0: two per core; the file bytes do not depend on it)
    self.threads, self.in_flight_bytes = resolve_threads(threads, "threads"), in_flight_bytes
    self._plan: list[Source] | None = None
    self._files: dict[int, list[tuple[str, list[Tensor]]]] = {}

  @property
  def total_bytes(self) -> int:
    """Bytes of every tensor the model stores (all processes' files together)."""
    return sum(t.nbytes for src in self._plan or () for t in src.tensors)

  @property
  def n_tensors(self) -> int:
    """HF tensors the model stores (a scale grid counted with its weight)."""
    return sum(len(src.tensors) for src in self._plan or ())

  def write(self, state: Mapping, directory: str, skip: Callable[[str, int], bool] | None = None) -> dict[str, int]:
    """Streams this process's tensors into `directory`; returns {HF name: CRC-32} of those kept.
    `skip(name, crc)` True cuts a tensor out of its file again (weight-sync deltas). Collective."""
    if self._plan is None:
      self._plan = make_plan(self.cfg, state, self.dtype)
      self._files = plan_files(self._plan, self.max_shard_bytes, self.naming)
    mine = self._files.get(jax.process_index(), [])
    error: BaseException | None = None
    pipe, streams = Pipe(), []
    # Prepared blocks in flight: at most one tensor's bytes (the writer's memory stays "one tensor plus a
    # few blocks" for any thread count), never more than in_flight_bytes, at least a few blocks.
    largest = max((t.nbytes for _, ts in mine for t in ts), default=0)
    budget = min(self.in_flight_bytes, max(4 * BLOCK_BYTES, largest))
    workers = Workers(self.threads, budget, pool.WRITE, "k2jax-write")
    if not os.path.isdir(directory):
      error = CheckpointError(
        f"{directory}: not visible on process {jax.process_index()} (the directory must be on a "
        "filesystem every process shares)"
      )
    else:
      try:
        recs = [(os.path.join(directory, f), [r for t in ts for r in t.records]) for f, ts in mine]
        streams = [SafetensorsStream(path, rs, pipe, workers, crc=skip is not None) for path, rs in recs]
      except OSError as e:
        error = e
    stream_of = {t.name: st for st, (_, ts) in zip(streams, mine) for t in ts}
    written: dict[str, int] = {}
    for src in self._plan:
      array = get_path(state, src.entry.path)
      if src.export is not None:  # a collective program: run on every process, even after a failure
        array = self._export(src)(array, *src.index)
      if error is None:
        try:
          self._write_source(src, array, stream_of, skip, written)
        except Exception as e:  # reported to every process by _agree
          error = e
      del array
    if error is None:
      try:
        workers.drain()  # the last tensors' blocks (each tensor's are queued behind the one before)
      except Exception as e:
        error = e
    workers.close(cancel=error is not None)  # a failed export stops quantizing the blocks still queued
    error = _close(streams, pipe, error)
    _agree(error)
    return written

  def _write_source(self, src: Source, array, stream_of: dict, skip, written: dict) -> None:
    shards = {s.device: s for s in array.addressable_shards} if isinstance(array, jax.Array) else None
    on_host: dict = {}  # a CPU device's shard as numpy, made once per source rather than once per tensor
    for t in (t for t in src.tensors if t.name in stream_of):
      stream, transpose = stream_of[t.name], src.entry.transpose
      if shards is None:  # a host array: transposed on the way to the file
        host = np.asarray(array[t.index])
      else:  # transposed on its device, or for a CPU device by the stream (`_host_tensor`)
        host, transpose = _host_tensor(shards[t.writer], t.index, transpose, on_host)
      stream.write_async(t.name, host, transpose, t.out, functools.partial(_kept, stream, t.name, skip, written))

  def _export(self, src: Source):
    return _export_fn(src.entry.kind == "expert" and len(src.index) == 1, src.export)


@functools.cache
def _export_fn(rows_axis: bool, sharding: NamedSharding):
  """jit: (leaf, *index) -> leaf[index] as [rows, *tensor] sharded per `sharding` (rows_axis: the
  indexed layer's experts are the rows). Cached across writers: one compile per leaf shape."""

  def export(x, *index):
    for i in index:
      x = jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
    return x if rows_axis else x[None]

  return jax.jit(export, out_shardings=sharding)


@functools.cache
def _take_transposed(n_index: int):
  """jit: (x, *index) -> x[index].T on x's device (the index traced: one compile per shape)."""

  def take(x, *index):
    for i in index:
      x = jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
    return x.T

  return jax.jit(take)


def save_hf(
  cfg: K2Config,
  state: Mapping,
  dst: str,
  *,
  dtype: str | None = None,
  max_shard_bytes: int = 4 << 30,
  write_extra: Callable[[str], None] | None = None,
  threads: int = 0,
) -> None:
  """Write `state` as an HF directory at `dst` (sharded safetensors + index + config.json), atomically.

  Every process calls it (multi-process: each writes its own tensors, process 0 the rest and the swap).
  `write_extra(tmp)` (process 0) adds more files, e.g. the tokenizer, inside the same atomic export.
  `threads` transpose, cast and quantize on this host (0: two per core); the files do not depend on it."""
  writer = Writer(cfg, dtype, max_shard_bytes, threads=threads)
  if jax.process_index() != 0:
    tmp = broadcast_text("")
    if tmp.startswith("\0"):
      raise CheckpointError(f"{dst}: process 0 could not start the export: {tmp[1:]}")
    error = None
    try:
      writer.write(state, tmp)
    except BaseException as e:
      error = e
    _agree(error)  # process 0's index, config and swap
    return

  entered = False

  def write(tmp: str) -> None:
    nonlocal entered
    entered = True
    broadcast_text(tmp)
    writer.write(state, tmp)
    write_index(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_config(cfg, dtype), f, indent=2, sort_keys=True)
    if write_extra is not None:
      write_extra(tmp)

  error = None
  try:
    write_export(dst, "hf", write)
  except BaseException as e:
    if not entered:
      broadcast_text("\0" + f"{type(e).__name__}: {e}")
      raise
    error = e
  _agree(error)


def hf_config(cfg: K2Config, dtype: str | None) -> dict:
  """config.json of an export in `dtype`: `quantization_config` exactly when FP8 (a model read from the
  FP8 release carries the release's in its extra fields; a bf16 export of it must not claim FP8). No
  `modules_to_not_convert`: every linear is quantized (the router is not a Linear in the engines)."""
  out = cfg.to_hf_dict()
  out.pop("quantization_config", None)
  out["torch_dtype"] = "bfloat16" if dtype in ("fp8", "int4") else dtype or cfg.param_dtype
  if dtype == "fp8":
    out["quantization_config"] = fp8.QuantConfig(FP8_BLOCK).to_hf()
  if dtype == "int4":  # the routed experts packed, everything else bf16 and listed in `ignore`
    out["quantization_config"] = int4.release_config()
  return out


def write_index(directory: str, metadata: Mapping[str, str] | None = None) -> int:
  """The HF index of every safetensors file in `directory`, read from their headers; returns total_size."""
  weight_map, total = {}, 0
  for fname in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
    for name, info in read_header(os.path.join(directory, fname)).items():
      weight_map[name] = fname
      total += info.nbytes
  with open(os.path.join(directory, INDEX), "w") as f:
    json.dump(
      {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": dict(sorted(weight_map.items()))},
      f,
      indent=2,
    )
  return total


def make_plan(cfg: K2Config, state: Mapping, dtype: str | None) -> list[Source]:
  """Where every HF tensor is read from and who writes it, from shapes and the mesh alone."""
  plan, turn = [], itertools.count()
  for entry in entries(cfg):
    leaf = get_path(state, entry.path)
    keys = entry.keys(cfg)
    n_lead = len(keys[0][0])
    shape = tuple(leaf.shape[n_lead:])
    hf_shape = shape[::-1] if entry.transpose else shape

    def tensor(idx, key, writer, entry=entry, hf_shape=hf_shape, leaf_dtype=leaf.dtype):
      return Tensor(key, idx, writer, hf_shape, out_dtype(entry, key, leaf_dtype, dtype))

    if not isinstance(leaf, jax.Array):  # host array: process 0 writes it
      plan.append(Source(entry, (), None, tuple(tensor(i, k, None) for i, k in keys)))
      continue
    holders = _holders(leaf.sharding, leaf.shape, n_lead)
    if holders is not None:  # every device holds whole tensors: read the leaf's own shards
      plan.append(Source(entry, (), None, tuple(tensor(i, k, _pick(holders[i], next(turn))) for i, k in keys)))
      continue
    plan += _export_sources(entry, leaf, keys, shape, tensor, turn)
  return plan


def _export_sources(entry, leaf, keys, shape, tensor, turn) -> list[Source]:
  """Per-layer (per-expert when no mesh axis divides the experts) exports of a leaf whose devices hold
  only parts of its tensors."""
  mesh = _mesh(leaf)
  rows = leaf.shape[1] if entry.kind == "expert" else 1
  axes, size = [], 1  # mesh axes that split the rows (experts) evenly
  for a in sorted(mesh.axis_names, key=lambda a: a != "expert"):
    if mesh.shape[a] > 1 and rows % (size * mesh.shape[a]) == 0:
      axes.append(a)
      size *= mesh.shape[a]
  if entry.kind == "expert" and not axes:
    rows = 1  # one expert at a time, replicated: bounded by one tensor per device
  export = NamedSharding(mesh, P(tuple(axes)) if axes else P())
  row_holders = _holders(export, (rows, *shape), 1)
  out = []
  for c in range(len(keys) // rows):
    chunk = keys[c * rows : (c + 1) * rows]
    index = () if entry.kind == "global" else chunk[0][0][: 1 if rows > 1 or entry.kind == "layer" else 2]
    tensors = [tensor((r,), k, _pick(row_holders[(r,)], next(turn))) for r, (_, k) in enumerate(chunk)]
    out.append(Source(entry, tuple(index), export, tuple(tensors)))
  return out


def plan_files(plan: list[Source], max_shard_bytes: int, naming: str) -> dict[int, list[tuple[str, list[Tensor]]]]:
  """Every process's files: process -> [(file name, its tensors in write order)], each at most
  max_shard_bytes (a larger tensor gets a file of its own). `global` names number all processes' files
  together (`model-00003-of-00008.safetensors`); `process` names them per process (`model-p00001-00002`)."""
  groups: dict[int, list[list[Tensor]]] = {}
  sizes: dict[int, int] = {}
  for t in (t for src in plan for t in src.tensors):
    g = groups.setdefault(t.process, [[]])
    if g[-1] and sizes.get(t.process, 0) + t.nbytes > max_shard_bytes:
      g.append([])
      sizes[t.process] = 0
    g[-1].append(t)
    sizes[t.process] = sizes.get(t.process, 0) + t.nbytes
  total, k, out = sum(len(g) for g in groups.values()), 0, {}
  for p in sorted(groups):
    for j, ts in enumerate(groups[p]):
      k += 1
      name = f"model-{k:05d}-of-{total:05d}" if naming == "global" else f"model-p{p:05d}-{j + 1:05d}"
      out.setdefault(p, []).append((name + ".safetensors", ts))
  return out


def iter_hf_tensors(cfg: K2Config, state: Mapping, dtype: str | None) -> Iterator[tuple[str, np.ndarray]]:
  """(HF key, numpy tensor) in HF order, one at a time: the plain reading of the layout that tests
  compare the writer against (float32 / bfloat16 / None; FP8 has two tensors per key, see `Writer`)."""
  if dtype in ("fp8", "int4"):
    raise ValueError(f"iter_hf_tensors: {dtype} stores several tensors per key; write it with `Writer`")
  for entry in entries(cfg):
    leaf = get_path(state, entry.path)
    for idx, key in entry.keys(cfg):
      t = np.asarray(jax.device_get(leaf[idx] if idx else leaf))
      t = t.T if entry.transpose else t
      yield key, np.ascontiguousarray(t, dtype=out_dtype(entry, key, leaf.dtype, dtype))


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


def _host_tensor(shard, index: tuple[int, ...], transpose: bool, on_host: dict) -> tuple[np.ndarray, bool]:
  """Tensor `index` (global, into the leading axes) of a device shard on the host, and whether the stream
  still has to transpose it. A CPU device's buffer is host memory: read in place (its numpy view kept in
  `on_host` for the source's next tensors: `shard.data` + `np.asarray` per expert was 0.14 s of the main
  thread per `small` FP8 export), transposed by the stream's tiled numpy transpose (XLA:CPU's 2-D
  transposes ran at ~0.1 Gelem/s on [1024, 32768], the tiled one at ~1-2); other devices transpose on the
  device and copy this one tensor."""
  local = tuple(i - (s.start or 0) for i, s in zip(index, shard.index))
  if shard.device.platform == "cpu":
    if shard.device not in on_host:
      on_host[shard.device] = np.asarray(shard.data)
    return on_host[shard.device][local], transpose
  if transpose:
    return np.asarray(_take_transposed(len(local))(shard.data, *local)), False
  return np.asarray(shard.data[local]), False


def _mesh(leaf) -> Mesh:
  """The mesh of `leaf` (a mesh over its devices when it has no named one)."""
  s = leaf.sharding
  if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
    return s.mesh
  return Mesh(np.asarray(sorted(s.device_set, key=lambda d: d.id)), ("x",))


def _kept(stream: SafetensorsStream, name: str, skip, written: dict, crc: int) -> None:
  """A tensor's bytes are all in the pipe: keep it (record its CRC) or, when `skip` says the engine holds
  it already, cut it from its file again."""
  if skip is not None and skip(name, crc):
    stream.drop_last()
  else:
    written[name] = crc


def _close(streams: list, pipe: Pipe, error: BaseException | None) -> BaseException | None:
  """Closes every file and the pipe; the first error of the write or of closing."""
  for st in streams:
    try:
      st.close()
    except BaseException as e:
      error = error or e
  try:
    pipe.close()
  except BaseException as e:
    error = error or e
  return error


def _agree(error: BaseException | None) -> None:
  """Raises on every process when any process failed (a collective: every process calls it): its own
  error, else a CheckpointError quoting the first failed process's."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    msgs = multihost_utils.process_allgather(encode_text("" if error is None else f"{type(error).__name__}: {error}"))
    if error is None:
      for p, m in enumerate(msgs):
        if m.any():
          raise CheckpointError(f"process {p} failed the export: {decode_text(m)}")
  if error is not None:
    raise error
