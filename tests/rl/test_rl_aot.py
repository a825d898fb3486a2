"""Compiling a colocated RL iteration for a TPU slice without TPUs (k2jax.rl.aot, `launch/rl.py --aot`).

The compile tests need libtpu (`pip install -e '.[tpu]'`: jax[tpu] 0.12 wheels, Python >= 3.12); where it
does not import (CI's Python 3.11 with jax 0.10) they skip, saying so. The reshard arithmetic is checked
on the 8 fake CPU devices everywhere.
"""

import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from k2jax import sharding
from k2jax.model.config import ConfigError
from k2jax.rl import aot as rl_aot
from k2jax.train import aot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from configs import rl as rl_configs  # noqa: E402

_WHY = aot.libtpu_available()
needs_libtpu = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))
KEYS = (
  "generate_peak_gib_per_device",
  "generate_fits",
  "generate_headroom_gib_per_device",
  "update_peak_gib_per_device",
  "update_fits",
  "update_headroom_gib_per_device",
  "reshard_bytes_per_device",
  "offload_bytes_per_device",
  "fits",
)


def _tiny(**overrides):
  c = rl_configs.get_config("tiny")
  with c.unlocked():
    for key, value in overrides.items():
      section, name = key.split(".")
      c[section][name] = value
  return c


COLOCATED = {
  "mesh.rules": "fsdp_ep",
  "mesh.expert": 2,
  "engine.sharding": "tp_ep",
  "engine.mesh": "expert:2,tensor:2",
}


def _brute_receive(shape, src, dst) -> dict:
  """Elements of each device's dst shard missing from its src shard, by sets of flat indices."""
  flat = np.arange(int(np.prod(shape))).reshape(shape)
  have, want = src.devices_indices_map(shape), dst.devices_indices_map(shape)
  return {d: len(set(flat[want[d]].ravel()) - set(flat[have[d]].ravel())) for d in want}


def test_receive_bytes_match_a_set_count_on_fake_devices():
  devices = jax.devices()[:8]
  train = sharding.make_mesh({"fsdp": 4, "expert": 2}, devices=devices)
  serve = sharding.make_mesh({"expert": 2, "tensor": 4}, devices=devices[::-1])  # another device order
  shape = (4, 16, 24)
  for src_spec, dst_spec in (
    (P(None, "fsdp"), P(None, None, "tensor")),
    (P("expert", "fsdp"), P("expert", None, "tensor")),
    (P(None, "fsdp"), P()),  # replicated: everything but what the device holds
    (P(None, "fsdp"), P(None, "fsdp")),  # the same mesh axis over another device order
  ):
    src, dst = NamedSharding(train, src_spec), NamedSharding(serve, dst_spec)
    got = rl_aot.receive_bytes(shape, 2, src, dst)
    want = {d: 2 * n for d, n in _brute_receive(shape, src, dst).items()}
    assert got == want, (src_spec, dst_spec)


def test_aot_names_the_missing_serving_mesh():
  with pytest.raises(ConfigError, match="engine.sharding"):
    rl_aot.compile_rl(_tiny(), "v5p-8")  # no engine.sharding: nothing colocated to compile
  with pytest.raises(ConfigError, match=r"mesh.dcn_\*: .*one slice"):
    rl_aot.compile_rl(_tiny(**COLOCATED, **{"mesh.dcn_data": 2}), "v5p-8")  # multislice: launch/train.py's --aot


@pytest.fixture(scope="module")
def tiny_report():
  return rl_aot.compile_rl(_tiny(**COLOCATED), "v5p-8")


@pytest.mark.slow
@needs_libtpu
def test_tiny_colocated_iteration_compiles_for_v5p8(tiny_report):
  r = tiny_report
  assert all(k in r for k in KEYS), [k for k in KEYS if k not in r]
  assert r["platform"] == "tpu" and r["num_devices"] == 4 and r["fits"] is True
  assert r["generate_fits"] is True and r["update_fits"] is True
  assert (
    r["engine_mesh"] == "data=1,fsdp=1,expert=2,tensor=2" and r["trainer_mesh"] == "data=1,fsdp=2,expert=2,tensor=1"
  )
  # The generation peak holds the larger engine program plus what stays resident beside it.
  assert r["generate_peak_bytes_per_device"] >= r["trainer_resident_gib_per_device"] * aot.GIB
  assert r["generate_peak_bytes_per_device"] > 0 and r["update_peak_bytes_per_device"] > 0
  # The optimizer state goes to host and back: Muon momentum + Adam moments, at least the f32 params' bytes.
  assert r["offload_round_trip_bytes_per_device"] == 2 * r["offload_bytes_per_device"] > 0
  # Every reshard collective moves at least the bytes a device lacks (gathers count whole results).
  assert 0 < r["reshard_bytes_per_device"] <= r["reshard_program_collective_bytes_per_device"]
  print(aot.format_report(r))


@pytest.mark.slow
@needs_libtpu
def test_reshard_bytes_of_the_embedding_by_hand(tiny_report):
  """The embedding [V, D]: training fsdp_ep shards D over fsdp=2, serving tp_ep shards V over tensor=2,
  so each device holds a [V, D/2] block and needs [V/2, D]: it lacks V/2 x D/2 values of the served dtype
  (the compute dtype: float32 in the tiny RL config, 4 bytes)."""
  from k2jax.model import presets

  cfg = presets.get("tiny")
  V, D, itemsize = cfg.vocab_size, cfg.hidden_size, np.dtype(_tiny().model.compute_dtype).itemsize
  assert itemsize == 4
  s = aot.tpu_slice("v5p-8")
  devices = aot.slice_devices(s)
  train = sharding.make_mesh({"fsdp": 2, "expert": 2}, devices=devices)
  serve = sharding.make_mesh({"expert": 2, "tensor": 2}, devices=devices)
  src = NamedSharding(train, sharding.logical_to_spec(("vocab", "embed"), "fsdp_ep"))
  dst = NamedSharding(serve, sharding.logical_to_spec(("vocab", "embed"), "tp_ep"))
  assert src.spec == P(None, "fsdp") and dst.spec == P("tensor", None)
  want = (V // 2) * (D // 2) * itemsize
  assert set(rl_aot.receive_bytes((V, D), itemsize, src, dst).values()) == {want}
  assert tiny_report["reshard_leaf_bytes"]["['embed']['embedding']"] == want
  assert tiny_report["reshard_bytes_per_device"] >= want
  assert tiny_report["reshard_mean_bytes_per_device"] <= tiny_report["reshard_bytes_per_device"]
