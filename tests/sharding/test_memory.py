"""Memory planner: exact against real sharded arrays on 8 devices; 1t plans on the named topologies."""

import jax
import pytest
from flax import nnx
from sharding_helpers import split_params, tiny_model_state

from k2jax import memory, sharding
from k2jax.model import presets
from k2jax.optim import QKClipSpec, muonclip


def _device0_bytes(tree):
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)


@pytest.mark.parametrize(
  "preset,mesh_shape", [("fsdp_ep", {"fsdp": 2, "expert": 4}), ("fsdp_ep_tp", {"fsdp": 2, "expert": 2, "tensor": 2})]
)
def test_plan_matches_real_sharded_params_and_optimizer_state(preset, mesh_shape):
  cfg = presets.get("tiny")
  p = memory.plan(cfg, mesh_shape, preset, 128, seq_len=16, device_memory_bytes=2**30)
  graphdef, state = tiny_model_state(8)
  mesh = sharding.make_mesh(mesh_shape)
  state = jax.device_put(state, sharding.param_shardings(state, mesh, preset))
  assert p["params_bytes_per_device"] == _device0_bytes(state)
  _, params, _ = split_params(graphdef, state)
  assert p["grads_bytes_per_device"] == _device0_bytes(params)
  opt = muonclip(1e-3, qk_clip_spec=QKClipSpec.from_config(cfg))
  shardings = sharding.opt_state_shardings(jax.eval_shape(opt.init, params), params, mesh, preset)
  opt_state = jax.jit(opt.init, out_shardings=shardings)(params)
  assert p["opt_bytes_per_device"] == _device0_bytes(opt_state)
  terms = ("params", "grads", "grad_accum", "opt", "compute_copy", "gathered", "act")
  assert p["total_bytes_per_device"] == sum(p[f"{k}_bytes_per_device"] for k in terms)
  assert p["grad_accum_bytes_per_device"] == p["compute_copy_bytes_per_device"] == 0  # 1 microbatch, f32 compute
  assert p["fits"] is True
  lines = memory.format_plan(p).splitlines()
  assert lines[-1] == "fits=True" and f"opt_bytes_per_device={p['opt_bytes_per_device']}" in lines


@pytest.mark.parametrize("topo", sorted(memory.TOPOLOGIES))
def test_1t_plans_on_named_topologies(topo):
  t = memory.TOPOLOGIES[topo]
  cfg = presets.get("1t", compute_dtype="bfloat16", remat_policy="full")
  p = memory.plan(cfg, t.mesh, t.preset, 4096, seq_len=4096, topology=topo)
  # 1.03e12 float32 params: experts fully sharded over fsdp x expert, the rest over fsdp.
  assert 4.1e12 / t.num_devices <= p["params_bytes_per_device"] <= 1.1 * 4.1e12 / t.num_devices * 2
  # MuonClip: one momentum per Muon matrix (almost everything), two moments for embed/head/norms.
  assert 1.0 <= p["opt_bytes_per_device"] / p["params_bytes_per_device"] <= 1.1
  assert p["fits"] == (p["total_bytes_per_device"] <= t.device_memory_bytes)
  # Activations scale with the micro-batch: 8x tokens -> 8x bytes.
  p8 = memory.plan(cfg, t.mesh, t.preset, 8 * 4096, seq_len=4096, topology=topo)
  assert p8["act_bytes_per_device"] == pytest.approx(8 * p["act_bytes_per_device"], rel=1e-6)
  assert p8["fits"] is False


def test_plan_errors_name_the_problem():
  with pytest.raises(sharding.ShardingError, match="product 8 != 512"):
    memory.plan(presets.get("1t"), {"fsdp": 8}, "fsdp_ep", 4096, seq_len=4096, topology="v5p-1024")
  with pytest.raises(sharding.ShardingError, match="experts.w_\\w+: dim 1 .*size 384"):
    memory.plan(presets.get("1t"), {"fsdp": 2, "expert": 256}, "fsdp_ep", 4096, seq_len=4096, topology="v5p-1024")
  with pytest.raises(KeyError, match="unknown topology 'v4'"):
    memory.topology("v4")


def test_bf16_compute_copy_and_microbatch_gradient():
  """bf16 compute: the layer stack's w_* matrices are held once more in bf16 (the scan's copy), and with
  microbatches their bf16 gradient sits beside the float32 accumulator (the rest of it in float32)."""
  cfg = presets.get("tiny", compute_dtype="bfloat16")
  mesh = {"fsdp": 2, "expert": 4}
  p1 = memory.plan(cfg, mesh, "fsdp_ep", 128, seq_len=16, device_memory_bytes=2**30)
  p4 = memory.plan(cfg, mesh, "fsdp_ep", 128, seq_len=16, device_memory_bytes=2**30, num_microbatches=4)
  copy = p1["compute_copy_bytes_per_device"]
  assert 0 < copy < p1["params_bytes_per_device"] / 2  # half of the matrices' float32 bytes; norms, router, embed stay
  assert p1["grad_accum_bytes_per_device"] == 0
  assert p4["grad_accum_bytes_per_device"] == p4["grads_bytes_per_device"] - copy
  # The optimizer state offloaded to host memory leaves the device total (TPU/GPU plans only).
  pa = memory.plan(cfg, mesh, "fsdp_ep", 128, seq_len=16, device_memory_bytes=2**30, accelerator=True)
  po = memory.plan(
    cfg, mesh, "fsdp_ep", 128, seq_len=16, device_memory_bytes=2**30, accelerator=True, offload_opt_state=True
  )
  assert po["opt_bytes_per_device"] == 0 and po["host_opt_bytes_per_device"] == pa["opt_bytes_per_device"] > 0
  assert po["total_bytes_per_device"] == pa["total_bytes_per_device"] - pa["opt_bytes_per_device"]


def test_context_parallel_plan_counts_the_gathered_keys():
  """Under a `*_cp` preset each device's queries see the whole sequence: cp keys per local token, latent,
  up-projected keys and values and their gradients; the rest of a layer's activations is per local token."""
  cfg = presets.get("1t", compute_dtype="bfloat16", remat_policy="full", attention="flash")
  mesh = {"fsdp": 64, "expert": 8}
  base = memory.activation_bytes(cfg, mesh, "fsdp_ep", 4096, 32768, ragged=True, flash=True)
  cp = memory.activation_bytes(cfg, mesh, "fsdp_ep_cp", 4096, 32768, ragged=True, flash=True)
  per_token = 8 * 2 * ((512 + 64) + 2 * 64 * (128 + 64 + 128))  # cp * bf16 * (latent + 2 H (Kn + Kr + V))
  assert cp - base == pytest.approx(4096 * per_token, rel=1e-9)
