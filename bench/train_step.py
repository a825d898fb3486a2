"""Train-step throughput, MFU and optimizer share of the tiny and small presets on this machine.

  python bench/train_step.py [--presets=tiny,small] [--reps=5] [--small_microbatches=1] [--profile=30]

Each preset runs the real jitted train step (MuonClip, QK-Clip, bias update, float32) on one device
with batches from the bundled corpus; `small` at 4096 tokens per optimizer step (16 x 256, split
into `--small_microbatches` if memory needs). Timed interleaved (bench/interleave.py): an n x n
float32 matmul (the machine's practical peak), the step, and the optimizer update alone (muonclip's
update + apply on step-shaped gradients), one of each per rep. Printed per preset, each the median
over reps with its min-max spread:
  <preset>_mfu              model FLOPs per step / step time / the same rep's matmul FLOP/s;
  <preset>_optimizer_share  optimizer update time / step time;
  and both again in process CPU seconds (`_mfu_cpu`, `_optimizer_share_cpu`), the figures to compare
  when other jobs load the machine (they move wall times far more than CPU times).
`--profile=N` then traces one step and prints its top N XLA ops by self time (bench/trace_ops.py).
FLOPs per token follow k2jax.train.counting (6 x activated matmul params + causal attention). On a
small-RAM CPU `small` runs `--small_layers` layers (default 2: one dense, one MoE layer of the
preset's exact width) and fewer still if the memory planner (x1.5 for XLA:CPU temporaries,
measured) says they would not fit a quarter of the free RAM; the layer count is printed.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# One device: fake CPU devices would split the cores (the figures are single-device ones).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from k2jax import host_malloc, memory  # noqa: E402
from k2jax.data import PretrainDataConfig, make_pretrain_iter  # noqa: E402
from k2jax.model import K2Model, presets  # noqa: E402
from k2jax.optim import QKClipSpec, muonclip  # noqa: E402
from k2jax.train.counting import count_params, flops_per_token  # noqa: E402
from k2jax.train.step import ModelDef, init_state, make_train_step  # noqa: E402

import interleave  # noqa: E402  bench/interleave.py
import trace_ops  # noqa: E402  bench/trace_ops.py

SHAPES = {"tiny": (16, 64), "small": (16, 256)}  # (rows, seq_len) per optimizer step on a CPU
PEAK_N = 2048  # the peak matmul: 17 GFLOP, long enough to time beside a step


def available_bytes() -> int:
  with open("/proc/meminfo") as f:
    info = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f}
  return info["MemAvailable"]


def fit_layers(cfg, tokens, seq_len):
  """Drop layers until 1.5 x the planned bytes fit a quarter of free RAM (shared machines)."""
  budget = 0.25 * available_bytes() / 1.5
  while True:
    p = memory.plan(cfg, {"fsdp": 1}, "fsdp", tokens, seq_len=seq_len, num_devices=1)
    if p["total_bytes_per_device"] < budget or cfg.num_hidden_layers <= cfg.first_k_dense_replace + 1:
      return cfg, p["total_bytes_per_device"]
    cfg = cfg.replace(num_hidden_layers=cfg.num_hidden_layers - 1)


def bench(name, reps, layers, microbatches, profile=0):
  rows, seq_len = SHAPES[name]
  cfg = presets.get(name, **({"num_hidden_layers": layers} if layers else {}))
  cfg, need = fit_layers(cfg, rows * seq_len // microbatches, seq_len)
  build = lambda: K2Model(cfg, rngs=nnx.Rngs(0))
  opt = muonclip(optax.constant_schedule(1e-3), qk_clip_spec=QKClipSpec.from_config(cfg))
  step = jax.jit(
    make_train_step(
      ModelDef.from_model(nnx.eval_shape(build)),
      opt,
      optax.constant_schedule(1e-3),
      num_microbatches=microbatches,
      bias_update_rate=1e-3,
      qk_clip_tau=100.0,
    ),
    donate_argnums=0,
  )
  holder = {"state": jax.jit(lambda: init_state(build(), opt))()}  # jit: distinct buffers, donatable
  it = make_pretrain_iter(PretrainDataConfig(seq_len=seq_len, batch_size=rows))
  batches = [{k: jnp.asarray(v) for k, v in next(it).items()} for _ in range(reps + 1)]
  t = time.perf_counter()
  holder["state"], m = step(holder["state"], batches[0])
  jax.block_until_ready(m["loss"])
  compile_s = time.perf_counter() - t

  def run_step():  # the timing may call it more than `reps` times: the batches go round
    i = len(holder.setdefault("done", []))
    holder["state"], holder["m"] = step(holder["state"], batches[1 + i % reps])
    holder["done"].append(jax.block_until_ready(holder["m"]["loss"]))

  # The optimizer alone: muonclip's update and its application, on gradients of the step's shapes.
  params = jax.tree.map(jnp.copy, holder["state"].params)  # the step donates the state's buffers
  grads = jax.tree.map(lambda p: 1e-3 * p, params)
  max_logits = jnp.ones((cfg.num_hidden_layers, cfg.num_attention_heads), jnp.float32)

  @jax.jit
  def opt_update(grads, opt_state, params):
    updates, opt_state = opt.update(grads, opt_state, params, max_logits=max_logits)
    return optax.apply_updates(params, updates), opt_state

  opt_state = jax.tree.map(jnp.copy, holder["state"].opt_state)
  jax.block_until_ready(opt_update(grads, opt_state, params))
  a = jnp.ones((PEAK_N, PEAK_N), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  jax.block_until_ready(matmul(a))
  cpu = {}
  times = interleave.time_interleaved(
    {
      "matmul": lambda: jax.block_until_ready(matmul(a)),
      "step": run_step,
      "optimizer": lambda: jax.block_until_ready(opt_update(grads, opt_state, params)),
    },
    reps,
    cpu,
  )
  flops_step = rows * seq_len * flops_per_token(cfg, seq_len)
  # mfu_i = (flops_step / step_i) / (2 n^3 / matmul_i)
  mfu = tuple(v * flops_step / (2.0 * PEAK_N**3) for v in interleave.ratio(times, "matmul", "step"))
  mfu_cpu = tuple(v * flops_step / (2.0 * PEAK_N**3) for v in interleave.ratio(cpu, "matmul", "step"))
  counts = count_params(cfg)
  print(
    f"{name}_layers={cfg.num_hidden_layers} {name}_params_total={counts.total} "
    f"{name}_params_activated={counts.activated} {name}_tokens_per_step={rows * seq_len} "
    f"{name}_microbatches={microbatches} {name}_planned_bytes={need}"
  )
  print(
    f"{name}_compile_s={compile_s:.1f} {name}_step_ms={interleave.median_ms(times['step'])} "
    f"{name}_optimizer_ms={interleave.median_ms(times['optimizer'])} "
    f"{name}_peak_matmul_ms={interleave.median_ms(times['matmul'])} {name}_loss={float(holder['m']['loss']):.4f}"
  )
  print(
    f"{name}_step_cpu_ms={interleave.median_ms(cpu['step'])} {name}_optimizer_cpu_ms="
    f"{interleave.median_ms(cpu['optimizer'])} {name}_peak_matmul_cpu_ms={interleave.median_ms(cpu['matmul'])} "
    f"{interleave.load_average()}"
  )
  print(interleave.fmt(f"{name}_mfu_cpu", mfu_cpu, reps))
  print(interleave.fmt(f"{name}_optimizer_share_cpu", interleave.ratio(cpu, "optimizer", "step"), reps))
  print(interleave.fmt(f"{name}_mfu", mfu, reps))
  print(interleave.fmt(f"{name}_optimizer_share", interleave.ratio(times, "optimizer", "step"), reps), flush=True)
  if profile:
    hlo = step.lower(holder["state"], batches[0]).compile().as_text()
    holder["done"] = []
    rows, wall_ms, kinds = trace_ops.top_ops(run_step, hlo, calls=1, n=profile)
    trace_ops.print_top(f"{name}_step", rows, wall_ms, kinds)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--presets", default="tiny,small")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--small_layers", type=int, default=2, help="0 = the preset's 12 layers")
  ap.add_argument("--small_microbatches", type=int, default=1)
  ap.add_argument("--profile", type=int, default=0, help="after timing, trace one step and print its top N ops")
  args = ap.parse_args()
  host_malloc.keep_freed_memory()  # as the launchers run (k2jax/host_malloc.py)
  print(f"device={jax.devices()[0].device_kind} devices={jax.device_count()}")
  for name in args.presets.split(","):
    small = name == "small"
    bench(name, args.reps, args.small_layers if small else 0, args.small_microbatches if small else 1, args.profile)


if __name__ == "__main__":
  main()
