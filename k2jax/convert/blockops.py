"""Stored HF bytes to k2jax leaf values, block by block: the XLA conversion and the host-side helpers.

`convert` (jit) bitcasts stored bytes, dequantizes block-FP8, optionally transposes HF `[out, in]` to
k2jax `[in, out]` and casts to the leaf dtype; the reader runs it on accelerators for whole blocks, and
on CPU devices without the transpose for groups of FP8 tensors (one fused, vectorised loop measured
~5x numpy's table lookup + multiply + cast; XLA:CPU's 2-D transposes are slow on some shapes, e.g.
~50 Melem/s for [2816, 1024] -> [1024, 2816], so the host's tiled `transpose_into` does that part).

Host leaf buffers come from `aligned_empty`: `jax.device_put` onto a CPU device aliases a C-contiguous
numpy array aligned to 64 bytes instead of copying it (checked in tests/convert/test_blockops.py), so
a CPU import writes each leaf byte once.
"""

from __future__ import annotations

import functools
import math
import mmap

import jax
import jax.numpy as jnp
import numpy as np

from k2jax.convert.safetensors_io import DTYPES

ALIGN = 64  # bytes: the alignment at which XLA:CPU takes a host buffer without copying it
HUGE_BYTES = 8 << 20  # host buffers from this size get their own huge-page mapping (`aligned_empty`)
TILE = 256  # transpose tile (elements per side): 256x256 bf16 tiles measured fastest of 64..512 here


def aligned_empty(shape, dtype) -> np.ndarray:
  """An uninitialised C-contiguous array whose data starts on an ALIGN-byte boundary. From HUGE_BYTES up
  it is its own anonymous mapping with transparent huge pages requested (MADV_HUGEPAGE): a leaf's fresh
  pages are most of an import's CPU otherwise (the kernel's fault + zeroing per 4 KiB page; 1 GiB took
  1.4-8.8 s of system time in 4 KiB pages and 0.6-0.7 s in huge pages on this VM).
  The mapping is Python's default MAP_SHARED, i.e. shmem, which gets huge pages only where
  /sys/kernel/mm/transparent_hugepage/shmem_enabled allows (it is `never` on this VM: the advice is a no-op
  there, 0.44-0.54 s of system time per GiB). A MAP_PRIVATE mapping does get them here (0.11-0.14 s/GiB once
  warm) but their first touch in a process cost 1.2-2.3 s/GiB, and a first import got slower (2.1-3.8 s
  against 1.4-1.7 s for `small` bf16, bench/checkpoint_io.py), so the mapping stays shared."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  if nbytes >= HUGE_BYTES:
    m = mmap.mmap(-1, nbytes)  # page-aligned; unmapped when the last array viewing it is freed
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
      m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype).reshape(shape)
  buf = np.empty(nbytes + ALIGN, np.uint8)
  start = -buf.ctypes.data % ALIGN
  return buf[start : start + nbytes].view(dtype).reshape(shape)


def transpose_into(dst: np.ndarray, src: np.ndarray, tile: int = TILE) -> None:
  """dst[...] = src.T (casting to dst's dtype), tile by tile: a plain strided `.T` copy misses the cache
  on every element of one side (~12x slower measured); tiles keep both sides in cache. A row pitch of a
  multiple of 256 bytes (every power-of-two width: 1024-wide bf16 rows are 2 KiB) maps a tile column's
  rows to a few L1 sets, which thrash: such rows are first copied, TILE at a time, into a band whose
  pitch is an odd number of cache lines (the copy runs at memcpy speed; the transpose from it measured
  2-3x faster, here on [512, 1024] .. [2816, 1024] bf16). Each copy releases the GIL."""
  rows, cols = src.shape
  band = None
  if rows > 1 and src.strides[0] % 256 == 0:
    pitch = -(-cols * src.itemsize // 64) * 64
    pitch += 64 if pitch % 128 == 0 else 0
    band = aligned_empty((min(tile, rows), pitch // src.itemsize), src.dtype)[:, :cols]
  for r in range(0, rows, tile):
    part = src[r : r + tile]
    if band is not None:
      np.copyto(band[: len(part)], part)
      part = band[: len(part)]
    for c in range(0, cols, tile):
      dst[c : c + tile, r : r + tile] = part[:, c : c + tile].T


@functools.partial(jax.jit, static_argnames=("dtype", "block", "origin", "transpose", "out_dtype"))
def convert(raw, scale, *, dtype, block, origin, transpose, out_dtype):
  """On the device (XLA vectorises what numpy does element by element, and a TPU host's cores stay free):
  bitcast the stored bytes, dequantize (W = float32(W_fp8) * scale_inv[i // b0, j // b1], the same float32
  multiply as `fp8.dequantize`), transpose [out, in] -> [in, out] and cast to the leaf dtype."""
  w = jax.lax.bitcast_convert_type(raw, DTYPES[dtype])
  if scale is not None:
    rows, cols = raw.shape[-2:]
    full = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    full = full[..., origin[0] : origin[0] + rows, origin[1] : origin[1] + cols]
    w = w.astype(jnp.float32) * full
  if transpose:
    w = jnp.swapaxes(w, -1, -2)
  return w.astype(out_dtype)


def quantize_fp8(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
  """`fp8.quantize(w, block)` as one XLA:CPU call, bitwise the same (codes as uint8, float32 scale grid;
  ValueError on NaN / inf like it). The numpy quantizer is a dozen calls per group of block rows, each
  handing the GIL over and back: with the writer's threads sharing it an FP8 export kept ~2/3 of 2 cores
  busy. One XLA call fuses the passes (~3.4x numpy's rate on one [512, 1024] expert here, and XLA:CPU
  splits it over its own threads) and holds no GIL while it runs. The writer uses it for jobs of
  XLA_QUANT_MIN_ELEMS and more (a compile per job shape); the transpose stays on the host (`transpose_into`:
  XLA's in the same program cost ~25% more CPU per export here)."""
  with jax.default_device(cpu_device()):  # numpy in, the C++ dispatch path (no Python device_put)
    q, scale, finite = _quantize(w, block=block)
  if not bool(finite):
    raise ValueError("quantize: the weight has NaN or inf entries; FP8 cannot represent them")
  return np.asarray(q), np.asarray(scale)


XLA_QUANT_MIN_ELEMS = 1 << 16  # smaller jobs (tiny test models) keep the numpy quantizer: no compile per shape


@functools.cache
def cpu_device():
  """This process's first CPU device, or None when JAX runs without its CPU backend (`JAX_PLATFORMS=tpu`):
  the writer then quantizes with numpy."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:
    return None


@functools.partial(jax.jit, static_argnames=("block",))
def _quantize(w, *, block):
  """`fp8.quantize`'s arithmetic: per block `scale = amax / 448` (1.0 for an all-zero block), codes =
  e4m3(clip(x / scale, +-448)) by round-to-nearest-even (XLA:CPU's f32 -> f8e4m3fn convert equals
  ml_dtypes' on every midpoint, checked in tests/convert/test_fp8.py). XLA rewrites a division by a
  broadcast into a multiplication by its reciprocal, which differs in the last bit, so both divisors are
  materialised behind `optimization_barrier`: these are true float32 divisions, as numpy's."""
  x = w.astype(jnp.float32)
  n_r, n_c = x.shape
  g_r, g_c = -(-n_r // block[0]), -(-n_c // block[1])
  x = jnp.pad(x, ((0, g_r * block[0] - n_r), (0, g_c * block[1] - n_c)))  # zeros: the amax of a ragged block
  x = x.reshape(g_r, block[0], g_c, block[1])
  ax = jnp.abs(x)
  amax = jnp.max(jnp.where(jnp.isnan(ax), jnp.inf, ax), axis=(1, 3))  # XLA:CPU's max drops NaN: made inf
  e4m3_max = jax.lax.optimization_barrier(jnp.full(amax.shape, 448.0, jnp.float32))
  scale = jnp.where(amax > 0, amax / e4m3_max, jnp.float32(1.0))
  div = jax.lax.optimization_barrier(jnp.broadcast_to(scale[:, None, :, None], x.shape))
  q = jnp.clip(x / div, -448.0, 448.0).astype(jnp.float8_e4m3fn).reshape(g_r * block[0], g_c * block[1])
  return jax.lax.bitcast_convert_type(q[:n_r, :n_c], jnp.uint8), scale, jnp.all(jnp.isfinite(amax))
