"""Weight handoff benchmark: trainer state -> engine, colocated (device arrays) and remote (streamed disk).

Run: python bench/weight_sync.py [--preset small] [--param_dtype bfloat16] [--reps 5] [--dir /tmp/...]
Three timings per rep, interleaved, on the same model state in this process (one device):
  colocated  `WeightSync.push` into the embedded engine (the engine serves on the trainer's device, so it
             takes the trainer's arrays as they are; blocked until the engine serves them)
  remote     a full `WeightSync.push` through disk (per-tensor streamed HF safetensors with CRCs, + index)
             to an engine that only records the update call (what SGLang then loads is its own cost)
  raw_write  one plain sequential write of the same number of bytes (one file, a 64 MiB buffer written
             over and over) to the same dir
Prints key=value lines: medians with min-max spread over the reps, and
  colocated_over_disk = colocated / remote        (target <= 0.05)
  colocated_over_raw_write = colocated / raw_write
  remote_over_raw_write = remote / raw_write      (target <= 1.5)
No fsync inside the timings (both disk paths end in the page cache alike); an `os.sync()` before each
timing (outside it) flushes what the previous one left dirty, so no path pays for another's writeback. The weights are a cheap deterministic
fill (random init of the small preset takes minutes and ~15 GB on a CPU host); peak host memory is about
the model once (the engine shares the trainer's arrays) plus one tensor.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import tempfile
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k2jax.api import model_from_state
from k2jax.convert.hf import _get
from k2jax.convert.layout import entries, hf_shape
from k2jax.engine.fake import FakeEngine, FakeEngineConfig
from k2jax.engine.inference import EngineConfig, InferenceEngine
from k2jax.model import K2Model, presets
from k2jax.rl.weight_sync import WeightSync, WeightSyncConfig


class _Recorder(FakeEngine):
  def update_weights(self, model_path, weight_version):
    self.last = (model_path, weight_version)


def _stats(xs: list[float]) -> str:
  return f"{np.median(xs):.4f} (min {min(xs):.4f} max {max(xs):.4f})"


def _filled_state(cfg) -> dict:
  """The model's pure state dict, each leaf a distinct sine pattern (one small program per leaf)."""
  abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))))
  leaves, treedef = jax.tree.flatten(abstract)

  def fill(a, i):
    x = jnp.sin(jax.lax.iota(jnp.float32, a.size) * (0.37 + 1e-3 * i)) * 0.02
    return x.astype(a.dtype).reshape(a.shape)

  return jax.tree.unflatten(treedef, [jax.jit(functools.partial(fill, a, i))() for i, a in enumerate(leaves)])


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="small")
  ap.add_argument("--param_dtype", default="bfloat16")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--dir", default="")
  args = ap.parse_args()
  cfg = presets.get(args.preset, param_dtype=args.param_dtype, compute_dtype=args.param_dtype)
  state = _filled_state(cfg)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  engine = InferenceEngine(model_from_state(cfg, state), EngineConfig(max_slots=1, max_seq_len=16))
  root = args.dir or tempfile.mkdtemp(prefix="k2jax_weight_sync_")
  colocated = WeightSync(WeightSyncConfig(os.path.join(root, "colocated")), engine, cfg)
  remote = WeightSync(
    WeightSyncConfig(os.path.join(root, "remote"), keep_last=1), _Recorder(FakeEngineConfig(), lambda r: 1), cfg
  )
  chunk = np.ones(min(nbytes, 64 << 20), np.uint8)  # the raw write streams one 64 MiB buffer
  raw_path = os.path.join(root, "raw.bin")

  def t_colocated():
    os.sync()
    t0 = time.perf_counter()
    colocated.push(state)
    jax.block_until_ready(engine._runner.params())
    return time.perf_counter() - t0

  def t_remote():
    os.sync()
    t0 = time.perf_counter()
    remote.push(state, full=True)
    return time.perf_counter() - t0

  def t_raw():
    os.sync()
    t0 = time.perf_counter()
    with open(raw_path, "wb") as f:
      left = nbytes
      while left:
        n = min(left, chunk.nbytes)
        f.write(chunk.data[:n])
        left -= n
    dt = time.perf_counter() - t0
    os.remove(raw_path)
    return dt

  t_colocated(), t_raw()  # warm up: the engine's swap path, the page cache
  tracemalloc.start()  # the first remote push (plan included), measured: host memory stays near one tensor
  t_remote()
  host_peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  times = {"colocated": [], "remote": [], "raw_write": []}
  for _ in range(args.reps):
    times["colocated"].append(t_colocated())
    times["remote"].append(t_remote())
    times["raw_write"].append(t_raw())
  engine.close()
  shutil.rmtree(root, ignore_errors=True)
  med = {k: float(np.median(v)) for k, v in times.items()}
  print(
    f"preset={args.preset} param_dtype={args.param_dtype} bytes={nbytes} reps={args.reps} devices={jax.device_count()}"
  )
  for k, v in times.items():
    print(f"{k}_s={_stats(v)}")
  print(f"remote_GBps={nbytes / med['remote'] / 1e9:.3f} raw_write_GBps={nbytes / med['raw_write'] / 1e9:.3f}")
  print(f"colocated_over_disk={med['colocated'] / med['remote']:.4f}")
  print(f"colocated_over_raw_write={med['colocated'] / med['raw_write']:.4f}")
  print(f"remote_over_raw_write={med['remote'] / med['raw_write']:.3f}")
  largest = max(
    math.prod(hf_shape(_get(state, e.path).shape, e)) * _get(state, e.path).dtype.itemsize for e in entries(cfg)
  )
  print(
    f"remote_host_peak_bytes={host_peak} largest_tensor_bytes={largest} host_peak_over_largest={host_peak / largest:.3f}"
  )


if __name__ == "__main__":
  main()
