"""Host-side block helpers of the reader: aligned buffers a CPU device aliases, the tiled transpose."""

import jax
import ml_dtypes
import numpy as np

from k2jax.convert import blockops


def test_aligned_buffer_is_aliased_by_a_cpu_device():
  for shape, dtype in (((3, 5, 7), ml_dtypes.bfloat16), ((1000,), np.uint8), ((64, 129), np.float32)):
    a = blockops.aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
    assert a.ctypes.data % blockops.ALIGN == 0
    a[...] = np.arange(a.size).reshape(shape).astype(dtype)
    x = jax.device_put(a, jax.devices("cpu")[0])
    assert x.unsafe_buffer_pointer() == a.ctypes.data  # no copy: the import writes each leaf byte once
    np.testing.assert_array_equal(np.asarray(x), a)


def test_tiled_transpose_with_ragged_tiles_and_cast():
  src = np.random.default_rng(0).standard_normal((300, 517)).astype(np.float32)
  dst = np.empty((517, 300), ml_dtypes.bfloat16)
  blockops.transpose_into(dst, src, tile=128)
  assert dst.tobytes() == src.T.astype(ml_dtypes.bfloat16).tobytes()
