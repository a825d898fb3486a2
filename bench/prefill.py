"""Batched prefill vs one prefill per admitted request, on the colocated RL engine's serving mesh.

Run: python bench/prefill.py [--reps 5] [--requests 16] [--new 4]
8 fake CPU devices, the embedded engine on tp_ep (expert:4,tensor:2) with max_slots 16 and max_seq_len 64
(bench/colocated.py's engine). One burst = `--requests` requests (prompts of 6..13 tokens, greedy,
`--new` new tokens) submitted while the engine is paused and released at once (as an RL generate phase
hands its rollouts over), then waited for. Two admission modes on the same engine (same weights, cache
and compiled programs), interleaved A B A B:
  batched     the requests admitted in one step prefill in one program (the engine's path)
  one_by_one  each admitted request prefills alone (the path before batched prefill; forced here by
              `prefill_fits` answering one row)
Prints, per mode and for `--new` tokens and for 1 token (a burst that is prefill only), median ms with
[min, max], the prefill programs per burst, and batched_over_one_by_one (median of per-rep ratios, wall
and CPU seconds). On a CPU host the fake devices share the cores: the figures measure dispatch and
per-program overhead, not accelerator throughput; untested on TPU/GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.interleave import fmt, load_average, median_ms, ratio, time_interleaved  # noqa: E402
from k2jax.engine import EngineConfig, GenerateRequest, InferenceEngine, SamplingParams  # noqa: E402
from k2jax.model import K2Model, presets  # noqa: E402

MAX_LEN, SLOTS = 64, 16


def _burst(engine, requests: int, new: int, one_by_one: bool, calls: list[int]):
  runner = engine._runner
  fits, prefill = runner.prefill_fits, runner.prefill

  def counted(*args):
    calls[-1] += 1
    return prefill(*args)

  def run():
    runner.prefill_fits = (lambda rows, longest: rows == 1) if one_by_one else fits
    runner.prefill = counted
    calls.append(0)  # this burst's prefill programs
    try:
      engine.flush_cache()  # no prefix hits: every burst prefills every prompt token
      engine.pause()
      greedy = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
      rng = np.random.RandomState(0)
      handles = [
        engine.submit(GenerateRequest(f"r{i}", tuple(int(t) for t in rng.randint(0, 4000, 6 + i % 8)), greedy))
        for i in range(requests)
      ]
      engine.resume()
      for h in handles:
        engine.wait(h, timeout=600)
    finally:
      runner.prefill_fits, runner.prefill = fits, prefill

  return run


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--requests", type=int, default=16)
  ap.add_argument("--new", type=int, default=4)
  args = ap.parse_args()
  model = K2Model(presets.get("tiny", max_position_embeddings=MAX_LEN), rngs=nnx.Rngs(0))
  cfg = EngineConfig(max_slots=SLOTS, max_seq_len=MAX_LEN, sharding="tp_ep", mesh="expert:4,tensor:2")
  engine = InferenceEngine(model, cfg)
  try:
    for new in (args.new, 1):
      calls = {"batched": [], "one_by_one": []}
      fns = {m: _burst(engine, args.requests, new, m == "one_by_one", calls[m]) for m in calls}
      for fn in fns.values():
        fn()  # compiles (not timed)
      cpu = {}
      times = time_interleaved(fns, args.reps, cpu=cpu, min_rep_s=0.0)
      for m in fns:
        print(
          f"new={new} {m}_ms={median_ms(times[m])} cpu_ms={median_ms(cpu[m])} "
          f"prefill_programs_per_burst={calls[m][-1]}",
          flush=True,
        )
      print(
        f"new={new} " + fmt("batched_over_one_by_one", ratio(times, "batched", "one_by_one"), args.reps), flush=True
      )
      print(
        f"new={new} " + fmt("batched_over_one_by_one_cpu", ratio(cpu, "batched", "one_by_one"), args.reps), flush=True
      )
    print(load_average(), flush=True)
  finally:
    engine.close()


if __name__ == "__main__":
  main()
