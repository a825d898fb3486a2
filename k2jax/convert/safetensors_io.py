"""Byte-range reads of safetensors shards: the header parsed here, each tensor block read with `os.preadv`.

A safetensors file is `u64 header length | JSON header | data`; the header gives each tensor's dtype,
shape and `[begin, end)` offsets into the data, which is row-major. A block `[r0:r1, c0:c1]` of a 2-D
tensor is therefore one run when it spans whole rows and `r1 - r0` runs otherwise; only those bytes are
read, so a host's reads are the slices its devices hold (except that the runs of a block whose gaps
are at most COALESCE_WASTE of it are read as one span: one syscall instead of one per row).

Why not `safetensors.safe_open(...).get_slice`: it mmaps the file, so the bytes it touches are page
faults that neither it nor `/proc/self/io` (rchar) counts, and its numpy path does not know F8_E4M3.
Here every read goes through `read_into`, which adds to `STATS`; that counter is what tests and the
benchmark use for "bytes this process read" (requested bytes; the page cache may fetch whole pages).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import struct
import threading

import ml_dtypes
import numpy as np

from k2jax.convert.errors import CheckpointError

DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "I32": np.dtype(np.int32),  # the INT4 release's packed words and weight_shape (convert/int4.py)
  "I64": np.dtype(np.int64),  # weight_shape as compressed-tensors itself writes it
}
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header (MAX_HEADER_SIZE)
# Values are checked finite as they are read (`read_into`): a NaN or Inf weight would serve garbage (greedy
# decoding of NaN logits is all token 0) rather than fail. A float is NaN or Inf exactly when all its
# exponent bits are set (F8_E4M3, which has no Inf, when exponent and mantissa are: its only NaN), so the
# check is one AND and compare on the raw bits, in numpy's own integer loops (ml_dtypes' `np.isfinite` for
# bf16 and FP8 is several times slower, which matters at a terabyte of weights). Dtype -> (bits, mask).
NONFINITE_BITS = {
  "F64": (np.dtype(np.uint64), 0x7FF0_0000_0000_0000),
  "F32": (np.dtype(np.uint32), 0x7F80_0000),
  "F16": (np.dtype(np.uint16), 0x7C00),
  "BF16": (np.dtype(np.uint16), 0x7F80),
  "F8_E4M3": (np.dtype(np.uint8), 0x7F),
}
_FINITE_CHUNK = 1 << 20  # elements checked at a time (bounded temporaries)


@dataclasses.dataclass
class ReadStats:
  """Bytes this process read from shards (tensor data and headers), and the number of read calls."""

  data_bytes: int = 0
  header_bytes: int = 0
  calls: int = 0
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def add(self, n: int, header: bool = False) -> None:
    with self.lock:
      self.calls += 1
      if header:
        self.header_bytes += n
      else:
        self.data_bytes += n

  def reset(self) -> None:
    with self.lock:
      self.data_bytes = self.header_bytes = self.calls = 0


STATS = ReadStats()


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor of a shard: absolute byte offset of its first element in `file`."""

  file: str
  key: str
  dtype: str  # safetensors dtype string, e.g. 'BF16', 'F8_E4M3'
  shape: tuple[int, ...]
  offset: int

  @property
  def np_dtype(self) -> np.dtype:
    return DTYPES[self.dtype]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.np_dtype.itemsize


def read_header(file: str) -> dict[str, TensorInfo]:
  """Every tensor of a shard, the format's invariants checked before a data byte is read: an 8-byte
  little-endian header length that fits the file, a UTF-8 JSON object, `__metadata__` an object of
  strings, and per tensor a known dtype, a shape of non-negative ints and `[begin, end]` data offsets inside
  the data whose size is dtype x shape. The one validator of safetensors headers in k2jax (the reader's and
  the server's `/update_weights_from_disk`); a CheckpointError names the file and tensor."""
  try:
    with os.fdopen(open_regular(file), "rb") as f:
      size = os.fstat(f.fileno()).st_size
      head = f.read(8)
      if len(head) < 8:
        raise CheckpointError(f"{file}: {size} bytes, too short for a safetensors header length (truncated shard)")
      (n,) = struct.unpack("<Q", head)
      if n == 0 or n > _MAX_HEADER or 8 + n > size:
        raise CheckpointError(
          f"{file}: header length {n} does not fit the file ({size} bytes; at most 100 MB): truncated or corrupt shard"
        )
      raw = f.read(n)
  except OSError as e:
    raise CheckpointError(f"{file}: cannot read safetensors shard ({e})") from e
  STATS.add(8 + n, header=True)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise CheckpointError(f"{file}: corrupt safetensors header, not valid UTF-8 JSON ({str(e)[:120]})") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{file}: corrupt safetensors header, a JSON {type(header).__name__}, not an object")
  meta = header.pop("__metadata__", {})
  if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
    raise CheckpointError(f"{file}: corrupt safetensors header, __metadata__ must be an object of strings")
  base = 8 + n
  return {key: _tensor_info(file, key, info, base, size) for key, info in header.items()}


def open_regular(file: str) -> int:
  """A read-only fd of `file`, which must be a regular file: a FIFO would block its reader forever (and a
  device never ends), so the kind is checked before opening and again on the fd (it may be swapped in
  between), which is opened non-blocking so that even a FIFO put there returns at once."""
  try:
    kind = stat.S_IFMT(os.stat(file).st_mode)
    if kind == stat.S_IFREG:
      fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
      kind = stat.S_IFMT(os.fstat(fd).st_mode)
      if kind == stat.S_IFREG:
        return fd
      os.close(fd)
  except OSError as e:
    raise CheckpointError(f"{file}: cannot open safetensors shard ({e})") from e
  raise CheckpointError(f"{file}: not a regular file ({_KINDS.get(kind, 'special file')}); a shard must be a file")


_KINDS = {
  stat.S_IFIFO: "a FIFO",
  stat.S_IFCHR: "a character device",
  stat.S_IFBLK: "a block device",
  stat.S_IFSOCK: "a socket",
  stat.S_IFDIR: "a directory",
}


def _tensor_info(file: str, key: str, info, base: int, size: int) -> TensorInfo:
  where = f"{file}: tensor {key!r}"
  if not isinstance(info, dict):
    raise CheckpointError(f"{where}: corrupt header entry (not an object)")
  dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
  if dtype not in DTYPES:
    raise CheckpointError(f"{where}: unknown dtype {str(dtype)[:40]!r}; k2jax reads {sorted(DTYPES)}")
  if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
    raise CheckpointError(f"{where}: shape {str(shape)[:80]} is not a list of non-negative ints")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
    raise CheckpointError(f"{where}: data_offsets {str(offsets)[:80]} is not [begin, end]")
  begin, end = offsets
  if not 0 <= begin <= end or base + end > size:
    raise CheckpointError(
      f"{where}: data_offsets [{begin}, {end}] outside the file's {size - base} data bytes (truncated shard?)"
    )
  t = TensorInfo(file, key, dtype, tuple(shape), base + begin)
  if end - begin != t.nbytes:
    raise CheckpointError(f"{where}: {end - begin} bytes at data_offsets, but {dtype} {shape} needs {t.nbytes}")
  return t


class ShardFiles:
  """Open file descriptors of the shards, one per file, shared by the reader threads (pread is positionless)."""

  def __init__(self):
    self._fds: dict[str, int] = {}
    self._lock = threading.Lock()

  def fd(self, file: str) -> int:
    with self._lock:
      if file not in self._fds:
        self._fds[file] = open_regular(file)
      return self._fds[file]

  def close(self) -> None:
    with self._lock:
      for fd in self._fds.values():
        os.close(fd)
      self._fds.clear()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def read_block(
  files: ShardFiles, t: TensorInfo, bounds: tuple[tuple[int, int], ...], into: np.ndarray | None = None
) -> np.ndarray:
  """`t[lo0:hi0, lo1:hi1]` (or its 1-D form) in the file's dtype, reading only those bytes; into `into`
  (a C-contiguous array of the block's shape, any dtype of the same item size) when given."""
  if len(bounds) != len(t.shape) or len(bounds) not in (1, 2):
    raise ValueError(f"read_block: {t.key} has shape {list(t.shape)}, got bounds {bounds}")
  isz = t.np_dtype.itemsize
  fd = files.fd(t.file)
  shape = tuple(hi - lo for lo, hi in bounds)
  rows_u8 = (shape[0], (shape[1] if len(shape) == 2 else 1) * isz)
  if into is None:
    out_u8 = np.empty(rows_u8, np.uint8)
  else:
    if into.shape != shape or into.dtype.itemsize != isz or not into.flags.c_contiguous:
      raise ValueError(f"read_block: {t.key}: buffer {into.shape} {into.dtype} does not fit block {shape} {t.dtype}")
    out_u8 = into.view(np.uint8).reshape(rows_u8)
  if len(shape) == 1:
    read_into(fd, t, memoryview(out_u8.reshape(-1)), t.offset + bounds[0][0] * isz)
    return out_u8.reshape(-1).view(t.np_dtype)
  (r0, r1), (c0, c1) = bounds
  cols = t.shape[1]
  if c0 == 0 and c1 == cols:  # whole rows: one contiguous run
    read_into(fd, t, memoryview(out_u8.reshape(-1)), t.offset + r0 * cols * isz)
  elif _coalesce(r1 - r0, c1 - c0, cols, isz):  # one run over the rows' span, the small gaps dropped
    span = np.empty(((r1 - r0) * cols - (cols - (c1 - c0))) * isz, np.uint8)
    read_into(fd, t, memoryview(span), t.offset + (r0 * cols + c0) * isz)
    strided = np.lib.stride_tricks.as_strided(span, rows_u8, (cols * isz, 1))
    out_u8[...] = strided
  else:  # one run per row; the gaps between them belong to other hosts' slices
    for i, r in enumerate(range(r0, r1)):
      read_into(fd, t, memoryview(out_u8[i]), t.offset + (r * cols + c0) * isz)
  return out_u8.view(t.np_dtype).reshape(shape)


COALESCE_WASTE = 0.125  # read a column block's whole row span when its gaps are at most this fraction
COALESCE_MAX_BYTES = 64 << 20  # ... and the span fits this transient buffer


def _coalesce(rows: int, width: int, cols: int, isz: int) -> bool:
  """Whether `rows` runs of `width` of `cols`-wide rows are read as one span: a syscall per row costs more
  than the few gap bytes when the gaps are small (a slice that keeps most columns); never when the gaps
  are another host's half, so a host still reads only about its own bytes."""
  span = (rows * cols - (cols - width)) * isz
  return rows > 1 and span <= COALESCE_MAX_BYTES and span - rows * width * isz <= COALESCE_WASTE * rows * width * isz


def read_into(fd: int, t: TensorInfo, buf: memoryview, offset: int) -> None:
  """Fill `buf` from `offset` (looping over short reads) and check its values finite (floats: every byte
  of a tensor passes here once, so this is the one place that sees them all); a file that shrank since
  its header was read, or a NaN/Inf value, is a CheckpointError naming the tensor."""
  done = 0
  while done < len(buf):
    n = os.preadv(fd, [buf[done:]], offset + done)
    if n == 0:
      raise CheckpointError(f"{t.file}: tensor {t.key!r}: unexpected end of file at byte {offset + done} (truncated)")
    done += n
  STATS.add(done)
  if t.dtype in NONFINITE_BITS:
    check_finite(t, buf, (offset - t.offset) // t.np_dtype.itemsize)


def check_finite(t: TensorInfo, buf: memoryview, first: int = 0) -> None:
  """CheckpointError naming `t` and the flat index of the first NaN/Inf in `buf` (raw bytes of `t`'s
  dtype, starting at its element `first`)."""
  bits, mask = NONFINITE_BITS[t.dtype]
  u = np.frombuffer(buf, bits)
  scratch = np.empty(min(u.size, _FINITE_CHUNK), bits)
  for lo in range(0, u.size, _FINITE_CHUNK):
    part = u[lo : lo + _FINITE_CHUNK]
    masked = np.bitwise_and(part, mask, out=scratch[: part.size])
    hit = masked == mask
    if hit.any():
      at = lo + int(np.argmax(hit))
      bad = u[at : at + 1].view(t.np_dtype)[0].item()
      raise CheckpointError(f"{t.file}: tensor {t.key!r} holds a non-finite value ({bad}) at flat index {first + at}")
