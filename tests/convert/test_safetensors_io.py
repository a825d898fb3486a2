"""Byte-range reads of a safetensors shard: column blocks, per-row runs or one coalesced span."""

import numpy as np
from safetensors.numpy import save_file

from k2jax.convert import safetensors_io as sio


def test_column_blocks_read_exactly_and_count_only_the_bytes_they_read(tmp_path):
  w = np.arange(40 * 100, dtype=np.float32).reshape(40, 100)
  path = str(tmp_path / "a.safetensors")
  save_file({"w": w}, path)
  t = sio.read_header(path)["w"]
  with sio.ShardFiles() as files:
    for (r0, r1), (c0, c1), span in (((3, 30), (0, 95), True), ((0, 40), (0, 50), False), ((5, 6), (7, 9), False)):
      assert sio._coalesce(r1 - r0, c1 - c0, 100, 4) == span
      sio.STATS.reset()
      got = sio.read_block(files, t, ((r0, r1), (c0, c1)))
      np.testing.assert_array_equal(got, w[r0:r1, c0:c1])
      gaps = (r1 - r0 - 1) * (100 - (c1 - c0)) * 4 if span else 0  # a coalesced span reads the gaps too
      assert sio.STATS.data_bytes == got.nbytes + gaps
