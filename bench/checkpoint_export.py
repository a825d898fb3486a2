"""HF export benchmark: the one writer (`k2jax.convert.writer.save_hf`) against raw writes of the same bytes.

The export half of `bench/checkpoint_io.py` (which prints these rows after its import rows; `--rows=export`
runs only them); standalone:
Run: python bench/checkpoint_export.py [--preset small] [--param_dtype bfloat16] [--reps 5] [--dir /tmp/...]
One process, one CPU device. Four timings per rep, interleaved (A B C D A B C D ..., after one untimed round), on the same state,
each into a new path; before each, outside its timing: `os.sync()` (what the previous one left dirty) and
the deletion of that timing's previous output (timed apart: `delete_previous_*`):
  export_bf16  save_hf(dtype='bfloat16'): plan, per-tensor streamed safetensors, index, config.json, the
               atomic swap (its files fsynced, as an export is)
  raw_bf16     one sequential write of the same number of bytes (a 64 MiB buffer over and over) + fsync,
               its writeback started every 32 MiB as the writer starts it (`st_stream.start_writeback`)
  export_fp8   save_hf(dtype='fp8'): the same, block-FP8 (per job of whole 128-row slabs, on the host: one XLA:CPU
               call, `blockops.quantize_fp8`, from blockops.XLA_QUANT_MIN_ELEMS elements, numpy below)
  raw_fp8      raw write + fsync of the FP8 export's bytes
Prints key=value lines; the ratios are per-rep throughput ratios (raw seconds / export seconds, median
with min-max spread):
  export_over_raw_write_bf16=   (target >= 0.7)
  export_over_raw_write_fp8=    (target >= 0.7)
plus the bytes, the GB/s of each path, the export's GB per CPU-second of this process (what one free
core sustains: the figure to scale from on a machine whose disk and cores are shared), fp8_over_bf16_bytes (what an FP8 weight push saves) and the FP8
quantize rates alone (`quantize_Melem_per_s` numpy, `quantize_xla_Melem_per_s` XLA; one [moe_intermediate,
hidden] expert weight at a time, one thread),
the rates docs/results.md's pod estimates are computed from. The weights are a cheap deterministic fill (random init of
the small preset takes minutes on a CPU host).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import interleave  # noqa: E402
from k2jax.convert import blockops, fp8, pool, st_stream, writer  # noqa: E402
from k2jax.model import K2Model, presets  # noqa: E402

KIMI_FP8_BYTES = 958.51 * 2**30  # the release on disk (reference §1.4); an FP8 export has the same layout
V5P_1024_HOSTS = 128  # 512 chips, 4 per host


def filled_state(cfg) -> dict:
  """The model's pure state dict, each leaf a distinct sine pattern (one small program per leaf)."""
  abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))))
  leaves, treedef = jax.tree.flatten(abstract)

  def fill(a, i):
    x = jnp.sin(jax.lax.iota(jnp.float32, a.size) * (0.37 + 1e-3 * i)) * 0.02
    return x.astype(a.dtype).reshape(a.shape)

  return jax.tree.unflatten(treedef, [jax.jit(functools.partial(fill, a, i))() for i, a in enumerate(leaves)])


def _tensor_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def _raw_write(path: str, nbytes: int, chunk: np.ndarray) -> None:
  """`nbytes` written and fsynced, starting the disk's writeback as the writer does (every
  `st_stream.WRITEBACK_BYTES`), so the baseline is the disk's rate with the same overlap."""
  with open(path, "wb") as f:
    left, done, flushed = nbytes, 0, 0
    while left:
      n = min(left, chunk.nbytes)
      f.write(chunk.data[:n])
      left, done = left - n, done + n
      if done - flushed >= st_stream.WRITEBACK_BYTES:
        f.flush()
        st_stream.start_writeback(f.fileno(), flushed, done - flushed)
        flushed = done
    f.flush()
    os.fsync(f.fileno())


class _Fresh:
  """One timing's output path, a new one per call: `clear` (run before each call, outside the timing)
  deletes the previous call's output, timing that apart (`deletes`), runs `os.sync()` and moves `path`
  on. Exporting over the previous export would make the export also delete it: 0.23 s of one core in
  the kernel freeing the old files' pages for `small` FP8 (7% of the export, printed as
  `delete_previous_*_s`), which is not the pipeline's work and which the RL weight push
  (`Writer.write` into a fresh directory) never does."""

  def __init__(self, root: str, name: str):
    self.root, self.name, self.n, self.deletes = root, name, 0, []
    self.path = ""

  def clear(self) -> None:
    if self.path and os.path.lexists(self.path):
      t = time.perf_counter()
      shutil.rmtree(self.path) if os.path.isdir(self.path) else os.remove(self.path)
      self.deletes.append(time.perf_counter() - t)
    os.sync()  # what the previous timing left dirty is flushed here, not inside the next one
    self.n += 1
    self.path = os.path.join(self.root, f"{self.name}.{self.n}")


def export_rows(cfg, reps: int, root: str, threads: int = 0, out: dict | None = None) -> list[str]:
  """Runs the export half for model config `cfg` (files under `root`) with the writer on `threads`
  threads (0: the writer's default); returns (and prints) its lines. `out` receives the per-rep wall and CPU
  seconds and the bytes (`bench/checkpoint_io.py` computes its bounds from them)."""
  state = filled_state(cfg)
  dst = {d: _Fresh(root, f"export_{d}") for d in ("bfloat16", "fp8")}
  raw = {d: _Fresh(root, f"raw_{d}.bin") for d in ("bfloat16", "fp8")}
  chunk = np.ones(64 << 20, np.uint8)
  size = {}  # bytes of each export's tensors (from its first, untimed call: before its raw twin runs)

  def export(d: str) -> None:
    writer.save_hf(cfg, state, dst[d].path, dtype=d, threads=threads)
    size.setdefault(d, _tensor_bytes(dst[d].path))

  fns = {
    "export_bf16": lambda: export("bfloat16"),
    "raw_bf16": lambda: _raw_write(raw["bfloat16"].path, size["bfloat16"], chunk),
    "export_fp8": lambda: export("fp8"),
    "raw_fp8": lambda: _raw_write(raw["fp8"].path, size["fp8"], chunk),
  }
  before = {
    "export_bf16": dst["bfloat16"].clear,
    "raw_bf16": raw["bfloat16"].clear,
    "export_fp8": dst["fp8"].clear,
    "raw_fp8": raw["fp8"].clear,
  }
  cpu: dict = {}
  times = interleave.time_interleaved(fns, reps, cpu=cpu, min_rep_s=0.0, before=before)
  nbytes = dict(size)
  for f in (*dst.values(), *raw.values()):
    f.clear()
  if out is not None:
    out.update(times=times, cpu=cpu, nbytes=nbytes)
  lines = [
    f"export: hidden={cfg.hidden_size} layers={cfg.num_hidden_layers} param_dtype={cfg.param_dtype} reps={reps} "
    f"devices={jax.device_count()} writer_threads={pool.resolve_threads(threads)} "
    f"{interleave.load_average()}",
    f"export_bytes_bf16={nbytes['bfloat16']} export_bytes_fp8={nbytes['fp8']} "
    f"fp8_over_bf16_bytes={nbytes['fp8'] / nbytes['bfloat16']:.3f}",
  ]
  for d, e, r in (("bf16", "export_bf16", "raw_bf16"), ("fp8", "export_fp8", "raw_fp8")):
    b = nbytes["bfloat16" if d == "bf16" else "fp8"]
    lines.append(interleave.fmt(f"export_over_raw_write_{d}", interleave.ratio(times, r, e), reps))
    lines.append(
      f"export_{d}_GBps={b / statistics.median(times[e]) / 1e9:.3f} raw_{d}_GBps={b / statistics.median(times[r]) / 1e9:.3f} "
      f"export_{d}_s={interleave.median_ms(times[e])}ms export_{d}_cpu_s={statistics.median(cpu[e]):.2f} "
      f"export_{d}_GB_per_cpu_s={b / statistics.median(cpu[e]) / 1e9:.3f}"
    )
  lines.append(
    " ".join(
      f"delete_previous_export_{d}_s={interleave.median_ms(dst[full].deletes)}ms "
      f"delete_previous_raw_{d}_s={interleave.median_ms(raw[full].deletes)}ms"
      for d, full in (("bf16", "bfloat16"), ("fp8", "fp8"))
    )
    + " (outside the timings: what an export over the previous one adds, on one core)"
  )
  lines.append(_quantize_rate(cfg, reps))
  per_host = KIMI_FP8_BYTES / V5P_1024_HOSTS  # each tensor is written once: 1/128 of the export per host
  fp8_wall, fp8_cpu = (
    nbytes["fp8"] / statistics.median(times["export_fp8"]),
    nbytes["fp8"] / statistics.median(cpu["export_fp8"]),
  )
  lines.append(
    f"kimi_k2_v5p1024_export_fp8_bytes_per_host={per_host:.3e} kimi_k2_v5p1024_export_fp8_seconds={per_host / fp8_wall:.0f} "
    f"(at the measured wall rate) cpu_bound_seconds={per_host / fp8_cpu:.0f} (at the GB per CPU-second; estimated, "
    "untested on TPU)"
  )
  for line in lines:
    print(line, flush=True)
  return lines


def _quantize_rate(cfg, reps: int) -> str:
  """The quantizers alone on one expert weight [moe_intermediate, hidden] (HF layout), Melem/s, one thread:
  numpy's `fp8.quantize` and the writer's one XLA call (`blockops.quantize_fp8`), interleaved."""
  w = (np.sin(np.arange(cfg.moe_intermediate_size * cfg.hidden_size, dtype=np.float32)) * 0.02).reshape(
    cfg.moe_intermediate_size, cfg.hidden_size
  )
  blockops.quantize_fp8(w, st_stream.FP8_BLOCK)  # compiled outside the timing
  times = interleave.time_interleaved(
    {"numpy": lambda: fp8.quantize(w), "xla": lambda: blockops.quantize_fp8(w, st_stream.FP8_BLOCK)}, reps
  )
  out = []
  for name, key in (("numpy", "quantize"), ("xla", "quantize_xla")):
    rates = sorted(w.size / t / 1e6 for t in times[name])
    out.append(f"{key}_Melem_per_s={statistics.median(rates):.1f} {key}_spread=[{rates[0]:.1f},{rates[-1]:.1f}]")
  return " ".join(out)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="small")
  ap.add_argument("--param_dtype", default="bfloat16")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--dir", default="")
  args = ap.parse_args()
  root = args.dir or tempfile.mkdtemp(prefix="k2jax_export_bench_")
  cfg = presets.get(args.preset, param_dtype=args.param_dtype, compute_dtype=args.param_dtype)
  print(f"preset={args.preset}", flush=True)
  try:
    export_rows(cfg, args.reps, root)
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
