"""The multi-process offload path (per-shard copies in one batch, global arrays reassembled) is bitwise
too; run here in one process, where every shard is addressable, on 8 fake CPU devices."""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k2jax import sharding
from k2jax.rl import phases


def test_per_shard_copies_round_trip_bitwise_with_the_same_shardings():
  mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
  rng = np.random.default_rng(0)
  host = {
    "w": rng.standard_normal((8, 8), np.float32),
    "e": rng.standard_normal((4, 3, 2), np.float32).astype(jax.numpy.bfloat16),
    "n": np.arange(5, dtype=np.int32),
  }
  specs = {"w": P("fsdp", "expert"), "e": P("expert"), "n": P()}
  tree = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
  up = phases._copy_shards(jax.tree.leaves(tree), phases.HOST)
  assert {x.sharding.memory_kind for x in up} == {phases.HOST}
  back = phases._copy_shards(up, "device")
  for got, src, (k, ref) in zip(back, jax.tree.leaves(tree), sorted(host.items())):
    assert got.sharding.spec == src.sharding.spec and got.dtype == ref.dtype, k
    assert got.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(got), ref)  # bitwise
