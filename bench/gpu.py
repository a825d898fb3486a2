"""The K2 training step on one GPU against its physical limits and against transformers, in one command.

  python bench/gpu.py [--reps=5] [--warmup=3] [--presets=small,large] [--remat=none] [--no_hf_compile]
  python bench/gpu.py --smoke      # the same code on CPU, tiny shapes, seconds (tests/bench calls it)

Printed, one `key=value` group a line (times: median[min,max] over `--reps` interleaved reps):
  matmul_peak_tflops=        bf16 n^3 matmul in jax (n=8192; smoke 256): the measured ceiling
  <p>_step_ms= <p>_tokens_per_s= <p>_mfu= <p>_mfu_vs_matmul= <p>_peak_gb= <p>_compile_s=
                             k2jax's real train step (MuonClip, QK-Clip, bias update; float32 master
                             weights, bf16 compute, attention and moe_gemm `auto`), preset p in `small`
                             and `large` (hidden 2048, K2's head dims 128+64/128, 64 experts top-8, 4.8B
                             params: its GEMMs fill a Hopper GPU; fits 141 GB with MuonClip state)
  hf_<p>_step_ms= hf_<p>_peak_gb= [hf_compile_<p>_step_ms=]
                             transformers' DeepseekV3 on the same config (`to_hf_dict`) and random tokens:
                             eager sdpa, bf16 autocast, fused AdamW; and under `torch.compile` when it works
  moe_layer_<impl>_ms=       the routed-expert SwiGLU alone, forward + backward, per grouped GEMM
                             (k2jax/model/moe_gemm.py) with its max |diff| against `ragged_dot`, and
  moe_dense_active_ms=       a dense matmul chain of the same activated FLOPs (rows = tokens x k)
  xla_flags_speedup=         the small step without k2jax/accel.py's XLA flags over with them
and the summary keys, each alone on a line: small_hf_over_k2= small_mfu= large_mfu= small_peak_gb=
hf_small_peak_gb= moe_kernel_over_dense_active=  (targets on an H200: >= 3.0, >= 0.25, >= 0.40,
<= hf_small_peak_gb, <= 1.3).

Every row runs in its own child process (`--child=...`): peak memory then belongs to that row alone
(neither jax's nor torch's allocator returns memory to the other), and XLA_FLAGS can differ per row.
MFU = model FLOPs (k2jax.train.counting: 6 x activated matmul params + causal attention) per second
over the datasheet's 989 TFLOP/s dense bf16 (H100/H200 SXM), and over the measured matmul peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

DATASHEET_FLOPS = 989e12  # H100/H200 SXM dense bf16
LARGE = dict(
  hidden_size=2048,
  intermediate_size=5632,
  moe_intermediate_size=1024,
  num_hidden_layers=12,
  num_attention_heads=16,
  num_key_value_heads=16,
  q_lora_rank=768,
  kv_lora_rank=512,
  qk_nope_head_dim=128,
  qk_rope_head_dim=64,
  v_head_dim=128,
)
GEMMS = ("ragged_dot", "tiled", "tokamax", "tokamax_triton", "jax_triton")


def shapes(smoke: bool) -> dict:
  """Per-run sizes: batch rows x seq_len tokens a step, the peak matmul's n, the presets."""
  if smoke:
    return {"rows": 2, "seq": 32, "n": 256, "presets": {"small": ("tiny", {}), "large": ("tiny", {"hidden_size": 96})}}
  return {"rows": 8, "seq": 2048, "n": 8192, "presets": {"small": ("small", {}), "large": ("small", LARGE)}}


def model_config(preset: str, smoke: bool, **extra):
  import dataclasses

  from k2jax.model import presets

  base, over = shapes(smoke)["presets"][preset]
  return dataclasses.replace(presets.get(base, **over), param_dtype="float32", compute_dtype="bfloat16", **extra)


# ---------------------------------------------------------------------------------------- children
def child_k2(preset: str, args) -> dict:
  """k2jax's train step interleaved with the peak matmul."""
  from k2jax import accel

  accel.configure(gpu=not args.smoke)
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import interleave
  from k2jax.model import K2Model
  from k2jax.optim import QKClipSpec, muonclip
  from k2jax.train.counting import flops_per_token
  from k2jax.train.step import ModelDef, init_state, make_train_step

  sz = shapes(args.smoke)
  cfg = model_config(preset, args.smoke, remat_policy=args.remat)
  build = lambda: K2Model(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  sched = optax.constant_schedule(1e-4)
  opt = muonclip(sched, qk_clip_spec=QKClipSpec.from_config(cfg))
  mdef = ModelDef.from_model(nnx.eval_shape(build))
  step = jax.jit(
    make_train_step(mdef, opt, sched, num_microbatches=1, bias_update_rate=1e-3, qk_clip_tau=100.0), donate_argnums=0
  )
  holder = {"state": jax.jit(lambda: init_state(build(), opt))()}
  tokens = jax.random.randint(jax.random.key(0), (sz["rows"], sz["seq"]), 0, cfg.vocab_size, jnp.int32)
  batch = {  # step.BATCH_KEYS: one packed document per row
    "input_ids": tokens,
    "targets": jnp.roll(tokens, -1, axis=1),
    "segment_ids": jnp.ones_like(tokens),
    "positions": jnp.broadcast_to(jnp.arange(sz["seq"], dtype=jnp.int32), tokens.shape),
    "loss_mask": jnp.ones_like(tokens),
  }

  def run_step():
    holder["state"], holder["m"] = step(holder["state"], batch)
    jax.block_until_ready(holder["m"]["loss"])

  t = time.perf_counter()
  run_step()
  compile_s = time.perf_counter() - t
  for _ in range(args.warmup):
    run_step()
  a = jnp.ones((sz["n"], sz["n"]), jnp.bfloat16)
  mm = jax.jit(lambda x: x @ x)
  jax.block_until_ready(mm(a))
  times = interleave.time_interleaved(
    {"matmul": lambda: jax.block_until_ready(mm(a)), "step": run_step}, args.reps, min_rep_s=0.0
  )
  flops = sz["rows"] * sz["seq"] * flops_per_token(cfg, sz["seq"])
  step_s = statistics.median(times["step"])
  peak_flops = 2.0 * sz["n"] ** 3 / statistics.median(times["matmul"])
  return {
    "matmul_peak_tflops": round(peak_flops / 1e12, 3),
    "device": jax.devices()[0].device_kind.replace(" ", "_"),
    f"{preset}_step_ms": interleave.median_ms(times["step"]),
    f"{preset}_step_s": step_s,
    f"{preset}_tokens_per_s": round(sz["rows"] * sz["seq"] / step_s),
    f"{preset}_mfu": round(flops / step_s / DATASHEET_FLOPS, 4),
    f"{preset}_mfu_vs_matmul": round(flops / step_s / peak_flops, 4),
    f"{preset}_peak_gb": _jax_peak_gb(jax),
    f"{preset}_compile_s": round(compile_s, 1),
    f"{preset}_remat": args.remat,
    f"{preset}_loss": round(float(holder["m"]["loss"]), 4),
  }


def _jax_peak_gb(jax) -> float:
  stats = jax.devices()[0].memory_stats() or {}
  return round(stats["peak_bytes_in_use"] / 1e9, 2) if "peak_bytes_in_use" in stats else float("nan")


def child_hf(preset: str, args) -> dict:
  """transformers' DeepseekV3 train step on the same config: eager, then `torch.compile` if it works."""
  import torch
  import transformers

  import interleave

  sz = shapes(args.smoke)
  cfg = model_config(preset, args.smoke)
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  hf_cfg = transformers.DeepseekV3Config(**cfg.to_hf_dict(), attn_implementation="sdpa")
  torch.manual_seed(0)
  model = transformers.DeepseekV3ForCausalLM(hf_cfg).to(dev)
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
  ids = torch.randint(0, cfg.vocab_size, (sz["rows"], sz["seq"]), device=dev)
  a = torch.ones((sz["n"], sz["n"]), device=dev, dtype=torch.bfloat16)
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

  def make_step(m):
    def step():
      with torch.autocast(dev, dtype=torch.bfloat16):
        loss = m(input_ids=ids, labels=ids).loss
      loss.backward()
      opt.step()
      opt.zero_grad(set_to_none=True)
      sync()

    return step

  def matmul():
    _ = a @ a
    sync()

  out = {}
  rows = {"eager": make_step(model)}
  if not args.no_hf_compile and not args.smoke and preset == "small":
    rows["compile"] = make_step(torch.compile(model))
  for name, fn in list(rows.items()):
    try:
      for _ in range(1 + args.warmup):
        fn()
    except Exception as e:  # noqa: BLE001  torch.compile of a remote-code-free model can still fail
      out[f"hf_compile_{preset}_error"] = json.dumps(f"{type(e).__name__}: {e}"[:300])
      del rows[name]
  times = interleave.time_interleaved({"matmul": matmul, **rows}, args.reps, min_rep_s=0.0)
  out[f"hf_{preset}_step_ms"] = interleave.median_ms(times["eager"])
  out[f"hf_{preset}_step_s"] = statistics.median(times["eager"])
  if "compile" in times:
    out[f"hf_compile_{preset}_step_ms"] = interleave.median_ms(times["compile"])
  out["torch_matmul_peak_tflops"] = round(2.0 * sz["n"] ** 3 / statistics.median(times["matmul"]) / 1e12, 1)
  out[f"hf_{preset}_peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2) if dev == "cuda" else float("nan")
  return out


def child_layer(args) -> dict:
  """The routed-expert SwiGLU of the `small` preset's width, forward + backward, per grouped GEMM."""
  from k2jax import accel

  gemms = [g for g in GEMMS if g != "jax_triton"] if not args.jax_triton else ["jax_triton"]
  accel.configure(gpu=not args.smoke, moe_gemm="jax_triton" if args.jax_triton else "auto")
  import jax
  import jax.numpy as jnp

  import interleave
  from k2jax.model import expert_parallel, moe_gemm

  sz = shapes(args.smoke)
  cfg = model_config("small", args.smoke)
  N, k, E, D, F = (
    sz["rows"] * sz["seq"],
    cfg.num_experts_per_tok,
    cfg.n_routed_experts,
    cfg.hidden_size,
    cfg.moe_intermediate_size,
  )
  keys = jax.random.split(jax.random.key(0), 6)
  bf = jnp.bfloat16
  x = jax.random.normal(keys[0], (N, D), bf)
  idx = jax.random.randint(keys[1], (N, k), 0, E)  # uniform routing: the balanced case K2's bias aims at
  wts = jax.nn.softmax(jax.random.normal(keys[2], (N, k)), -1)
  w_g, w_u = (0.02 * jax.random.normal(kk, (E, D, F), bf) for kk in keys[3:5])
  w_d = 0.02 * jax.random.normal(keys[5], (E, F, D), bf)

  def layer(gemm):
    def loss(x, w_g, w_u, w_d):
      y = expert_parallel.dispatch_compute_combine(x, wts, idx, w_g, w_u, w_d, gemm=gemm)
      return jnp.sum(y.astype(jnp.float32) ** 2), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

  def dense(x, a, b, c):  # the activated FLOPs as plain matmuls: N*k rows through D->F, D->F, F->D
    rows = jnp.broadcast_to(x[:, None], (N, k, D)).reshape(N * k, D)
    h = jax.nn.silu(rows @ a) * (rows @ b)
    return jnp.sum((h @ c).astype(jnp.float32) ** 2)

  fns, out, ref = {}, {}, None
  dense_fn = jax.jit(jax.grad(dense, argnums=(0, 1, 2, 3)))
  args_dense = (x, w_g[0], w_u[0], w_d[0])
  jax.block_until_ready(dense_fn(*args_dense))
  fns["dense"] = lambda: jax.block_until_ready(dense_fn(*args_dense))
  for g in gemms:
    try:
      moe_gemm.resolve(g)
      f = layer(g)
      (_, y), grads = jax.block_until_ready(f(x, w_g, w_u, w_d))
    except Exception as e:  # noqa: BLE001  a candidate that does not run here is reported, not fatal
      out[f"moe_layer_{g}_error"] = json.dumps(f"{type(e).__name__}: {e}"[:200])
      continue
    if ref is None and g == "ragged_dot":
      ref = (y, grads)
    elif ref is not None:
      out[f"moe_layer_{g}_max_diff_y"] = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref[0].astype(jnp.float32))))
      out[f"moe_layer_{g}_max_diff_dw"] = max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(grads[1:], ref[1][1:])
      )
    fns[g] = lambda f=f: jax.block_until_ready(f(x, w_g, w_u, w_d))
  times = interleave.time_interleaved(fns, args.reps, min_rep_s=0.0)
  out["moe_dense_active_ms"] = interleave.median_ms(times["dense"])
  out["moe_dense_active_s"] = statistics.median(times["dense"])
  for g in gemms:
    if g in times:
      out[f"moe_layer_{g}_ms"] = interleave.median_ms(times[g])
      out[f"moe_layer_{g}_s"] = statistics.median(times[g])
  out["moe_auto_is"] = moe_gemm.resolve("auto")
  return out


# ----------------------------------------------------------------------------------------- parent
def run_child(args, kind: str, env: dict | None = None) -> dict:
  import interleave

  cmd = [sys.executable, os.path.abspath(__file__), f"--child={kind}", f"--reps={args.reps}", f"--warmup={args.warmup}"]
  cmd += ["--smoke"] * args.smoke + ["--no_hf_compile"] * args.no_hf_compile + [f"--remat={args.remat}"]
  env = dict(os.environ, **(env or {}))
  if args.smoke:
    # One CPU device; the caller's other XLA flags (e.g. a test suite's optimisation level) kept.
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=interleave.one_device_xla_flags(), CUDA_VISIBLE_DEVICES="")
  else:
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # one row per process: give it the GPU
  t = time.perf_counter()
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout)[-1500:]
    print(f"# child {kind} failed (rc={proc.returncode}) after {time.perf_counter() - t:.0f} s:\n{tail}", flush=True)
    return {}
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  print(f"# {kind}: {time.perf_counter() - t:.0f} s", flush=True)
  print(" ".join(f"{k}={v}" for k, v in result.items() if not k.endswith("_s") or k.endswith("compile_s")), flush=True)
  return result


def _ratio(r: dict, a: str, b: str) -> float:
  return round(r[a] / r[b], 3) if a in r and b in r else float("nan")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code path in seconds")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--presets", default="small,large")
  p.add_argument("--remat", default="none", help="k2jax's model.remat_policy: none | full | dots | dots_no_batch")
  p.add_argument("--no_hf", action="store_true", help="skip the transformers rows")
  p.add_argument("--no_hf_compile", action="store_true", help="skip torch.compile (the slowest row to build)")
  p.add_argument("--no_flags_row", action="store_true", help="skip the step without accel.py's XLA flags")
  p.add_argument("--child_timeout", type=int, default=420)
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  p.add_argument("--jax_triton", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    kind, _, preset = args.child.partition(":")
    if kind == "layer_jax_triton":
      args.jax_triton, kind = True, "layer"
    result = {
      "k2": lambda: child_k2(preset, args),
      "hf": lambda: child_hf(preset, args),
      "layer": lambda: child_layer(args),
    }
    print(json.dumps(result[kind]()))
    return
  t0 = time.perf_counter()
  r = {}
  r.update(run_child(args, "layer"))
  if not args.smoke:
    r.update(run_child(args, "layer_jax_triton"))
  for preset in args.presets.split(","):
    r.update(run_child(args, f"k2:{preset}"))
    if not args.no_hf:
      r.update(run_child(args, f"hf:{preset}"))
  if not args.no_flags_row and "small" in args.presets:
    base = run_child(args, "k2:small", env={"K2JAX_XLA_GPU_FLAGS": "0"})
    if "small_step_s" in base and "small_step_s" in r:
      r["xla_flags_speedup"] = round(base["small_step_s"] / r["small_step_s"], 3)
      print(f"xla_flags_speedup={r['xla_flags_speedup']} (small step without / with k2jax/accel.py's flags)")
  auto = r.get("moe_auto_is", "")
  summary = {
    "small_hf_over_k2": _ratio(r, "hf_small_step_s", "small_step_s"),
    "small_mfu": r.get("small_mfu", float("nan")),
    "large_mfu": r.get("large_mfu", float("nan")),
    "small_peak_gb": r.get("small_peak_gb", float("nan")),
    "hf_small_peak_gb": r.get("hf_small_peak_gb", float("nan")),
    "moe_kernel_over_dense_active": _ratio(r, f"moe_layer_{auto}_s", "moe_dense_active_s"),
  }
  for k, v in summary.items():
    print(f"{k}={v}")
  print(f"bench_gpu_wall_s={time.perf_counter() - t0:.0f} smoke={args.smoke}")


if __name__ == "__main__":
  main()
