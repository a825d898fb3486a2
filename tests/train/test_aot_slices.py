"""TPU slice names -> libtpu topology and wiring (`k2jax.train.aot.tpu_slice`); no libtpu needed."""

import pytest

from k2jax.train import aot


@pytest.mark.parametrize(
  "name, topology, devices, wrap, wiring",
  [
    ("v5p-8", "v5:2x2x1", 4, (False, False, False), "mesh"),
    ("v5p-64", "v5:2x4x4", 32, (False, False, False), "mesh"),
    ("v5p-128", "v5:4x4x4", 64, (True, True, True), "torus"),  # a full cube: the smallest 3D torus
    ("v5p-1024", "v5:8x8x8", 512, (True, True, True), "torus"),
    ("v4-256", "v4:4x4x8", 128, (True, True, True), "torus"),
    ("v6e-64", "v6e:8x8", 64, (False, False, False), "mesh"),
    ("v6e-128", "v6e:8x16", 128, (False, True, False), "wrap=y"),  # the 16-chip side of the pod wraps
    ("v5e-256", "v5e:16x16", 256, (True, True, False), "torus"),
  ],
)
def test_slices_are_wired_as_cloud_tpu_builds_them(name, topology, devices, wrap, wiring):
  s = aot.tpu_slice(name)
  assert (s.topology, s.num_devices, s.wrap, s.wiring) == (topology, devices, wrap, wiring)


def test_multislice_targets_name_the_slice_count():
  assert aot.parse_target("v5p-1024")[0] == 1
  n, s = aot.parse_target("4xv6e-256")
  assert n == 4 and (s.topology, s.num_devices) == ("v6e:16x16", 256)
  with pytest.raises(ValueError, match="unknown TPU slice 'v5p-7'"):
    aot.parse_target("2xv5p-7")
