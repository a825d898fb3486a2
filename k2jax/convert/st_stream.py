"""One safetensors file written tensor by tensor, in row blocks, while a writer thread does the I/O.

Used by `k2jax.convert.writer` (the one HF writer). A tensor arrives in the k2jax layout and leaves in
the HF layout: transposed, cast (float32 / bfloat16) or block-FP8-quantized (`blockops.quantize_fp8`, one
XLA:CPU call per few 128-row slabs, bitwise `fp8.quantize`, plus its float32 `weight_scale_inv` grid) on the way, with its CRC-32 computed
over the bytes written. The transposes, casts and quantization run on the writer's `pool.Workers`
(its `threads`); this thread consumes their blocks in order (CRC, hand-off), so the file is the same
bytes for any thread count, while the `Pipe` thread does the I/O. Tensors are queued back to back (no
wait between them). Host memory: the source tensors of the queued blocks (views of a CPU device's
shards), at most the workers' in-flight budget of prepared blocks (the writer sets it to one tensor's
bytes), each running thread's working copy of one block, and at most PIPE_BYTES (16 MiB, or one larger block)
handed to the pipe and not yet written.

Written here rather than with `safetensors.numpy.save_file`: that needs every tensor of a file in memory
at once, in its final dtype. The header is only known at the end (a caller may drop a tensor it finds
unchanged), so the space the header of all candidate tensors needs is reserved up front (a header of
fewer tensors at smaller offsets is never longer) and padded with spaces, as safetensors allows.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import itertools
import json
import math
import os
import struct
import threading
import zlib
from collections.abc import Callable

import ml_dtypes
import numpy as np

from k2jax.convert import blockops, fp8, int4
from k2jax.convert.errors import CheckpointError
from k2jax.convert.pool import Workers

ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32", "float8_e4m3fn": "F8_E4M3"}
OUT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "fp8": fp8.E4M3}
OUT_DTYPES["int4"] = int4.INT4  # routed experts as the release's INT4 triplet (`int4.py`), the rest bf16
FP8_BLOCK = (128, 128)  # the release's weight_block_size
BLOCK_BYTES = 256 << 10  # rows transposed and cast per worker job (~10x what a hand-off to a thread costs)
FP8_JOB_ELEMS = 1 << 20  # elements quantized per worker job (at least one 128-row slab)


@dataclasses.dataclass(frozen=True)
class Record:
  """One tensor of the file as stored: HF name, safetensors dtype, HF shape, bytes."""

  name: str
  dtype: str
  shape: tuple[int, ...]
  nbytes: int


def records(name: str, hf_shape: tuple[int, ...], out: np.dtype) -> list[Record]:
  """What writing one HF tensor in dtype `out` stores: the tensor, and its scale grid when FP8."""
  n = math.prod(hf_shape)
  if out == int4.INT4:
    packed, scale, shape = int4.triplet(name)
    pw, sg = int4.packed_shape(hf_shape), int4.scale_shape(hf_shape)
    return [Record(packed, "I32", pw, math.prod(pw) * 4), Record(scale, "BF16", sg, math.prod(sg) * 2)] + [
      Record(shape, "I32", (2,), 8)
    ]
  recs = [Record(name, ST_DTYPES[out.name], tuple(hf_shape), n * out.itemsize)]
  if out == fp8.E4M3:
    grid = fp8.scale_shape(hf_shape, FP8_BLOCK)
    recs.append(Record(name + fp8.SCALE_SUFFIX, "F32", grid, grid[0] * grid[1] * 4))
  return recs


class SafetensorsStream:
  """A safetensors file at `path` that will hold (a subset of) `candidates`, written in their order."""

  def __init__(self, path: str, candidates: list[Record], pipe: Pipe, workers: Workers, crc: bool = True):
    self._dtypes = {r.name: r.dtype for r in candidates}
    self._reserve = len(header([(r.name, r.dtype, r.shape, r.nbytes) for r in candidates]))
    self._reserve += -self._reserve % 8  # the data starts 8-byte aligned
    self._pipe, self._workers = pipe, workers
    self._crc = crc  # False: every CRC is 0 (an export needs no checksums)
    self._f = open(path, "wb", buffering=0)  # unbuffered: the data goes out by `write_all` on its fd
    self._f.seek(8 + self._reserve)
    self._flushed = 8 + self._reserve  # file offset up to which writeback has been started
    self._pos = 8 + self._reserve  # file offset the pipe's thread has written up to
    self._written: list[list[tuple[str, tuple[int, ...], int]]] = []  # per write: (name, HF shape, nbytes)
    self._end = 0  # data bytes written

  def write_async(self, name: str, a: np.ndarray, transpose: bool, out: np.dtype, then: Callable[[int], None]):
    """Appends `a` (k2jax layout; transposed to HF when `transpose`) as dtype `out`, without waiting: its
    blocks are queued on the workers behind the tensors before it (no drain between tensors, so the
    threads stay busy across them). `then(crc)`, the CRC-32 of the bytes stored (the weight and, for
    FP8, its scale grid), runs on the consuming thread once its last block has been handed to the
    pipe, before any later tensor's block is, so it may `drop_last`. `a` is kept alive until then;
    `Workers.drain` waits for every queued tensor."""
    hf_shape = a.shape[::-1] if transpose else a.shape
    shape2 = (hf_shape[0], int(np.prod(hf_shape[1:]))) if len(hf_shape) > 1 else (1, int(np.prod(hf_shape)))
    if out == fp8.E4M3:
      self._write_fp8(name, a, transpose, shape2, then)
    elif out == int4.INT4:
      self._write_int4(name, a, transpose, shape2, then)
    else:
      self._write_rows(name, a, transpose, shape2, out, [(name, hf_shape, a.size * out.itemsize)], then)

  def _write_rows(self, name: str, a: np.ndarray, transpose: bool, shape2, out: np.dtype, recs: list, then) -> None:
    """Row blocks of about BLOCK_BYTES, transposed and cast on the workers' threads (blocks that are
    views of `a`, no transpose and the same dtype, are passed through), CRC'd and written in order."""
    row_bytes = max(1, shape2[1] * out.itemsize)  # what a finished block holds until written
    step = max(1, min(BLOCK_BYTES, self._workers.budget_bytes) // row_bytes)  # a job fits the budget
    crc, starts = 0, range(0, shape2[0], step)

    def done(last: bool, block: np.ndarray) -> None:
      nonlocal crc
      crc = self._submit(block.reshape(-1).view(np.uint8), crc)
      if last:
        self._written.append(recs)
        then(crc)

    job_fn = _view_job if not transpose and a.dtype == out else _rows_job
    for i in starts:
      end = min(i + step, shape2[0])
      job = functools.partial(job_fn, name, self._f.name, a, transpose, i, end, out)
      self._workers.submit((end - i) * row_bytes, job, functools.partial(done, i == starts[-1]))

  def _write_fp8(self, name: str, a: np.ndarray, transpose: bool, shape2: tuple[int, int], then) -> None:
    """Block-FP8, a few slabs of FP8_BLOCK[0] HF rows per job (whole blocks: their scales and codes are
    those of the whole tensor; about FP8_JOB_ELEMS elements, so narrow tensors are not thousands of tiny
    jobs), transposed and quantized on the workers' threads, written in order; the scale grid follows."""
    grid = np.empty(fp8.scale_shape(shape2, FP8_BLOCK), np.float32)
    rows = FP8_BLOCK[0] * max(1, FP8_JOB_ELEMS // (FP8_BLOCK[0] * max(1, shape2[1])))
    crc, starts = 0, range(0, shape2[0], rows)
    recs = [(name, shape2, a.size), (name + fp8.SCALE_SUFFIX, grid.shape, grid.nbytes)]

    def done(i: int, qs: tuple[np.ndarray, np.ndarray]) -> None:
      nonlocal crc
      grid[i // FP8_BLOCK[0] : i // FP8_BLOCK[0] + len(qs[1])] = qs[1]
      crc = self._submit(qs[0].reshape(-1).view(np.uint8), crc)
      if i == starts[-1]:
        crc = self._submit(grid.reshape(-1).view(np.uint8), crc)
        self._written.append(recs)
        then(crc)

    # a finished job holds its codes (and scale rows) until written; the float32 working copy of a
    # running one is bounded by the thread count instead
    for i in starts:
      end = min(i + rows, shape2[0])
      job = functools.partial(_quantize_rows, name, self._f.name, a, transpose, i, end)
      self._workers.submit((end - i) * shape2[1], job, functools.partial(done, i))

  def _write_int4(self, name: str, a: np.ndarray, transpose: bool, shape2: tuple[int, int], then) -> None:
    """The INT4 triplet: row blocks (groups run along the columns, so any rows are whole groups) transposed,
    quantized and packed on the workers' threads, the packed words written in order; the bf16 scales and
    the int32 shape follow."""
    recs = [(r.name, r.shape, r.nbytes) for r in records(name, shape2, int4.INT4)]
    grid = np.empty(recs[1][1], int4.BF16)
    rows = max(1, FP8_JOB_ELEMS // max(1, shape2[1]))
    crc, starts = 0, range(0, shape2[0], rows)

    def done(i: int, ps: tuple[np.ndarray, np.ndarray]) -> None:
      nonlocal crc
      grid[i : i + len(ps[1])] = ps[1]
      crc = self._submit(ps[0].reshape(-1).view(np.uint8), crc)
      if i == starts[-1]:
        crc = self._submit(grid.reshape(-1).view(np.uint8), crc)
        crc = self._submit(np.asarray(shape2, np.int32).view(np.uint8), crc)
        self._written.append(recs)
        then(crc)

    for i in starts:
      end = min(i + rows, shape2[0])
      job = functools.partial(_int4_rows, name, self._f.name, a, transpose, i, end)
      self._workers.submit((end - i) * shape2[1], job, functools.partial(done, i))

  def _submit(self, block: np.ndarray, crc: int) -> int:
    self._pipe.submit(self._write, block, nbytes=block.nbytes, batch=self)
    self._end += block.nbytes
    return zlib.crc32(block, crc) if self._crc else 0

  def _write(self, *blocks: np.ndarray) -> None:
    """(On the pipe's thread.) Writes `blocks` (the pipe hands over every consecutive block of this file it
    holds) in one `writev`; every WRITEBACK_BYTES the disk starts on what came before, so the final fsync
    waits for the last stretch only instead of the whole file."""
    self._pos += write_all(self._f.fileno(), blocks)
    if self._pos - self._flushed >= WRITEBACK_BYTES:
      start_writeback(self._f.fileno(), self._flushed, self._pos - self._flushed)
      self._flushed = self._pos

  def drop_last(self) -> None:
    """Cuts the last tensor written (with its scale) out of the file again."""
    self._end -= sum(nbytes for _, _, nbytes in self._written.pop())
    self._pipe.submit(self._truncate, 8 + self._reserve + self._end)

  def close(self) -> None:
    """Writes the header (the file is removed when every tensor was dropped) and syncs the file."""
    head = None
    stored = [r for recs in self._written for r in recs]
    if stored:
      text = header([(n, self._dtypes[n], shape, nbytes) for n, shape, nbytes in stored])
      head = struct.pack("<Q", self._reserve) + text.ljust(self._reserve, b" ")
    self._pipe.submit(self._finish, head)

  def _truncate(self, size: int) -> None:
    self._f.seek(size)
    self._f.truncate()
    self._pos = size
    self._flushed = min(self._flushed, size)

  def _finish(self, head: bytes | None) -> None:
    if head is not None:
      self._f.seek(0)
      write_all(self._f.fileno(), [head])
      os.fsync(self._f.fileno())  # on disk before the barrier that lets process 0 index and swap it
    self._f.close()
    if head is None:
      os.remove(self._f.name)


WRITE_BUDGET_BYTES = 256 << 20  # most bytes of blocks prepared on the workers and not yet written


def _quantize_rows(
  name: str, file: str, a: np.ndarray, transpose: bool, i: int, end: int
) -> tuple[np.ndarray, np.ndarray]:
  """(codes, scale rows) of HF rows i..end of `a`, whole FP8 blocks but the tensor's last (on a worker thread)."""
  try:
    rows = hf_rows(a, transpose, i, end, a.dtype).reshape(end - i, -1)
    if rows.size < blockops.XLA_QUANT_MIN_ELEMS or blockops.cpu_device() is None:  # tiny models: no compiles
      return fp8.quantize(rows, FP8_BLOCK)
    codes, scale = blockops.quantize_fp8(rows, FP8_BLOCK)
    return codes.view(fp8.E4M3), scale
  except ValueError as e:  # NaN / inf: no FP8 code and no finite scale stands for them
    raise CheckpointError(
      f"tensor {name!r}: rows {i}..{end - 1} hold NaN or inf; block-FP8 cannot represent them ({e}); export refused"
    ) from e
  except Exception as e:
    raise RuntimeError(f"writing {name} to {file}: quantizing rows {i}..{end - 1}: {type(e).__name__}: {e}") from e


def _int4_rows(name: str, file: str, a: np.ndarray, transpose: bool, i: int, end: int) -> tuple[np.ndarray, np.ndarray]:
  """(packed words, bf16 scale rows) of HF rows i..end of `a` (on a worker thread)."""
  try:
    q, scale = int4.quantize(hf_rows(a, transpose, i, end, a.dtype).reshape(end - i, -1))
    return int4.pack(q), scale
  except ValueError as e:  # NaN / inf
    raise CheckpointError(f"tensor {name!r}: rows {i}..{end - 1}: {e}; export refused") from e
  except Exception as e:
    raise RuntimeError(f"writing {name} to {file}: quantizing rows {i}..{end - 1}: {type(e).__name__}: {e}") from e


def _view_job(name: str, file: str, a: np.ndarray, transpose: bool, i: int, end: int, out: np.dtype) -> np.ndarray:
  del name, file, transpose  # rows of `a` as they are: a view, nothing to prepare
  return hf_rows(a, False, i, end, out)


def _rows_job(name: str, file: str, a: np.ndarray, transpose: bool, i: int, end: int, out: np.dtype) -> np.ndarray:
  try:
    return hf_rows(a, transpose, i, end, out)
  except Exception as e:
    raise RuntimeError(f"writing {name} to {file}: rows {i}..{end - 1}: {type(e).__name__}: {e}") from e


def hf_rows(a: np.ndarray, transpose: bool, i: int, end: int, dtype) -> np.ndarray:
  """HF rows i..end of `a` (k2jax layout; `transpose`: the HF tensor is the matrix a.T) as a contiguous
  [end - i, cols] array in `dtype`; transposed tile by tile (`blockops.transpose_into`: a strided `.T`
  copy misses the cache on every element)."""
  if not transpose:
    rows = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(1, -1)
    return np.ascontiguousarray(rows[i:end], dtype=dtype)
  out = blockops.aligned_empty((end - i, a.shape[0]), dtype)  # aligned: XLA:CPU takes it without a copy
  blockops.transpose_into(out, a[:, i:end])
  return out


WRITEBACK_BYTES = 32 << 20  # bytes written to a file between two `start_writeback`s
PIPE_BYTES = 16 << 20  # bytes of blocks handed to the pipe and not yet written (one block at least)


def _libc_sync_file_range():
  try:
    fn = ctypes.CDLL(None, use_errno=True).sync_file_range
  except (OSError, AttributeError):  # not Linux
    return None
  fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint), ctypes.c_int
  return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
  """Asks the kernel to start writing `nbytes` at `offset` of `fd` to disk now, without waiting. Without
  it, a file's dirty pages wait in the page cache until the fsync at its end (on a 24 GiB host nothing
  pushes them out before 2.4 GiB are dirty), and that fsync is then a disk-bound wait that overlaps
  nothing (2.2 s of a 12 s FP8 export here). `os` has no sync_file_range, hence ctypes; elsewhere (or
  if the call fails) the final fsync does it all, as before. posix_fadvise(DONTNEED) would start the
  writeback too but then drop the pages, which an RL weight push's reader (SGLang) is about to read."""
  if _SYNC_FILE_RANGE is not None and nbytes > 0:
    _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # best effort: an error changes nothing


class Pipe:
  """Runs submitted calls in order on one thread. Submitted blocks wait for it up to `max_bytes` (one
  block at least) before `submit` blocks: the submitting thread hands a block over and goes back to
  consuming the workers' results instead of waiting for each write (1.5 s of a 12 s FP8 export blocked
  in a one-slot queue here; the I/O thread also needs the GIL back after each write). numpy copies,
  CRCs and file writes release the GIL, so preparing and writing overlap. The first failure is raised
  by the next `submit` or by `close`.

  Calls submitted with the same `batch` key (a file's block writes) that wait in the pipe back to back run
  as one call with all their arguments (at most WRITEV_BLOCKS, WRITEV_BYTES): one `writev` for a run of
  blocks. Written one block per call, the writer thread had to win the GIL back from the workers after
  every 256 KiB block: it spent 69% of a `small` FP8 export inside `write` and the consumer waited on
  the full pipe 72% of the time (py-spy, 4 threads)."""

  def __init__(self, max_bytes: int = PIPE_BYTES):
    self._max = max_bytes
    self._items: collections.deque = collections.deque()
    self._bytes = 0
    self._cv = threading.Condition()
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="k2jax-safetensors-writer", daemon=True)
    self._thread.start()

  def submit(self, fn, *args, nbytes: int = 0, batch=None) -> None:
    if self._error is not None:
      raise self._error
    self._put((fn, args, nbytes, batch))

  def _put(self, item) -> None:
    with self._cv:
      while self._items and self._bytes + item[2] > self._max:
        self._cv.wait()
      self._items.append(item)
      self._bytes += item[2]
      self._cv.notify_all()

  def close(self) -> None:
    """Waits for every submitted call; raises the first failure."""
    self._put((None, (), 0, None))
    self._thread.join()
    if self._error is not None:
      raise self._error

  def _run(self) -> None:
    while True:
      with self._cv:
        while not self._items:
          self._cv.wait()
        fn, args, nbytes, key = self._items[0]
        n = 1
        if key is not None:  # the same file's writes queued right behind: one call
          args = list(args)
          for _, more, b, k in itertools.islice(self._items, 1, WRITEV_BLOCKS):
            if k is not key or nbytes + b > WRITEV_BYTES:
              break
            args += more
            nbytes += b
            n += 1
      if fn is None:
        return
      if self._error is None:
        try:
          fn(*args)
        except BaseException as e:  # handed to the submitting thread
          self._error = e
      with self._cv:
        for _ in range(n):
          self._items.popleft()
        self._bytes -= nbytes
        self._cv.notify_all()


WRITEV_BLOCKS = 512  # blocks per `writev` (Linux takes up to IOV_MAX = 1024)
WRITEV_BYTES = 64 << 20  # bytes per `writev` (Linux writes at most ~2 GiB per call)


def write_all(fd: int, blocks) -> int:
  """Writes `blocks` (buffers) at `fd`'s offset with `os.writev`, resuming after a short write; returns
  the bytes written. `os.write` per block where there is no writev."""
  views = [memoryview(b).cast("B") for b in blocks]
  total, i = sum(v.nbytes for v in views), 0  # i: the first view not yet written whole
  while i < len(views):
    n = os.writev(fd, views[i:]) if hasattr(os, "writev") else os.write(fd, views[i])
    while i < len(views) and n >= views[i].nbytes:
      n -= views[i].nbytes
      i += 1
    if n:
      views[i] = views[i][n:]
  return total


def header(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
  """The safetensors JSON header of (name, dtype, shape, nbytes) stored back to back."""
  head, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, dtype, shape, nbytes in tensors:
    head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  return json.dumps(head, separators=(",", ":")).encode()
