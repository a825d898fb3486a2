"""Host-side block helpers of the reader: aligned buffers a CPU device aliases, the tiled transpose."""

import jax
import ml_dtypes
import numpy as np

from k2jax.convert import blockops


def test_aligned_buffer_is_aliased_by_a_cpu_device():
  big = (blockops.HUGE_BYTES // 4 + 16,)  # its own huge-page mapping
  for shape, dtype in (
    ((3, 5, 7), ml_dtypes.bfloat16),
    ((1000,), np.uint8),
    ((64, 129), np.float32),
    (big, np.float32),
  ):
    a = blockops.aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
    assert a.ctypes.data % blockops.ALIGN == 0
    a[...] = np.arange(a.size).reshape(shape).astype(dtype)
    x = jax.device_put(a, jax.devices("cpu")[0])
    assert x.unsafe_buffer_pointer() == a.ctypes.data  # no copy: the import writes each leaf byte once
    np.testing.assert_array_equal(np.asarray(x), a)


def test_tiled_transpose_with_ragged_tiles_cast_and_banded_pitch():
  rng = np.random.default_rng(0)
  for shape, src_dtype, dst_dtype in (
    ((300, 517), np.float32, ml_dtypes.bfloat16),  # ragged tiles, cast on the way
    ((300, 512), ml_dtypes.bfloat16, ml_dtypes.bfloat16),  # a 1 KiB row pitch: copied through the band
    ((1, 1024), ml_dtypes.bfloat16, ml_dtypes.bfloat16),
  ):
    src = rng.standard_normal(shape).astype(src_dtype)
    dst = np.empty(shape[::-1], dst_dtype)
    blockops.transpose_into(dst, src, tile=128)
    assert dst.tobytes() == src.T.astype(dst_dtype).tobytes(), shape
