"""Attention memory by XLA's own numbers: the einsum path vs the Pallas flash kernel, compiled for TPU.

  python bench/flash_attention.py [--topology=v5p:2x2x1] [--seq_lens=2048,4096,8192] [--heads=64]

Needs a TPU compiler, not a TPU: run it in the Python 3.12 + `jax[tpu]==0.12.0.1` environment (libtpu).
For each sequence length it compiles value_and_grad of one MLA attention (K2 head dims: Kn=128, Kr=64,
V=128, bfloat16, batch 1, all heads on one chip) for one chip of the topology, once with
`mla.einsum_attention` and once with `mla.flash_mla_attention`, and prints XLA's per-device temp and
argument bytes and FLOPs from cost analysis, then `temp_ratio_einsum_over_flash`. Nothing runs;
compile-time figures only (no timing: the TPU devices are compile-only).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from k2jax.model import mla  # noqa: E402

_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x1", "get_topology_desc name; one chip of it is used.")
_SEQ = flags.DEFINE_list("seq_lens", ["2048", "4096", "8192"], "Sequence lengths to compile.")
_HEADS = flags.DEFINE_integer("heads", 64, "Attention heads (K2: 64).")

KN, KR, V = 128, 64, 128


def _compile(fn, T, H, mesh):
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  dt = jnp.bfloat16
  shapes = [((1, T, H, KN), dt), ((1, T, H, KR), dt), ((1, T, H, KN), dt), ((1, T, KR), dt), ((1, T, H, V), dt)]
  args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes]
  args += [jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=sh), jax.ShapeDtypeStruct((1, T, H, V), dt, sharding=sh)]

  def loss(qn, qr, kn, kr, v, seg, w):
    out, max_logit = fn(qn, qr, kn, kr, v, seg, 0.1)
    return jnp.sum(out.astype(jnp.float32) * w), max_logit

  with jax.set_mesh(mesh):
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)).lower(*args).compile()


def main(_):
  from jax.experimental import topologies

  devices = topologies.get_topology_desc(platform="tpu", topology_name=_TOPOLOGY.value).devices
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
  print(f"device_kind={devices[0].device_kind} heads={_HEADS.value} Kn={KN} Kr={KR} V={V} dtype=bfloat16 batch=1")
  paths = {
    "einsum": mla.einsum_attention,
    "flash": lambda *a: mla.flash_mla_attention(*a, impl="pallas"),
  }
  for T in (int(t) for t in _SEQ.value):
    temp = {}
    for name, fn in paths.items():
      c = _compile(fn, T, _HEADS.value, mesh)
      mem, cost = c.memory_analysis(), c.cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      temp[name] = mem.temp_size_in_bytes
      print(
        f"seq_len={T} path={name} temp_gib={mem.temp_size_in_bytes / 2**30:.4f} "
        f"argument_gib={mem.argument_size_in_bytes / 2**30:.4f} flops={cost.get('flops', float('nan')):.4g}"
      )
    print(f"seq_len={T} temp_ratio_einsum_over_flash={temp['einsum'] / max(temp['flash'], 1):.2f}")


if __name__ == "__main__":
  app.run(main)
