"""One MoE layer vs a dense SwiGLU of the same activated FLOPs: forward+backward time ratios.

  python bench/moe.py [--reps=5]

The dense baseline has width (num_experts_per_tok + n_shared_experts) * moe_intermediate_size, so
both sides do the same expert matmul FLOPs per token (the MoE also pays its router, D x E, and the
sort/dispatch). Every ratio is the median over `reps` interleaved repetitions (MoE, dense, MoE, ...)
with its min-max spread (bench/interleave.py). One-device figures come from a subprocess with one
CPU device (`--one_device`); the per-preset figures from this process's 8 fake CPU devices (the dense
layer sharded by the same preset). Also printed: the EP fixed-size all-to-all padding overhead (rows
sent / real token copies) and, on one device, `ragged_dot`'s cost relative to the grouped-matmul
kernel the CPU EP path uses. Last line: `moe_over_dense=<ratio>` for the small width on one device.

One-device lines also give the same ratio in process CPU seconds (`_cpu`: what to compare on a machine
shared with other jobs, whose load moves wall times far more) and for the layer with its router bias
balanced by `update_bias`'s rule (`_balanced_`: what training converges to; the random router alone
loads the busiest expert ~1.8x the mean, and a dropless MoE then does that much more work).
`--profile=N` prints the top N ops of each one-device fwd+bwd (bench/trace_ops.py).
"""

import os
import sys

ONE_DEVICE = "--one_device" in sys.argv
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={1 if ONE_DEVICE else 8}")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from k2jax import host_malloc, sharding  # noqa: E402
from k2jax.model import expert_parallel, grouped_matmul, presets  # noqa: E402
from k2jax.model.block import MoE  # noqa: E402
from k2jax.model.layers import SwiGLU  # noqa: E402

import interleave  # noqa: E402  bench/interleave.py
import trace_ops  # noqa: E402  bench/trace_ops.py

# (batch, length) per width: 2048 tokens -> 512 (tiny) / 256 (small) token copies per expert. Fewer
# rows per expert make the MoE weight-bandwidth bound (E x the dense layer's weights and weight grads).
SHAPES = {"tiny": (8, 256), "small": (8, 256)}
MESHES = {"fsdp": {"fsdp": 8}, "fsdp_ep": {"expert": 8}, "fsdp_ep_tp": {"expert": 4, "tensor": 2}}


def build(width: str):
  """(moe graphdef, state), (dense graphdef, state), x, cotangent; random values from numpy."""
  cfg = presets.get(width)
  dense_width = (cfg.num_experts_per_tok + cfg.n_shared_experts) * cfg.moe_intermediate_size
  moe = nnx.eval_shape(lambda: MoE(cfg, stack=None, rngs=nnx.Rngs(0)))
  dense = nnx.eval_shape(
    lambda: SwiGLU(cfg.hidden_size, dense_width, "mlp", stack=None, std=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0))
  )
  rng = np.random.default_rng(0)
  fill = lambda x: jnp.asarray(0.05 * rng.standard_normal(x.shape), x.dtype)  # noqa: E731
  B, T = SHAPES[width]
  x = jnp.asarray(rng.standard_normal((B, T, cfg.hidden_size)), jnp.float32)
  cot = jnp.asarray(rng.standard_normal((B, T, cfg.hidden_size)), jnp.float32)
  return [(g, jax.tree.map(fill, s)) for g, s in (nnx.split(moe), nnx.split(dense))], x, cot


def _loss(graphdef, state, x, cot, moe: bool):
  layer = nnx.merge(graphdef, state)
  out = layer(x, jnp.ones(x.shape[:2], bool))[0] if moe else layer(x)
  return jnp.sum(out * cot)


def fwd_bwd(graphdef, state, x, cot, moe: bool, profile: int = 0, label: str = "", states=()):
  """A blocking call of the compiled (and warmed-up) forward+backward; `profile` > 0 prints its top ops.
  With `states`, a list of such calls, one per state, sharing the compiled function."""
  fn = jax.jit(jax.grad(functools.partial(_loss, graphdef, moe=moe), argnums=(0, 1)))
  jax.block_until_ready(fn(state, x, cot))  # compile + warm-up
  call = lambda: jax.block_until_ready(fn(state, x, cot))  # noqa: E731
  if profile:
    rows, wall_ms, kinds = trace_ops.top_ops(call, fn.lower(state, x, cot).compile().as_text(), calls=2, n=profile)
    trace_ops.print_top(label, rows, wall_ms, kinds)
  return [lambda s=s: jax.block_until_ready(fn(s, x, cot)) for s in states] if states else call


def balanced_bias(graphdef, state, x, steps: int = 300):
  """The MoE state with the router bias a trained model converges to: `update_bias`'s rule
  (b += u * sign(mean load - load)) iterated on this input, u from 1e-2 down to 1e-4."""
  x_ND = x.reshape(-1, x.shape[-1])

  def with_bias(bias):
    pure = nnx.to_pure_dict(state)
    pure["router"]["bias"] = bias
    new = jax.tree.map(lambda a: a, state)
    nnx.replace_by_pure_dict(new, pure)
    return new

  @jax.jit
  def loads(bias):
    idx = nnx.merge(graphdef, with_bias(bias)).router(x_ND)[1]
    return jnp.zeros(bias.shape, jnp.float32).at[idx.reshape(-1)].add(1.0)

  bias = nnx.to_pure_dict(state)["router"]["bias"]
  for i in range(steps):
    load = loads(bias)
    bias = bias + 10 ** (-2 - 2 * i / steps) * jnp.sign(jnp.mean(load) - load)
  load = loads(bias)
  return with_bias(bias), float(jnp.max(load) / jnp.mean(load))


def one_device_width(width: str, reps: int, profile: int = 0) -> None:
  ((moe_g, moe_s), (dense_g, dense_s)), x, cot = build(width)
  balanced_s, max_load = balanced_bias(moe_g, moe_s, x)
  moe, moe_balanced = fwd_bwd(moe_g, moe_s, x, cot, True, profile, f"{width}_1dev_moe", states=(moe_s, balanced_s))
  fns = {
    "moe": moe,
    "dense": fwd_bwd(dense_g, dense_s, x, cot, False, profile, f"{width}_1dev_dense"),
    "moe_balanced": moe_balanced,
  }
  cpu = {}
  t = interleave.time_interleaved(fns, reps, cpu)
  print(
    f"{width}_1dev_moe_ms={interleave.median_ms(t['moe'])} {width}_1dev_dense_ms={interleave.median_ms(t['dense'])} "
    f"{width}_1dev_moe_cpu_ms={interleave.median_ms(cpu['moe'])} "
    f"{width}_1dev_dense_cpu_ms={interleave.median_ms(cpu['dense'])} {interleave.load_average()}"
  )
  print(interleave.fmt(f"{width}_1dev_moe_over_dense_cpu", interleave.ratio(cpu, "moe", "dense"), reps))
  print(f"{width}_1dev_balanced_max_load={max_load:.2f} (max / mean expert load after the bias update)")
  print(
    interleave.fmt(f"{width}_1dev_balanced_moe_over_dense_cpu", interleave.ratio(cpu, "moe_balanced", "dense"), reps)
  )
  print(interleave.fmt(f"{width}_1dev_balanced_moe_over_dense", interleave.ratio(t, "moe_balanced", "dense"), reps))
  print(interleave.fmt(f"{width}_1dev_moe_over_dense", interleave.ratio(t, "moe", "dense"), reps), flush=True)


def eight_device_width(width: str, reps: int) -> None:
  ((moe_g, moe_s), (dense_g, dense_s)), x, cot = build(width)
  cfg = presets.get(width)
  for preset, mesh_shape in MESHES.items():
    mesh = sharding.make_mesh(mesh_shape)
    place = lambda s: jax.device_put(s, sharding.param_shardings(s, mesh, preset))  # noqa: E731
    xs = jax.device_put((x, cot), NamedSharding(mesh, sharding.logical_to_spec(("act_batch", None, None), preset)))
    with sharding.use(mesh, preset):
      fns = {"moe": fwd_bwd(moe_g, place(moe_s), *xs, True), "dense": fwd_bwd(dense_g, place(dense_s), *xs, False)}
      t = interleave.time_interleaved(fns, reps)
      ctx = sharding.current()
    print(interleave.fmt(f"{width}_{preset}_8dev_moe_over_dense", interleave.ratio(t, "moe", "dense"), reps))
    if ctx.axis_size("experts") > 1:
      overhead = expert_parallel.expected_padding_overhead(cfg, ctx, x.shape[0] * x.shape[1])
      print(f"{width}_{preset}_8dev_a2a_padding_overhead={overhead:.2f}", flush=True)


def ragged_dot_over_kernel(reps: int) -> None:
  """fwd+bwd of one grouped matmul at the small width (1024 rows): ragged_dot over the kernel."""
  cfg = presets.get("small")
  E, D, F, M = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, 1024
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
  w = jnp.asarray(0.05 * rng.standard_normal((E, D, F)), jnp.float32)
  sizes = jnp.asarray(np.bincount(rng.integers(0, E, M), minlength=E), jnp.int32)
  tile = grouped_matmul.default_tile(M, E)
  fns = {}
  for name, mm in (
    ("ragged_dot", jax.lax.ragged_dot),
    ("kernel", lambda a, b, s: grouped_matmul.grouped_matmul(a, b, s, tile)),
  ):
    fn = jax.jit(jax.grad(lambda a, b, mm=mm: jnp.sum(mm(a, b, sizes) ** 2), argnums=(0, 1)))
    jax.block_until_ready(fn(x, w))
    fns[name] = lambda fn=fn: jax.block_until_ready(fn(x, w))
  t = interleave.time_interleaved(fns, reps)
  print(interleave.fmt("small_ragged_dot_over_cpu_kernel", interleave.ratio(t, "ragged_dot", "kernel"), reps))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--one_device", action="store_true", help="internal: the one-device half")
  parser.add_argument("--widths", default=",".join(SHAPES))
  parser.add_argument("--profile", type=int, default=0, help="one device: print the top N ops of each layer's fwd+bwd")
  args = parser.parse_args()
  host_malloc.keep_freed_memory()  # as the launchers run (k2jax/host_malloc.py)
  widths = args.widths.split(",")
  if args.one_device:
    print(f"backend={jax.default_backend()} devices={jax.device_count()}")
    if jax.default_backend() == "cpu":
      ragged_dot_over_kernel(args.reps)
    for width in widths:
      one_device_width(width, args.reps, args.profile)
    return
  lines = interleave.one_device_subprocess(
    __file__, "--one_device", f"--reps={args.reps}", f"--widths={args.widths}", f"--profile={args.profile}"
  )
  print(f"backend={jax.default_backend()} devices={jax.device_count()}")
  for width in widths:
    eight_device_width(width, args.reps)
  one = dict(kv.split("=", 1) for line in lines for kv in line.split() if "=" in kv)
  for width in widths:
    print(f"{width}_moe_over_dense={one[f'{width}_1dev_moe_over_dense']}")
  if "small" in widths:
    print(f"moe_over_dense={one['small_1dev_moe_over_dense']}")


if __name__ == "__main__":
  main()
