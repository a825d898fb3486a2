"""Compiling the real train step for TPU slices without TPUs (k2jax.train.aot, `launch/train.py --aot`).

These need libtpu (`pip install -e '.[tpu]'`: jax[tpu] 0.12 wheels, Python >= 3.12); where it does not
import (CI's Python 3.11 with jax 0.10) they skip, saying so. Each compiles a tiny step for XLA:TPU.
"""

import os
import subprocess
import sys

import pytest

from k2jax.train import aot

_WHY = aot.libtpu_available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny(**overrides):
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import k2  # noqa: PLC0415

  c = k2.get_config("tiny")
  with c.unlocked():
    for key, value in overrides.items():
      section, name = key.split(".")
      c[section][name] = value
  return c


def test_tiny_fsdp_ep_compiles_for_v5p8_with_ragged_all_to_all():
  r = aot.compile_step(_tiny(**{"mesh.rules": "fsdp_ep", "mesh.expert": 4}), "v5p-8", keep_hlo=True)
  assert r["platform"] == "tpu" and r["num_devices"] == 4 and r["fits"] is True
  hlo = r["hlo"]
  assert "ragged-all-to-all" in hlo and r["ragged-all-to-all_bytes_per_device"] > 0
  assert r["custom_call_flops_per_device"] > 0  # ragged_dot runs as a Mosaic kernel: its FLOPs are apart
  # No fixed-size expert buffer: the only all-to-all left is none at all, or the int32 counts.
  n, k, D = 16 * 64 // 4, 2, 64  # tokens per device, picks, hidden
  fixed_buffer = f"f32[4,{n * k},{D}]"
  assert fixed_buffer not in hlo
  assert r["all-to-all_bytes_per_device"] < n * k * D * 4
  # Exactly the routed rows travel: 2 MoE layers x 4 trips (there and back, forward and backward) of
  # n*k rows, each row padded by XLA:TPU from D=64 to 128 lanes of float32.
  assert r["ragged-all-to-all_bytes_per_device"] == 2 * 4 * n * k * 128 * 4
  # Donated state: the outputs alias the arguments. The peak (the buffer assignment's whole device
  # allocation) holds the arguments and is at least XLA's own `peak_memory_in_bytes`.
  assert r["alias_bytes_per_device"] >= r["state_bytes_per_device"] * 0.99
  assert r["argument_bytes_per_device"] < r["xla_peak_memory_bytes_per_device"] <= r["peak_bytes_per_device"]


def test_aot_launcher_prints_fits_false_and_exits_nonzero_when_it_does_not_fit():
  # 4M tokens of float32 logits over 4 v5e chips (15.75 GiB each): far past HBM.
  cmd = [
    sys.executable,
    os.path.join(ROOT, "launch", "train.py"),
    "--config=" + os.path.join(ROOT, "configs", "k2.py") + ":tiny",
    "--aot=v5e-4",
    "--config.data.seq_len=1024",
    "--config.data.global_batch_size=4096",
  ]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ, PYTHONPATH=ROOT))
  assert p.returncode == 1, p.stderr[-3000:]
  lines = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
  assert lines["fits"] == "false" and lines["slice"] == "v5e-4"
  assert float(lines["xla_available_gib_per_device"]) == 15.75
  assert float(lines["peak_gib_per_device"]) > 15.75
  with pytest.raises(ValueError, match="unknown TPU slice 'v5p-7'"):
    aot.tpu_slice("v5p-7")


def test_offloaded_optimizer_state_lives_in_host_memory_and_leaves_hbm():
  base = aot.compile_step(_tiny(**{"mesh.rules": "fsdp_ep", "mesh.expert": 4}), "v5p-8")
  off = aot.compile_step(_tiny(**{"mesh.rules": "fsdp_ep", "mesh.expert": 4, "optim.offload_state": True}), "v5p-8")
  assert base["host_state_bytes_per_device"] == 0 and base["fits"] and off["fits"]
  # Muon momentum + Adam moments: as many bytes as the params (float32), now in host memory.
  assert off["host_state_bytes_per_device"] > 0.9 * off["state_bytes_per_device"] / 2
  assert off["state_bytes_per_device"] + off["host_state_bytes_per_device"] == base["state_bytes_per_device"]
  assert off["host_argument_bytes_per_device"] >= off["host_state_bytes_per_device"]
  assert off["argument_bytes_per_device"] < base["argument_bytes_per_device"] - off["host_state_bytes_per_device"] / 2


def test_slice_devices_carry_the_wraparound_links():
  """v5p-128 is a 4x4x4 torus: its compile-only devices are the wrapped topology, not the open mesh."""
  from jax._src.lib import _jax
  from jax.experimental import topologies

  def serialized(wrap):
    desc = topologies.get_topology_desc(
      "v5:4x4x4", "tpu", chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=wrap
    )
    return _jax.get_topology_for_devices(desc.devices).serialize()

  ours = _jax.get_topology_for_devices(aot.slice_devices(aot.tpu_slice("v5p-128"))).serialize()
  assert ours == serialized((True, True, True)) != serialized((False, False, False))


def test_two_slices_put_only_the_gradient_reduction_on_dcn():
  """2 x v5p-8 with data over DCN: the cross-slice collectives are the gradient (and loss/statistics)
  all-reduces; no weight gather or expert all-to-all crosses slices. Refused when --aot and mesh.dcn_* disagree."""
  r = aot.compile_step(_tiny(**{"mesh.rules": "fsdp_ep", "mesh.expert": 2, "mesh.dcn_data": 2}), "2xv5p-8")
  assert r["slices"] == 2 and r["num_devices"] == 8 and r["mesh"] == "data=2,fsdp=2,expert=2,tensor=1"
  # XLA:TPU compiles one program per slice: what crosses is the megascale runtime's all-reduce, nothing else.
  assert r["dcn_bytes_per_device"] == r["dcn_megascale_all_reduce_bytes_per_device"] > 0
  assert not [k for k in r if k.startswith("dcn_megascale_") and "all_reduce" not in k]
  assert r["dcn_all-gather_bytes_per_device"] == r["dcn_ragged-all-to-all_bytes_per_device"] == 0
  with pytest.raises(ValueError, match=r"--aot=2xv5p-8: 2 slice\(s\), but the mesh's DCN level"):
    aot.compile_step(_tiny(), "2xv5p-8")


def test_a_32_way_axis_lays_out_on_the_v5p_1024_torus():
  """1t_128k's context degree (expert 32 x fsdp 16) splits a physical axis of the 8x8x8 torus, which
  jax.make_mesh refuses on v5p; k2jax.sharding.make_mesh lays it out through the topology-aware mapper."""
  from k2jax import sharding  # noqa: PLC0415

  devices = aot.slice_devices(aot.tpu_slice("v5p-1024"))
  mesh = sharding.make_mesh({"fsdp": 16, "expert": 32}, devices)
  assert dict(mesh.shape) == {"stage": 1, "data": 1, "fsdp": 16, "expert": 32, "tensor": 1}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


def test_pipelined_step_with_expert_parallelism_compiles_for_tpu():
  """2 stages x 2 repeats with EP 2 inside each stage: the stage vmap's batch dimension would reach
  ragged_dot, which XLA:TPU cannot compile (k2jax/model/moe_gemm.py runs it as a loop over the local stage)."""
  r = aot.compile_step(
    _tiny(
      **{
        "model.num_hidden_layers": 5,
        "mesh.stage": 2,
        "mesh.rules": "fsdp_ep",
        "mesh.expert": 2,
        "pipeline.repeats": 2,
        "pipeline.microbatches": 4,
      }
    ),
    "v5p-8",
    keep_hlo=True,
  )
  assert r["platform"] == "tpu" and r["fits"] is True and r["mesh"].startswith("stage=2,")
  assert r["ragged-all-to-all_bytes_per_device"] > 0 and r["collective-permute_bytes_per_device"] > 0
  assert "ragged-dot" in r["hlo"] or r["custom_call_flops_per_device"] > 0
