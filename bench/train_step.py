"""Train-step throughput and MFU of the tiny and small presets on this machine.

  python bench/train_step.py [--presets=tiny,small] [--steps=5]

Each preset runs the real jitted train step (MuonClip, QK-Clip, bias update, float32) on one device
with batches from the bundled corpus. MFU's peak is the float32 matmul rate of this device measured
in the same run (an n x n matmul: the machine's practical limit), so `<preset>_mfu` is a ratio against
a baseline measured here. FLOPs per token follow k2jax.train.counting (6 x activated matmul params +
causal attention). On a small-RAM CPU `small` runs `--small_layers` layers (default 2: one dense, one
MoE layer of the preset's exact width) and fewer still if the memory planner (x1.5 for XLA:CPU
temporaries, measured) says they would not fit a quarter of the free RAM; the layer count is printed,
so a comparison (e.g. with MaxText) uses the same shape.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from k2jax import memory  # noqa: E402
from k2jax.data import PretrainDataConfig, make_pretrain_iter  # noqa: E402
from k2jax.model import K2Model, presets  # noqa: E402
from k2jax.optim import QKClipSpec, muonclip  # noqa: E402
from k2jax.train.counting import count_params, flops_per_token  # noqa: E402
from k2jax.train.metrics import measure_peak_flops  # noqa: E402
from k2jax.train.step import ModelDef, init_state, make_train_step  # noqa: E402

SHAPES = {"tiny": (16, 64), "small": (2, 256)}  # (rows, seq_len) per step on a CPU


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


def bench(name, steps, peak, layers):
  rows, seq_len = SHAPES[name]
  cfg = presets.get(name, **({"num_hidden_layers": layers} if layers else {}))
  cfg, need = fit_layers(cfg, rows * seq_len, seq_len)
  build = lambda: K2Model(cfg, rngs=nnx.Rngs(0))
  opt = muonclip(optax.constant_schedule(1e-3), qk_clip_spec=QKClipSpec.from_config(cfg))
  step = jax.jit(
    make_train_step(
      ModelDef.from_model(nnx.eval_shape(build)),
      opt,
      optax.constant_schedule(1e-3),
      num_microbatches=1,
      bias_update_rate=1e-3,
      qk_clip_tau=100.0,
    ),
    donate_argnums=0,
  )
  state = jax.jit(lambda: init_state(build(), opt))()  # jit: distinct buffers, donatable
  it = make_pretrain_iter(PretrainDataConfig(seq_len=seq_len, batch_size=rows))
  batches = [{k: jnp.asarray(v) for k, v in next(it).items()} for _ in range(steps + 1)]
  t = time.perf_counter()
  state, m = step(state, batches[0])
  jax.block_until_ready(m["loss"])
  compile_s = time.perf_counter() - t
  times = []
  for b in batches[1:]:
    t = time.perf_counter()
    state, m = step(state, b)
    jax.block_until_ready(m["loss"])
    times.append(time.perf_counter() - t)
  sec = sorted(times)[len(times) // 2]
  tps = rows * seq_len / sec
  mfu = tps * flops_per_token(cfg, seq_len) / peak
  counts = count_params(cfg)
  print(
    f"{name}_layers={cfg.num_hidden_layers} {name}_params_total={counts.total} "
    f"{name}_params_activated={counts.activated} {name}_tokens_per_step={rows * seq_len} "
    f"{name}_planned_bytes={need}"
  )
  print(
    f"{name}_compile_s={compile_s:.1f} {name}_step_ms={1e3 * sec:.1f} "
    f"{name}_tokens_per_sec={tps:.1f} {name}_mfu={mfu:.4f} {name}_loss={float(m['loss']):.4f}"
  )


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--presets", default="tiny,small")
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--small_layers", type=int, default=2, help="0 = the preset's 12 layers")
  args = ap.parse_args()
  peak = measure_peak_flops("float32")
  print(f"device={jax.devices()[0].device_kind} peak_fp32_matmul_flops={peak:.4e}")
  for name in args.presets.split(","):
    bench(name, args.steps, peak, args.small_layers if name == "small" else 0)


if __name__ == "__main__":
  main()
