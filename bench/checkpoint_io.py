"""Checkpoint import benchmark: the sharded HF reader against raw sequential reads of the same bytes.

Run: python bench/checkpoint_io.py [--preset small] [--num_layers N] [--reps 5] [--threads 0] [--rows=import,export]
Writes two HF directories of the preset (same weights): bf16, and the release's block-FP8 layout (F8_E4M3
+ float32 128x128 `weight_scale_inv` for every projection; bf16 embeddings/norms/router; f32 bias). Then,
interleaved over the reps (bench/interleave.py), on one device in this process:
  raw_{src}     sequential `os.preadv` of every shard file of that directory, 64 MiB at a time
  import_{src}  `k2jax.api.source_state(dir, cfg)`: the reader, bf16 params, onto the device
Prints key=value lines (medians with min-max spread):
  import_over_raw_read_{bf16,fp8} = raw / import seconds (import throughput relative to raw reads;
                                   target >= 0.7); `_cpu`: the same in CPU seconds (steadier under load)
  peak_rss_over_local_shard_bytes_{1,2}proc = (peak RSS - RSS before the load) / (bytes of this process's
                                   shards + the in-flight budget), from fresh processes (1 CPU device each;
                                   2 processes = `jax.distributed` on localhost, mesh fsdp=2), one run each
  {import,export}_{src}_stages   raw I/O MB/s, transform MB/s per core (CPU-s beyond the raw twin's), job
                                 MB/s per core (all its CPU-s), the bound min(raw I/O, job per core x
                                 threads) and the job's MB/s, per rep (`stage_bounds`)
  {import,export}_over_bound_{src} = job MB/s / that bound (target >= 0.8: the pipeline reaches the slower
                                 of the disk and the cores), median with spread; `_excl_{read,write}`: against
                                 a bound that counts the job's reads/writes as free CPU (for comparison)
  kimi_k2_v5p1024_*              estimated bytes read per host and seconds at the measured FP8 rate, and
                                 at the per-core transform rate x a v5p host's 208 vCPUs
--threads (0: two per core, the default) sets the reader's and writer's threads; `threads=` is printed first.
The files are read from the page cache in both timings (each directory is read once before timing):
this measures the reader's CPU cost over the bytes, not the disk.

Export rows (`bench/checkpoint_export.py`, after the import rows): `k2jax.convert.writer.save_hf` in bf16
and block-FP8 against raw sequential writes of the same bytes, both fsynced (an export is durable), same
preset and param dtype, interleaved: export_over_raw_write_{bf16,fp8} = raw / export seconds (target
>= 0.7), with GB/s, GB per CPU-second, fp8_over_bf16_bytes and the FP8 quantize rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.interleave import fmt, load_average, median_ms, ratio, time_interleaved  # noqa: E402
from k2jax.convert import fp8  # noqa: E402
from k2jax.convert.hf_dir import INDEX, abstract_state  # noqa: E402
from k2jax.convert.layout import entries, hf_shape  # noqa: E402
from k2jax.convert.pool import default_threads, resolve_threads  # noqa: E402
from k2jax.model import presets  # noqa: E402

KIMI_FP8_BYTES = 958.51 * 2**30  # the release on disk (reference §1.4)
V5P_1024_HOSTS = 128  # 512 chips, 4 per host
V5P_HOST_VCPUS = 208  # a v5p host VM (ct5p-hightpu-4t): 208 vCPUs
_CHUNK = 64 << 20
_SHARD_BYTES = 512 << 20


def write_sources(cfg, root: str) -> dict[str, str]:
  """bf16 and block-FP8 HF directories of `cfg` with the same deterministic weights, one tensor at a time."""
  dirs = {"bf16": os.path.join(root, "bf16"), "fp8": os.path.join(root, "fp8")}
  writers = {k: _ShardWriter(d) for k, d in dirs.items()}
  rng = np.random.default_rng(0)
  abstract = abstract_state(cfg)
  for entry in entries(cfg):
    leaf = abstract
    for p in entry.path:
      leaf = leaf[p]
    shape = hf_shape(leaf.shape, entry)
    for _, key in entry.keys(cfg):
      w = (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)
      if entry.path[-1] == "bias":
        writers["bf16"].add(key, w)
        writers["fp8"].add(key, w)
        continue
      writers["bf16"].add(key, w.astype(ml_dtypes.bfloat16))
      if fp8.is_quantized_key(key):
        q, s = fp8.quantize(w)
        writers["fp8"].add(key, q)
        writers["fp8"].add(key + fp8.SCALE_SUFFIX, s)
      else:
        writers["fp8"].add(key, w.astype(ml_dtypes.bfloat16))
  hf = cfg.to_hf_dict()
  for name, w in writers.items():
    extra = {"quantization_config": fp8.QuantConfig().to_hf()} if name == "fp8" else {}
    w.close(dict(hf, torch_dtype="bfloat16", **extra))
  return dirs


class _ShardWriter:
  def __init__(self, path: str):
    self.path, self.buf, self.size, self.n, self.wmap = path, {}, 0, 0, {}
    os.makedirs(path, exist_ok=True)

  def add(self, key: str, t: np.ndarray) -> None:
    self.buf[key] = t
    self.size += t.nbytes
    if self.size >= _SHARD_BYTES:
      self._flush()

  def _flush(self) -> None:
    if self.buf:
      self.n += 1
      name = f"model-{self.n:05d}.safetensors"
      save_file(self.buf, os.path.join(self.path, name), metadata={"format": "pt"})
      self.wmap.update({k: name for k in self.buf})
      self.buf, self.size = {}, 0

  def close(self, config: dict) -> None:
    self._flush()
    with open(os.path.join(self.path, INDEX), "w") as f:
      json.dump({"metadata": {}, "weight_map": self.wmap}, f)
    with open(os.path.join(self.path, "config.json"), "w") as f:
      json.dump(config, f)


def shard_files(path: str) -> list[str]:
  return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def raw_read(path: str) -> int:
  """Sequential reads of every shard file (the baseline: the same bytes, no parsing)."""
  buf = memoryview(bytearray(_CHUNK))
  total = 0
  for file in shard_files(path):
    fd = os.open(file, os.O_RDONLY)
    try:
      off = 0
      while n := os.preadv(fd, [buf], off):
        off += n
      total += off
    finally:
      os.close(fd)
  return total


def import_once(path: str, cfg, threads: int) -> None:
  """What `k2jax.api.source_state(path, cfg)` does for an HF directory, on `threads` reader threads."""
  from k2jax.convert import reader

  state = reader.read_state(path, cfg, abstract_state(cfg), threads=threads)
  jax.block_until_ready(state)


def _user_sys(fn, out: list):
  """`fn`, appending each call's (user, system) CPU seconds to `out`: on this VM the kernel's share (fresh
  pages for the leaves, which the raw read's reused buffer never needs) is most of an import's CPU."""

  def run():
    t0 = os.times()
    fn()
    t1 = os.times()
    out.append((t1.user - t0.user, t1.system - t0.system))

  return run


def breakdown(cfg, sizes: dict, times: dict, reps: int) -> str:
  """What an import costs per element beyond the raw read, measured here (medians over `reps`): first
  touch of fresh memory (the leaves are new; the raw read reuses one buffer), the tiled transpose of an
  expert-shaped bf16 tensor, XLA:CPU's FP8 dequantization of one reader group, and whether a CPU device aliased
  the host buffer. `bound_*`: the ratio one thread could reach if the import did nothing else, raw /
  (raw + touch + transpose [+ dequant]) over the same bytes: the targets' ceiling on this host."""
  import jax.numpy as jnp

  from k2jax.convert import blockops, reader

  n_touch = 256 << 20
  r, c = cfg.moe_intermediate_size, cfg.hidden_size
  src = np.ones((64, r, c), ml_dtypes.bfloat16)
  dst = blockops.aligned_empty((64, c, r), ml_dtypes.bfloat16)
  group = max(1, reader.XLA_GROUP_ELEMS // (r * c))  # the reader's FP8 group, in aligned buffers
  q = blockops.aligned_empty((group, r, c), np.uint8)
  q[...] = 0x38  # 1.0
  scale = blockops.aligned_empty((group, -(-r // 128), -(-c // 128)), np.float32)
  scale[...] = 1.0
  dq = {"dtype": "F8_E4M3", "block": (128, 128), "origin": (0, 0), "transpose": False, "out_dtype": jnp.bfloat16}

  def touch():
    np.empty(n_touch, np.uint8).fill(1)  # a fresh mmap each time (pages freed a moment ago: warm)

  def transpose():
    for e in range(src.shape[0]):
      blockops.transpose_into(dst[e], src[e])

  def dequant():
    blockops.convert(jax.device_put(q), jax.device_put(scale), **dq).block_until_ready()

  t = time_interleaved({"touch": touch, "transpose": transpose, "dequant": dequant}, reps)
  size = {"touch": n_touch, "transpose": src.nbytes, "dequant": q.size}
  rate = {k: size[k] / float(np.median(t[k])) for k in t}  # bytes/s (dequant: elements/s)
  raw = {k: sizes[k] / float(np.median(times[f"raw_{k}"])) for k in sizes}
  a = blockops.aligned_empty((1024,), np.float32)
  aliased = jax.device_put(a).unsafe_buffer_pointer() == a.ctypes.data
  per_elem_bf16 = 2 / raw["bf16"] + 2 / rate["touch"] + 2 / rate["transpose"]
  per_elem_fp8 = 1 / raw["fp8"] + 2 / rate["touch"] + 1 / rate["dequant"] + 2 / rate["transpose"]
  return (
    f"breakdown raw_read_bf16_GBps={raw['bf16'] / 1e9:.2f} raw_read_fp8_GBps={raw['fp8'] / 1e9:.2f} "
    f"fresh_memory_touch_GBps={rate['touch'] / 1e9:.2f} transpose_bf16_GBps={rate['transpose'] / 1e9:.2f} "
    f"fp8_dequant_xla_Melem_per_s={rate['dequant'] / 1e6:.0f} device_put_aliases_host_buffer={aliased} "
    f"bound_import_over_raw_read_bf16={2 / raw['bf16'] / per_elem_bf16:.3f} "
    f"bound_import_over_raw_read_fp8={1 / raw['fp8'] / per_elem_fp8:.3f} (one thread, nothing else; reps={reps})"
  )


# ------------------------------------------------------------------------------ peak RSS (subprocess)


def rss_worker(path: str, budget: int, nproc: int, pid: int, port: int) -> None:
  """One process of the RSS measurement: prints `rss_delta=<bytes> local=<bytes>`."""
  if nproc > 1:
    from k2jax import distributed

    distributed.initialize(f"localhost:{port}", nproc, pid)
  from flax import nnx

  from k2jax import sharding
  from k2jax.api import source_state
  from k2jax.convert.hf_dir import read_config
  from k2jax.model.transformer import K2Model

  cfg = read_config(path, param_dtype="bfloat16")
  mesh = sharding.make_mesh({"fsdp": -1})
  abstract = nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  shardings = nnx.to_pure_dict(sharding.param_shardings(abstract, mesh, "fsdp"))
  jax.device_put(np.zeros(4), jax.local_devices()[0]).block_until_ready()  # runtime up before the baseline
  before = _rss_now()
  state = source_state(path, cfg, shardings, read_budget_bytes=budget)
  jax.block_until_ready(state)
  peak = _status_kb("VmHWM") * 1024  # not ru_maxrss: Linux keeps that across execve (the parent's peak)
  local = sum(s.data.nbytes for leaf in jax.tree.leaves(state) for s in leaf.addressable_shards)
  print(f"rss_delta={peak - before} local={local}", flush=True)


def _rss_now() -> int:
  return _status_kb("VmRSS") * 1024


def _status_kb(field: str) -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_rss_ratio(path: str, nproc: int, budget: int) -> float:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, os.path.abspath(__file__), "--rss_worker", path, str(budget), str(nproc)]
  procs = [
    subprocess.Popen([*cmd, str(i), str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for i in range(nproc)
  ]
  ratios = []
  for p in procs:
    out, err = p.communicate(timeout=1800)
    if p.returncode:
      raise RuntimeError(f"rss worker failed ({p.returncode}):\n{err[-3000:]}")
    kv = dict(x.split("=") for x in out.split() if "=" in x)
    ratios.append(int(kv["rss_delta"]) / (int(kv["local"]) + budget))
  return max(ratios)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="small")
  ap.add_argument("--num_layers", type=int, default=0, help="override the preset's layer count (0: keep it)")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--dir", default="")
  ap.add_argument("--read_budget_bytes", type=int, default=256 << 20)
  ap.add_argument("--rss_worker", nargs=5, default=None)
  ap.add_argument("--rows", default="import,export", help="which halves to run: import, export or both")
  ap.add_argument(
    "--threads", type=int, default=0, help="reader/writer threads (0: two per core of this host, the default)"
  )
  args = ap.parse_args()
  if args.rss_worker:
    path, budget, nproc, pid, port = args.rss_worker
    return rss_worker(path, int(budget), int(nproc), int(pid), int(port))
  over = {"num_hidden_layers": args.num_layers} if args.num_layers else {}
  cfg = presets.get(args.preset, param_dtype="bfloat16", **over)
  root = args.dir or tempfile.mkdtemp(prefix="k2jax-ckpt-bench-")
  threads = resolve_threads(args.threads)
  cores = default_threads()
  print(
    f"threads={threads} cores={cores} (reader/writer threads; the bounds use min(threads, cores)="
    f"{min(threads, cores)}; other jobs share these cores, so wall-time figures are noisy)",
    flush=True,
  )
  try:
    per_core = {}
    if "import" in args.rows.split(","):
      per_core.update(import_rows(cfg, args, root, min(threads, cores)))
    if "export" in args.rows.split(","):
      from bench.checkpoint_export import export_rows

      measured: dict = {}
      export_rows(cfg, args.reps, os.path.join(root, "export"), threads=threads, out=measured)
      per_core.update(export_bounds(measured, min(threads, cores), args.reps))
    projection(per_core)
  finally:
    if not args.dir:
      shutil.rmtree(root, ignore_errors=True)


def stage_bounds(
  name: str, nbytes: int, io: str, job: str, times: dict, cpu: dict, threads: int, reps: int
) -> tuple[list[str], float]:
  """Per-stage rates of `job` (an import or export of `nbytes`) against its raw I/O twin `io`, per rep:
  raw I/O MB/s (wall); transform MB/s per core = bytes / (job CPU-s - raw CPU-s), the CPU the job spends
  beyond moving the bytes (transposes, dequantization, casts, quantization, fresh pages); job MB/s per core
  = bytes / job CPU-s, everything the job runs on the cores, its own reads or writes included.

  bound = min(raw I/O, job per core x threads): the slower of the disk and the cores. The job's reads count
  against the cores: from the page cache (as here) a read is the kernel copying on the same cores the
  transforms run on. `{name}_over_bound` = job MB/s / bound: 1.0 is a job that either moves bytes as fast
  as the raw twin or keeps all `threads` cores busy for its whole wall time.
  `{name}_over_bound_excl_read` is the same against min(raw I/O, transform per core x threads), which
  counts the reads as free: a job whose reads are a share f of its CPU cannot exceed 1 - f on it however
  well it keeps the cores busy (f is printed), so it is shown for comparison, not as the target.
  Returns the lines and the median transform MB/s per core (what the projection scales)."""
  io_rate = [nbytes / t for t in times[io]]
  core = [nbytes / max(c - r, 1e-9) for c, r in zip(cpu[job], cpu[io])]
  job_core = [nbytes / c for c in cpu[job]]
  io_share = [min(1.0, r / c) for c, r in zip(cpu[job], cpu[io])]
  bound = [min(a, b * threads) for a, b in zip(io_rate, job_core)]
  bound_excl = [min(a, b * threads) for a, b in zip(io_rate, core)]
  rate = [nbytes / t for t in times[job]]
  over = [r / b for r, b in zip(rate, bound)]
  over_excl = [r / b for r, b in zip(rate, bound_excl)]
  med = lambda xs: float(np.median(xs)) / 1e6  # noqa: E731
  kind = "read" if name.startswith("import") else "write"
  stages = (
    f"{name}_stages raw_{kind}_MBps={med(io_rate):.0f} transform_MBps_per_core={med(core):.0f} "
    f"job_MBps_per_core={med(job_core):.0f} raw_{kind}_share_of_job_cpu={float(np.median(io_share)):.3f} "
    f"bound_MBps={med(bound):.0f} (min(raw {kind}, job per core x {threads} threads)) {name}_MBps={med(rate):.0f}"
  )
  lines = [
    stages,
    fmt(f"{name}_over_bound", (float(np.median(over)), min(over), max(over)), reps),
    fmt(f"{name}_over_bound_excl_{kind}", (float(np.median(over_excl)), min(over_excl), max(over_excl)), reps),
  ]
  return lines, float(np.median(core))


def export_bounds(measured: dict, threads: int, reps: int) -> dict:
  """The export rows' bounds (`stage_bounds` on the export timings); returns the per-core rates."""
  times, cpu, nbytes = measured["times"], measured["cpu"], measured["nbytes"]
  out = {}
  for d, b in (("bf16", nbytes["bfloat16"]), ("fp8", nbytes["fp8"])):
    lines, out[f"export_{d}"] = stage_bounds(f"export_{d}", b, f"raw_{d}", f"export_{d}", times, cpu, threads, reps)
    for line in lines:
      print(line, flush=True)
  return out


def projection(per_core: dict) -> None:
  """Kimi-K2 on a v5p-1024 host at the measured per-core transform rates times the host's cores."""
  per_host = KIMI_FP8_BYTES / V5P_1024_HOSTS
  for name in ("import_fp8", "export_fp8"):
    if name in per_core:
      rate = per_core[name] * V5P_HOST_VCPUS
      print(
        f"kimi_k2_v5p1024_{name}_seconds_cores_bound={per_host / rate:.1f} (estimated: {per_host / 2**30:.2f} GiB "
        f"per host at the measured {per_core[name] / 1e6:.0f} MB/s per core x {V5P_HOST_VCPUS} vCPUs = "
        f"{rate / 1e9:.1f} GB/s; the host's disk must deliver that much too, else it is the bound; untested on TPU)",
        flush=True,
      )


def import_rows(cfg, args, root: str, threads: int) -> dict:
  """The import half: the reader against raw reads, per-stage rates and bounds, peak RSS, the Kimi-K2
  projection at the measured import rate; returns the per-core transform rates."""
  dirs = write_sources(cfg, root)
  sizes = {k: sum(os.path.getsize(f) for f in shard_files(d)) for k, d in dirs.items()}
  print(
    f"preset={args.preset} num_hidden_layers={cfg.num_hidden_layers} bf16_bytes={sizes['bf16']} "
    f"fp8_bytes={sizes['fp8']} {load_average()}",
    flush=True,
  )
  fns, split = {}, {}
  for k, d in dirs.items():
    raw_read(d)  # into the page cache: both timings then read from memory
    fns[f"raw_{k}"] = _user_sys(lambda d=d: raw_read(d), split.setdefault(f"raw_{k}", []))
    fns[f"import_{k}"] = _user_sys(lambda d=d: import_once(d, cfg, args.threads), split.setdefault(f"import_{k}", []))
  cpu: dict = {}
  times = time_interleaved(fns, args.reps, cpu=cpu)
  per_core: dict = {}
  for k in dirs:
    print(f"raw_{k}_ms={median_ms(times[f'raw_{k}'])} import_{k}_ms={median_ms(times[f'import_{k}'])}")
    u, sy = (float(np.median([x[i] for x in split[f"import_{k}"]])) for i in (0, 1))
    ru, rs = (float(np.median([x[i] for x in split[f"raw_{k}"]])) for i in (0, 1))
    print(f"import_{k}_user_s={u:.2f} import_{k}_sys_s={sy:.2f} raw_{k}_user_s={ru:.2f} raw_{k}_sys_s={rs:.2f}")
    print(fmt(f"import_over_raw_read_{k}", ratio(times, f"raw_{k}", f"import_{k}"), args.reps), flush=True)
    print(fmt(f"import_over_raw_read_{k}_cpu", ratio(cpu, f"raw_{k}", f"import_{k}"), args.reps), flush=True)
    lines, per_core[f"import_{k}"] = stage_bounds(
      f"import_{k}", sizes[k], f"raw_{k}", f"import_{k}", times, cpu, threads, args.reps
    )
    for line in lines:
      print(line, flush=True)
  print(breakdown(cfg, sizes, times, args.reps), flush=True)
  for n in (1, 2):
    r = peak_rss_ratio(dirs["bf16"], n, args.read_budget_bytes)
    print(f"peak_rss_over_local_shard_bytes_{n}proc={r:.3f} read_budget_bytes={args.read_budget_bytes} runs=1")
  fp8_rate = sizes["fp8"] / float(np.median(times["import_fp8"]))
  per_host = KIMI_FP8_BYTES / V5P_1024_HOSTS
  print(f"kimi_k2_v5p1024_bytes_read_per_host={per_host:.3e} (estimated: 958.5 GiB / 128 hosts, fsdp over all chips)")
  print(
    f"kimi_k2_v5p1024_import_seconds={per_host / fp8_rate:.0f} (estimated at the measured FP8 import rate "
    f"{fp8_rate / 2**20:.0f} MiB/s per process from page cache; untested on TPU)"
  )
  return per_core


if __name__ == "__main__":
  main()
