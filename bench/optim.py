"""Optimizer update cost: muonclip vs optax.contrib.muon vs optax.adamw, and owner-sharded NS.

  python bench/optim.py [--preset=small] [--layers=2] [--iters=5]   # single-device ratios
  python bench/optim.py --sharded [--preset=tiny]                    # 8 fake CPU devices, FSDP

Single device: one jitted `update + apply_updates` per optimizer on the preset's param tree (random
params/grads of the real shapes; `--layers` overrides num_hidden_layers so `small` fits a CPU), timed
as the median of `--iters` calls. optax.contrib.muon is configured to do the same work (Moonshot
scale 0.2, decay 0.1 on both branches, layer/expert axes as batch axes). Prints
muonclip_over_optax_muon=<ratio> and muonclip_over_adamw=<ratio>.

--sharded: FSDP-sharded params on a (fsdp=8) mesh; compares per-device FLOPs (XLA cost analysis)
and update time with owner-distributed NS (`OwnerSharding`) vs leaving per-leaf NS to GSPMD (which
partitions each NS matmul over the sharded axis with collectives every iteration). Owner FLOPs
include the zero matrices that pad each same-shape group to a multiple of the device count.
Prints owner_over_gspmd_flops=<ratio> and owner_over_gspmd_time=<ratio>.
"""

import argparse
import os
import sys
import time

if "--sharded" in sys.argv:
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from k2jax.model import K2Model, presets  # noqa: E402
from k2jax.optim import OwnerSharding, QKClipSpec, label_params, muonclip  # noqa: E402


def param_tree(cfg, seed=0):
  """Random float32 params with the model's exact paths and shapes (no model init cost)."""
  shapes = jax.eval_shape(lambda: nnx.state(K2Model(cfg, rngs=nnx.Rngs(0)), nnx.Param))
  shapes = nnx.to_pure_dict(shapes)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(shapes))))
  return jax.tree.map(lambda s: 0.02 * jax.random.normal(next(keys), s.shape, jnp.float32), shapes)


def optax_muon(lr, params):
  dims = jax.tree.map(
    lambda lab: None if lab == "adamw" else optax.contrib.MuonDimensionNumbers(-2, -1), label_params(params)
  )
  return optax.contrib.muon(
    lr, consistent_rms=0.2, weight_decay=0.1, adam_weight_decay=0.1, adam_b2=0.95, muon_weight_dimension_numbers=dims
  )


def time_update(opt, params, grads, iters, **extra):
  state = opt.init(params)

  # grads and max logits are arguments, not closure constants (XLA would constant-fold them).
  @jax.jit
  def step(params, state, grads, extra):
    updates, state = opt.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  params, state = jax.block_until_ready(step(params, state, grads, extra))  # compile + warm up
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    params, state = jax.block_until_ready(step(params, state, grads, extra))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), step.lower(params, state, grads, extra)


def single_device(cfg, iters):
  params = param_tree(cfg)
  grads = param_tree(cfg, seed=1)
  spec = QKClipSpec.from_config(cfg)
  ml = jnp.linspace(50.0, 150.0, cfg.num_hidden_layers * cfg.num_attention_heads).reshape(
    cfg.num_hidden_layers, cfg.num_attention_heads
  )
  t_ours, _ = time_update(muonclip(2e-4, qk_clip_spec=spec), params, grads, iters, max_logits=ml)
  t_muon, _ = time_update(optax_muon(2e-4, params), params, grads, iters)
  t_adam, _ = time_update(optax.adamw(2e-4, b2=0.95, weight_decay=0.1), params, grads, iters)
  n = sum(x.size for x in jax.tree.leaves(params))
  print(f"params={n} layers={cfg.num_hidden_layers} iters={iters}")
  print(f"muonclip_s={t_ours:.4f} optax_muon_s={t_muon:.4f} adamw_s={t_adam:.4f}")
  print(f"muonclip_over_optax_muon={t_ours / t_muon:.3f}")
  print(f"muonclip_over_adamw={t_ours / t_adam:.3f}")


def sharded(cfg, iters):
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  host = param_tree(cfg)

  def spec(x):  # FSDP: shard the first axis divisible by 8 (leading stack axes excluded)
    for ax in range(max(x.ndim - 2, 0), x.ndim):
      if x.shape[ax] % 8 == 0:
        return P(*[("fsdp" if i == ax else None) for i in range(x.ndim)])
    return P()

  params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), host)
  grads = jax.tree.map(lambda x: x * 0.5, params)
  results = {}
  for name, owners in (("gspmd", None), ("owner", OwnerSharding(mesh, ("fsdp",)))):
    opt = muonclip(2e-4, qk_clip_tau=None, owners=owners)
    t, lowered = time_update(opt, params, grads, iters)
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    results[name] = (t, float(cost["flops"]))
    print(f"{name}_s={t:.4f} {name}_flops_per_device={cost['flops']:.3e}")
  print(f"owner_over_gspmd_flops={results['owner'][1] / results['gspmd'][1]:.3f}")
  print(f"owner_over_gspmd_time={results['owner'][0] / results['gspmd'][0]:.3f}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default=None)
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--sharded", action="store_true")
  args = ap.parse_args()
  preset = args.preset or ("tiny" if args.sharded else "small")
  overrides = {"num_hidden_layers": args.layers} if args.layers else {}
  cfg = presets.get(preset, **overrides)
  print(f"preset={preset} backend={jax.default_backend()} devices={jax.device_count()}")
  (sharded if args.sharded else single_device)(cfg, args.iters)


if __name__ == "__main__":
  main()
