"""`sharding.platform`: kernels follow the compile target's devices, not the host's default backend."""

import types

import jax
import pytest

from k2jax import sharding


def test_platform_follows_devices_then_active_mesh_then_default_backend():
  assert sharding.platform() == jax.default_backend() == "cpu"
  fake_tpus = [types.SimpleNamespace(platform="tpu") for _ in range(4)]
  assert sharding.platform(fake_tpus) == "tpu"
  mesh = sharding.make_mesh({"expert": 2}, devices=jax.devices()[:2])
  assert sharding.platform(mesh) == "cpu"
  one = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
  with sharding.use(one, "fsdp"):  # a one-device mesh still names the target platform
    assert sharding.platform() == "cpu"
  with pytest.raises(sharding.ShardingError, match=r"span platforms \['cpu', 'tpu'\]"):
    sharding.platform([jax.devices()[0], fake_tpus[0]])
