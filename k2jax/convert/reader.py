"""The one Hugging Face reader: each process reads only the byte ranges of the slices its devices hold.

`read_state(path, cfg, abstract)` takes the abstract state (jax.ShapeDtypeStruct leaves with shardings)
and returns it as jax.Arrays. For every leaf and every distinct slice among this process's addressable
devices it reads the matching block of each HF tensor behind the slice (`safetensors_io.read_block`:
only those bytes) into one host buffer stacked over layers/experts (one HF key per layer and expert,
`layout.py`), with the scale rows/cols of that block for block-FP8; puts the stored bytes on those
devices and there (`blockops.convert`) dequantizes (ragged edges exact), transposes HF `[out, in]` to
k2jax `[in, out]` and casts to the leaf dtype. Blocks under DEVICE_CONVERT_BYTES are converted the same
way with numpy on the host (`fp8.dequantize`), which is also `load_hf`'s path; the two are bitwise equal.
Blocks bound for CPU devices (whose memory is this host's) are built once in a host buffer the device
aliases: read straight in, or read in cache-sized row slabs and tile-transposed, FP8 dequantized by XLA
on that device in groups first (`Checkpoint.leaf_block`); bitwise equal to the other two. Host
memory is this process's shards plus at most `read_budget_bytes` of blocks in flight (one block when a
single block is larger). Blocks are read and converted on `threads` threads (`pool.Workers`; 0: one
per core), the next ones read while the current ones convert, and placed in job order: the arrays are
bitwise the same for any thread count, and a failing thread fails the read naming the tensor and file.
`load_hf` is the same reader into whole numpy leaves (one host, small models).

Everything is validated before the first tensor byte is read (config.json, quantization_config, index,
every header, shape, dtype and scale), so bad input fails fast with a CheckpointError naming the file and
tensor, and a caller that writes afterwards (launch/convert.py) has written nothing.

Why not orbax v1 `SafetensorsLayout` (orbax-checkpoint 0.12.8, installed): it reads exactly the byte
ranges of each host's shards too, but maps one file tensor to one abstract leaf of the same shape and
dtype. k2jax leaves are stacked [L, E, in, out] over many HF tensors, transposed, and the release's
weights are F8_E4M3 with a separate scale grid to apply per block; none of that fits its leaf model.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from k2jax.convert import blockops, fp8, int4, pool
from k2jax.convert.errors import CheckpointError
from k2jax.convert.hf_dir import INDEX, abstract_state, check_unexpected, get_path, read_config, set_path, weight_map
from k2jax.convert.layout import Entry, entries, hf_shape
from k2jax.convert.pool import Workers, resolve_threads
from k2jax.convert.safetensors_io import ShardFiles, TensorInfo, read_block, read_header
from k2jax.model.config import K2Config

READ_BUDGET_BYTES = 2 << 30  # default in-flight host buffer (orbax's SafetensorsLayout uses 2 GiB too)
# Blocks of at least this many (leaf) bytes are converted on the device (`blockops.convert`: a compile per
# distinct block shape, vectorised), smaller ones (norms, biases, tiny models) with numpy on the host.
DEVICE_CONVERT_BYTES = 1 << 20
HOST_CONVERT_PLATFORMS = ("cpu",)  # devices whose memory is this host's: filled on the host (see `read_state`)
SLAB_BYTES = 1 << 20  # rows of a transposed tensor read at a time: still in cache when the transpose reads them
# Leaf bytes per reader job: a stacked expert leaf is many jobs (one per leaf left one thread doing most
# of an import), each large enough that a hand-off to a thread is noise.
JOB_BYTES = 32 << 20
XLA_GROUP_ELEMS = 1 << 22  # FP8 elements dequantized per XLA call on a CPU device (bounds its transients)
_FLOAT = ("F32", "BF16", "F16")
_LEAD = {"global": 0, "layer": 1, "expert": 2}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # stored bytes travel as unsigned ints


@dataclasses.dataclass(frozen=True)
class ReadConfig:
  """How the reader uses the host: bytes of blocks in flight, and threads reading and converting them
  (0: two per core this process may run on, `pool.THREADS_PER_CORE`). Results are bitwise the same for
  any thread count."""

  read_budget_bytes: int = READ_BUDGET_BYTES
  threads: int = 0

  def __post_init__(self):
    b = self.read_budget_bytes
    if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
      raise ValueError(f"read_budget_bytes must be positive, got {b!r}")
    object.__setattr__(self, "threads", resolve_threads(self.threads, "threads"))

  @property
  def job_bytes(self) -> int:
    """Leaf bytes per reader job (`_pieces`): a large leaf is many jobs, so every thread has work."""
    return min(self.read_budget_bytes, JOB_BYTES)


@dataclasses.dataclass(frozen=True)
class Quant:
  """The directory's block-FP8 layout: block size and the modules it leaves unquantized."""

  block: tuple[int, int]
  skip: tuple[str, ...]  # modules_to_not_convert / ignored_layers (module names, no `.weight`)
  int4: bool = False  # the Kimi-K2-Thinking INT4 layout (`int4.py`): routed experts packed, the rest bf16

  def quantizes(self, key: str) -> bool:
    if self.int4:
      return int4.is_int4_key(key)
    module = key.rsplit(".", 1)[0]
    skipped = any(module == m or module.endswith("." + m) or module.startswith(m + ".") for m in self.skip)
    return fp8.is_quantized_key(key) and not skipped


@dataclasses.dataclass(frozen=True)
class RawBlock:
  """Stored bytes of one leaf block (unsigned ints of the file dtype's width) and how to convert them."""

  raw: np.ndarray  # [lead..., rows, cols] HF orientation (or [lead..., n] for vectors)
  scale: np.ndarray | None  # [lead..., grid rows, grid cols] float32 for block-FP8
  dtype: str  # safetensors dtype of `raw`
  origin: tuple[int, int]  # the block's first element within the scale sub-grid's first block
  transpose: bool


@dataclasses.dataclass
class Checkpoint:
  """A validated HF directory: every tensor's header entry, keyed by HF name."""

  path: str
  cfg: K2Config
  quant: Quant | None
  tensors: dict[str, TensorInfo]

  def leaf_block(self, files: ShardFiles, entry: Entry, leaf, bounds, xla_device=None, out=None) -> np.ndarray:
    """The block `bounds` of the k2jax leaf `entry` (shape `leaf.shape`), in the leaf's dtype, in a buffer a
    CPU device takes without a copy (or into `out`, a C-contiguous view of such a buffer). With
    `xla_device` (a CPU device) FP8 tensors are dequantized there, XLA_GROUP_ELEMS at a time
    (`_xla_dequantized`); everything else with numpy (`_fill`)."""
    n_lead = _LEAD[entry.kind]
    keys = dict(entry.keys(self.cfg))
    shape = [hi - lo for lo, hi in bounds]
    if out is None:
      out = blockops.aligned_empty(shape, leaf.dtype)
    elif list(out.shape) != shape or not out.flags.c_contiguous:
      raise ValueError(f"leaf_block: {'.'.join(entry.path)}: buffer {out.shape} is not a contiguous {shape}")
    flat = out.reshape(-1, *out.shape[n_lead:])  # a view: `out` is contiguous
    inner = bounds[n_lead:]
    hf_bounds = inner[::-1] if entry.transpose else inner
    leads = itertools.product(*(range(lo, hi) for lo, hi in bounds[:n_lead]))
    if self._int4(entry):  # dequantized per slice from its packed words and scales (`int4.read_slice`)
      read = functools.partial(_read_named, files, self.tensors)
      for j, i in enumerate(leads):
        packed = self.tensors[int4.triplet(keys[i])[0]]
        with _naming(packed):
          _put(flat[j], int4.read_slice(read, keys[i], *hf_bounds, leaf.dtype), entry.transpose)
      return out
    infos = [self.tensors[keys[i]] for i in leads]
    per_tensor = int(np.prod([hi - lo for lo, hi in hf_bounds]))
    j = 0
    while j < len(infos):
      if xla_device is None or infos[j].dtype != "F8_E4M3":
        with _naming(infos[j]):
          self._fill(files, infos[j], hf_bounds, flat[j], entry.transpose)
        j += 1
        continue
      n = 1
      while j + n < len(infos) and infos[j + n].dtype == "F8_E4M3" and (n + 1) * per_tensor <= XLA_GROUP_ELEMS:
        n += 1
      with _naming(*infos[j : j + n]):
        group = self._xla_dequantized(files, infos[j : j + n], hf_bounds, leaf.dtype, xla_device)
        for g in range(n):
          _put(flat[j + g], group[g], entry.transpose)
      j += n
    return out

  def _int4(self, entry: Entry) -> bool:
    """Whether `entry`'s tensors are stored as INT4 triplets (the routed experts of an INT4 release)."""
    return self.quant is not None and self.quant.int4 and entry.kind == "expert"

  def _fill(self, files: ShardFiles, t: TensorInfo, hf_bounds, dst: np.ndarray, transpose: bool) -> None:
    """dst = block `hf_bounds` of tensor `t`, converted: read straight into `dst` when it keeps the file
    dtype; transposed in row slabs of about SLAB_BYTES (read while the slab fits in cache, then tiled)."""
    if t.dtype == "F8_E4M3":
      return _put(dst, self._tensor_block(files, t.key, hf_bounds), transpose)
    if not transpose:
      if dst.dtype == t.np_dtype:
        read_block(files, t, hf_bounds, into=dst)
      else:
        dst[...] = read_block(files, t, hf_bounds)
      return
    (r0, r1), (c0, c1) = hf_bounds
    step = max(1, SLAB_BYTES // max(1, (c1 - c0) * t.np_dtype.itemsize))
    step = step if step < blockops.TILE else step - step % blockops.TILE
    for r in range(r0, r1, step):
      e = min(r + step, r1)
      blockops.transpose_into(dst[:, r - r0 : e - r0], read_block(files, t, ((r, e), (c0, c1))))

  def _xla_dequantized(self, files: ShardFiles, infos: list[TensorInfo], hf_bounds, out_dtype, device) -> np.ndarray:
    """[len(infos), rows, cols] of block `hf_bounds` of these FP8 tensors in `out_dtype` (HF orientation),
    dequantized by one `blockops.convert` on the CPU `device` (input buffers aligned: no copies)."""
    grid, origin = self._grid(hf_bounds)
    raw = blockops.aligned_empty([len(infos)] + [hi - lo for lo, hi in hf_bounds], np.uint8)
    scale = blockops.aligned_empty([len(infos)] + [hi - lo for lo, hi in grid], np.float32)
    for g, t in enumerate(infos):
      read_block(files, t, hf_bounds, into=raw[g])
      read_block(files, self.tensors[t.key + fp8.SCALE_SUFFIX], grid, into=scale[g])
    q = {"dtype": "F8_E4M3", "block": self.quant.block, "origin": origin, "transpose": False}
    return np.asarray(
      blockops.convert(jax.device_put(raw, device), jax.device_put(scale, device), **q, out_dtype=out_dtype)
    )

  def _grid(self, hf_bounds) -> tuple[tuple[tuple[int, int], tuple[int, int]], tuple[int, int]]:
    """The scale rows/cols that block `hf_bounds` touches, and its first element within the first block."""
    (r0, r1), (c0, c1) = hf_bounds
    b0, b1 = self.quant.block
    grid = ((r0 // b0, -(-r1 // b0)), (c0 // b1, -(-c1 // b1)))
    return grid, (r0 - grid[0][0] * b0, c0 - grid[1][0] * b1)

  def raw_block(self, files: ShardFiles, entry: Entry, bounds: tuple[tuple[int, int], ...]) -> RawBlock | None:
    """The bytes behind the block `bounds` of leaf `entry` as stored (HF orientation, file dtype, stacked
    over the leading axes; FP8 with its stacked scale sub-grid), for `blockops.convert` on the device.
    None when the leaf's tensors do not share one dtype (then `leaf_block` converts on the host)."""
    if self._int4(entry):
      return None  # dequantized on the host, per slice
    n_lead = _LEAD[entry.kind]
    keys = dict(entry.keys(self.cfg))
    lead = list(itertools.product(*(range(lo, hi) for lo, hi in bounds[:n_lead])))
    infos = [self.tensors[keys[i]] for i in lead]
    if len({t.dtype for t in infos}) != 1:
      return None
    inner = bounds[n_lead:]
    hf_bounds = inner[::-1] if entry.transpose else inner
    lead_shape = [hi - lo for lo, hi in bounds[:n_lead]]
    raw = blockops.aligned_empty(lead_shape + [hi - lo for lo, hi in hf_bounds], _UINT[infos[0].np_dtype.itemsize])
    flat = raw.reshape(-1, *raw.shape[n_lead:])
    quantized = infos[0].dtype == "F8_E4M3"
    if quantized:
      grid, origin = self._grid(hf_bounds)
      scale = blockops.aligned_empty(lead_shape + [hi - lo for lo, hi in grid], np.float32)
      flat_s = scale.reshape(-1, *scale.shape[n_lead:])
    for j, t in enumerate(infos):
      with _naming(t):
        read_block(files, t, hf_bounds, into=flat[j])
        if quantized:
          read_block(files, self.tensors[t.key + fp8.SCALE_SUFFIX], grid, into=flat_s[j])
    if not quantized:
      return RawBlock(raw, None, infos[0].dtype, (0, 0), entry.transpose)
    return RawBlock(raw, scale, infos[0].dtype, origin, entry.transpose)

  def _tensor_block(self, files: ShardFiles, key: str, bounds) -> np.ndarray:
    t = self.tensors[key]
    w = read_block(files, t, bounds)
    if t.dtype != "F8_E4M3":
      return w
    grid, origin = self._grid(bounds)
    s = read_block(files, self.tensors[key + fp8.SCALE_SUFFIX], grid)
    return fp8.dequantize(w, s, self.quant.block, origin=origin)


def _read_named(files: ShardFiles, tensors: dict[str, TensorInfo], name: str, bounds) -> np.ndarray:
  return read_block(files, tensors[name], bounds)


@contextlib.contextmanager
def _naming(*infos: TensorInfo):
  """A failure reading or converting these tensors (on a reader thread) as one naming the tensor and its
  file; CheckpointErrors already name both (`read_into`: a shard truncated after its header was read)."""
  try:
    yield
  except CheckpointError:
    raise
  except Exception as e:
    t = infos[0]
    more = f" (and {len(infos) - 1} more tensors of its group)" if len(infos) > 1 else ""
    raise RuntimeError(f"reading {t.key}{more} from {t.file}: {type(e).__name__}: {e}") from e


def _put(dst: np.ndarray, block: np.ndarray, transpose: bool) -> None:
  if transpose:
    blockops.transpose_into(dst, block)
  else:
    dst[...] = block


def open_checkpoint(path: str, cfg: K2Config) -> Checkpoint:
  """Validate `path` against `cfg` (architecture of its config.json) without reading tensor data."""
  quant = read_quant(path)
  wmap = weight_map(path)
  tensors = _headers(path, wmap)
  known = set()
  abstract = abstract_state(cfg)
  for entry in entries(cfg):
    want = hf_shape(get_path(abstract, entry.path).shape, entry)
    for _, key in entry.keys(cfg):
      if quant is not None and quant.int4 and entry.kind == "expert":
        known.update(_check_int4(tensors, key, want))
        continue
      if key not in tensors:
        raise CheckpointError(f"{path}: tensor {key!r} is missing (needed for k2jax {'.'.join(entry.path)})")
      known.add(key)
      if _check_tensor(tensors, quant, key, want):
        known.add(key + fp8.SCALE_SUFFIX)
  check_unexpected(path, cfg, wmap, known)
  return Checkpoint(path, cfg, quant, tensors)


def read_quant(path: str) -> Quant | None:
  """config.json's `quantization_config` (None when the weights are not quantized)."""
  cfg_path = os.path.join(path, "config.json")
  try:
    with open(cfg_path) as f:
      raw = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{cfg_path}: cannot read config.json ({e})") from e
  qc = raw.get("quantization_config") if isinstance(raw, dict) else None
  if qc is None:
    return None
  if int4.is_release_config(qc):
    int4.check_config(qc, cfg_path)
    return Quant((0, 0), (), int4=True)
  block = fp8.QuantConfig.from_hf(qc, cfg_path).block
  skip = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
  return Quant(block, skip)


def read_state(
  path: str, cfg: K2Config, abstract: dict, *, read_budget_bytes: int = READ_BUDGET_BYTES, threads: int = 0
) -> dict:
  """`abstract` (pure dict of ShapeDtypeStruct; leaves without a sharding go to this process's first
  device) as jax.Arrays read from the HF directory `path`; this process reads only its own slices, on
  `threads` threads (0: two per core) with at most `read_budget_bytes` of blocks in flight."""
  rc = ReadConfig(read_budget_bytes, threads)
  ckpt = open_checkpoint(path, cfg)
  here = SingleDeviceSharding(jax.local_devices()[0])
  jobs, shardings, outs = [], {}, {}
  for entry in entries(cfg):
    leaf = get_path(abstract, entry.path)
    sharding = getattr(leaf, "sharding", None) or here
    shardings[entry.path] = sharding
    by_slice = collections.defaultdict(list)
    for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
      by_slice[_bounds(index, leaf.shape)].append(device)
    for bounds, devices in by_slice.items():
      pieces = _pieces(bounds, _LEAD[entry.kind], np.dtype(leaf.dtype).itemsize, rc.job_bytes)
      # CPU devices: the "device" is this host; the slice's buffer is filled in place, piece by piece on
      # the threads, and handed to the devices once whole (aliased: no second copy)
      on_host = all(d.platform in HOST_CONVERT_PLATFORMS for d in devices)
      fill = _Fill(bounds, leaf.dtype, len(pieces)) if on_host else None
      for piece in pieces:
        nbytes = int(np.prod([hi - lo for lo, hi in piece])) * np.dtype(leaf.dtype).itemsize
        jobs.append((entry, leaf, piece, devices, nbytes, bounds, fill))

  def read(files, job):
    entry, leaf, piece, devices, nbytes, _, fill = job
    # Small blocks: numpy is cheaper than a compile per shape. CPU devices: filled on the host (tiled
    # transposes: XLA:CPU's are slow on some shapes), FP8 dequantized by XLA there without the
    # transpose (`blockops`).
    small = nbytes < DEVICE_CONVERT_BYTES
    if fill is not None:
      return ckpt.leaf_block(files, entry, leaf, piece, None if small else devices[0], out=fill.view(piece))
    bounds = piece
    if not small:
      block = ckpt.raw_block(files, entry, bounds)
      if block is not None:
        return block
    return ckpt.leaf_block(files, entry, leaf, bounds)

  def place(job, block):
    try:
      _place(job, block)
    except CheckpointError:
      raise
    except Exception as e:  # named by the piece's first tensor (looked up only on failure)
      entry, piece = job[0], job[2]
      t = ckpt.tensors[dict(entry.keys(cfg))[tuple(lo for lo, _ in piece[: _LEAD[entry.kind]])]]
      raise RuntimeError(f"reading {t.key} from {t.file}: placing its block: {type(e).__name__}: {e}") from e

  def _place(job, block):
    entry, leaf, piece, devices, _, bounds, fill = job
    if fill is not None:
      if fill.piece_done():
        buf = fill.take()
        for d in devices:
          outs[(entry.path, bounds, d)] = jax.device_put(buf, d).block_until_ready()
      return
    for d in devices:  # blocking per device: at most one converted piece in flight beyond the shards
      if isinstance(block, np.ndarray):  # converted on the host (aligned: a CPU device aliases it)
        value = jax.device_put(block, d)
      else:
        scale = None if block.scale is None else jax.device_put(block.scale, d)
        q = {"dtype": block.dtype, "block": None if scale is None else ckpt.quant.block, "origin": block.origin}
        value = blockops.convert(
          jax.device_put(block.raw, d), scale, **q, transpose=block.transpose, out_dtype=leaf.dtype
        )
      key = (entry.path, bounds, d)
      if piece == bounds:
        outs[key] = value.block_until_ready()
        continue
      if key not in outs:  # the slice is assembled in place from its pieces (donated: no second copy)
        outs[key] = jnp.zeros([hi - lo for lo, hi in bounds], leaf.dtype, device=d)
      at = tuple(p[0] - b[0] for p, b in zip(piece, bounds))
      outs[key] = _insert(outs[key], value, at).block_until_ready()

  _run(jobs, rc, read, place)
  state: dict = {}
  for entry in entries(cfg):
    leaf = get_path(abstract, entry.path)
    mine = [v for (path, _, _), v in outs.items() if path == entry.path]
    set_path(state, entry.path, jax.make_array_from_single_device_arrays(leaf.shape, shardings[entry.path], mine))
  return state


@functools.partial(jax.jit, donate_argnums=0)
def _insert(out, piece, at):
  return jax.lax.dynamic_update_slice(out, piece, at)


def _pieces(bounds, n_lead: int, itemsize: int, budget: int) -> list[tuple[tuple[int, int], ...]]:
  """`bounds` cut along its stacked (layer, expert) axes into pieces of at most `budget` bytes where
  possible (one HF tensor's block is the smallest piece), so no host or device transient exceeds it."""
  inner = int(np.prod([hi - lo for lo, hi in bounds[n_lead:]])) * itemsize
  sizes = [hi - lo for lo, hi in bounds[:n_lead]]
  if n_lead == 0 or inner * int(np.prod(sizes)) <= budget:
    return [bounds]
  per_layer = inner * (sizes[1] if n_lead == 2 else 1)
  (l0, l1), rest = bounds[0], bounds[1:]
  if per_layer <= budget or n_lead == 1:
    step = max(1, budget // per_layer)
    return [((a, min(a + step, l1)), *rest) for a in range(l0, l1, step)]
  (e0, e1), inner_b = bounds[1], bounds[2:]
  step = max(1, budget // inner)
  return [((l, l + 1), (a, min(a + step, e1)), *inner_b) for l in range(l0, l1) for a in range(e0, e1, step)]


def load_hf(
  path: str, *, threads: int = 0, read_budget_bytes: int = READ_BUDGET_BYTES, **k2jax_fields
) -> tuple[K2Config, dict]:
  """Read an HF directory into whole numpy leaves: (config, pure state dict in the config's param dtype).
  For one host and small models; sharded runs use `read_state`."""
  rc = ReadConfig(read_budget_bytes, threads)
  cfg = read_config(path, **k2jax_fields)
  ckpt = open_checkpoint(path, cfg)
  abstract = abstract_state(cfg)
  state: dict = {}
  jobs = []
  for entry in entries(cfg):
    leaf = get_path(abstract, entry.path)
    bounds = tuple((0, d) for d in leaf.shape)
    pieces = _pieces(bounds, _LEAD[entry.kind], np.dtype(leaf.dtype).itemsize, rc.job_bytes)
    fill = _Fill(bounds, leaf.dtype, len(pieces))
    for piece in pieces:
      jobs.append((entry, leaf, piece, fill, int(np.prod([hi - lo for lo, hi in piece])) * leaf.dtype.itemsize))

  def read(files, job):
    return ckpt.leaf_block(files, job[0], job[1], job[2], out=job[3].view(job[2]))

  def done(job, _):
    if job[3].piece_done():
      set_path(state, job[0].path, job[3].take())

  _run(jobs, rc, read, done)
  return cfg, state


class _Fill:
  """A slice converted on the host into one buffer (aligned: a CPU device aliases it), its pieces
  (along the stacked axes: contiguous views) filled on the reader threads; counts the pieces left."""

  def __init__(self, bounds, dtype, n_pieces: int):
    self.bounds, self.left = bounds, n_pieces
    self.buf = blockops.aligned_empty([hi - lo for lo, hi in bounds], dtype)

  def view(self, piece) -> np.ndarray:
    return self.buf[tuple(slice(p0 - b0, p1 - b0) for (p0, p1), (b0, _) in zip(piece, self.bounds))]

  def piece_done(self) -> bool:
    """Counts one piece consumed (in job order, on the consuming thread); True for the last."""
    self.left -= 1
    return self.left == 0

  def take(self) -> np.ndarray:
    buf, self.buf = self.buf, None
    return buf


def _run(jobs, rc: ReadConfig, read, done) -> None:
  """`read(files, job)` on `rc.threads` threads (`pool.Workers`), `done(job, block)` in job order on
  this thread; blocks read but not yet handed to `done` never total more than `rc.read_budget_bytes`
  (or one block, when a single block is larger): `pool.READ` records the peak."""
  with ShardFiles() as files, Workers(rc.threads, rc.read_budget_bytes, pool.READ, "k2jax-read") as workers:
    for job in jobs:
      workers.submit(job[4], functools.partial(read, files, job), functools.partial(done, job))
    workers.drain()


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))


def _headers(path: str, wmap: dict[str, str]) -> dict[str, TensorInfo]:
  """The header entry of every tensor the index names, each read from the shard the index says."""
  by_shard = collections.defaultdict(list)
  for key, shard in wmap.items():
    by_shard[shard].append(key)
  tensors = {}
  for shard, keys in sorted(by_shard.items()):
    file = os.path.join(path, shard)
    header = read_header(file)
    for key in keys:
      if key not in header:
        raise CheckpointError(f"{file}: tensor {key!r} listed in {INDEX} is not in the shard")
      tensors[key] = header[key]
  return tensors


def _check_tensor(tensors: dict[str, TensorInfo], quant: Quant | None, key: str, want: tuple[int, ...]) -> bool:
  """Shape and dtype of `key` (and its scale when quantized); returns whether it is block-FP8."""
  t = tensors[key]
  if t.shape != want:
    raise CheckpointError(
      f"{t.file}: tensor {key!r} has shape {list(t.shape)}, expected {list(want)} for this config.json"
    )
  if quant is not None and quant.quantizes(key):
    if t.dtype != "F8_E4M3":
      raise CheckpointError(
        f"{t.file}: tensor {key!r} is {t.dtype}, but config.json's quantization_config makes it block-FP8 "
        "(F8_E4M3 + weight_scale_inv); a linear stored unquantized must be listed in modules_to_not_convert"
      )
    skey = key + fp8.SCALE_SUFFIX
    if skey not in tensors:
      raise CheckpointError(f"{t.file}: tensor {key!r} is F8_E4M3 but its scale {skey!r} is missing")
    s, grid = tensors[skey], fp8.scale_shape(t.shape, quant.block)
    if s.dtype != "F32" or s.shape != grid:
      raise CheckpointError(
        f"{s.file}: scale {skey!r} is {s.dtype} {list(s.shape)}, expected F32 {list(grid)} "
        f"(ceil of {list(t.shape)} / weight_block_size {list(quant.block)})"
      )
    return True
  if t.dtype not in _FLOAT:
    why = "config.json has no quantization_config" if quant is None else "the block-FP8 layout keeps it unquantized"
    raise CheckpointError(f"{t.file}: tensor {key!r} is {t.dtype}, but {why} (expected one of {list(_FLOAT)})")
  return False


def _check_int4(tensors: dict[str, TensorInfo], key: str, want: tuple[int, ...]) -> tuple[str, ...]:
  """The INT4 triplet standing for routed expert weight `key` (HF shape `want`): present, dtypes and shapes
  as the release stores them; returns its keys."""
  keys = int4.triplet(key)
  expected = [("I32", int4.packed_shape(want)), ("BF16", int4.scale_shape(want)), ("I32|I64", (2,))]
  for k, (dtype, shape) in zip(keys, expected):
    if k not in tensors:
      where = tensors[key].file if key in tensors else "the index"
      raise CheckpointError(
        f"{where}: tensor {k!r} is missing: config.json's quantization_config stores routed expert {key!r} "
        "as the INT4 triplet weight_packed / weight_scale / weight_shape"
      )
    t = tensors[k]
    if t.dtype not in dtype.split("|") or t.shape != shape:
      raise CheckpointError(
        f"{t.file}: tensor {k!r} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)} for a [out, in] = "
        f"{list(want)} weight (int4 in groups of {int4.GROUP}, {int4.PER_WORD} codes per int32)"
      )
  return keys
