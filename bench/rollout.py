"""Rollout scheduling benchmark: synchronous rollouts vs over-sampling + partial rollout.

Run: python bench/rollout.py [--iterations 8] [--latency_ms 0.5]
The fake engine decodes one token per `latency_ms` per request (up to `slots` requests at once); response
lengths follow a clipped log-normal (long tail). Each RL iteration = rollout phase + a simulated train step
(colocated, as in K2 §3.3: the trainer idles while the engine generates). Prints key=value lines; ratios
are partial/sync measured in this run. The first `warmup` iterations are excluded (the partial-rollout
buffer fills up).
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np

from k2jax.engine.fake import FakeEngine, FakeEngineConfig
from k2jax.grading.base import Prompt, RewardResult, per_sample
from k2jax.rl.rollout import RolloutConfig, RolloutManager

PROMPT_LEN = 16


def run(mode: str, args) -> dict[str, float]:
  rng = np.random.default_rng(0)
  lengths = np.clip(rng.lognormal(np.log(args.median_len), args.sigma, size=100_000), 8, args.budget).astype(int)
  engine = FakeEngine(
    FakeEngineConfig(per_token_latency_s=args.latency_ms / 1e3, max_running=args.slots),
    lambda req: lengths[req.sampling.seed] - (len(req.input_ids) - PROMPT_LEN),
  )
  sync = mode == "sync"
  cfg = RolloutConfig(
    group_size=args.group_size,
    target_groups=args.groups,
    launch_groups=args.groups if sync else int(args.groups * args.oversample),
    partial_rollout=not sync,
    max_staleness=args.max_staleness,
    task_budgets=(("default", args.budget),),
    max_concurrency=args.slots * 2,
  )
  prompts = (Prompt(f"p{i}", "default", (i % 50 + 2,) * PROMPT_LEN) for i in itertools.count())
  mgr = RolloutManager(cfg, engine, prompts, per_sample(lambda p, c: RewardResult(1.0, "const")))
  rollout_s = train_s = tokens = 0.0
  t_start = None
  for it in range(args.warmup + args.iterations):
    if it == args.warmup:
      t_start, rollout_s, train_s, tokens, busy0 = time.monotonic(), 0.0, 0.0, 0.0, engine.busy_slot_s
    t0 = time.monotonic()
    batch, _ = mgr.collect(weight_version=it)
    t1 = time.monotonic()
    time.sleep(args.train_ms / 1e3)  # the train step; the engine idles meanwhile
    engine.update_weights(f"/fake/v{it + 1}", it + 1)
    rollout_s += t1 - t0
    train_s += time.monotonic() - t1
    tokens += float(batch.loss_mask_BT.sum())
  mgr.close()
  wall = time.monotonic() - t_start
  return {
    "iter_s": wall / args.iterations,
    "trainer_idle_frac": rollout_s / wall,
    "engine_slot_util": (engine.busy_slot_s - busy0) / (args.slots * rollout_s),
    "train_tokens_per_s": tokens / wall,
  }


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--iterations", type=int, default=8)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--groups", type=int, default=8)
  p.add_argument("--group_size", type=int, default=4)
  p.add_argument("--oversample", type=float, default=2.0)
  p.add_argument("--slots", type=int, default=64)
  p.add_argument("--latency_ms", type=float, default=0.5)
  p.add_argument("--median_len", type=float, default=100)
  p.add_argument("--sigma", type=float, default=1.0)
  p.add_argument("--budget", type=int, default=2000)
  p.add_argument("--train_ms", type=float, default=100)
  p.add_argument("--max_staleness", type=int, default=4)
  args = p.parse_args()
  sync, part = run("sync", args), run("partial", args)
  for name, res in (("sync", sync), ("partial", part)):
    for k, v in res.items():
      print(f"{name}_{k}={v:.4f}")
  print(f"iter_time_ratio={part['iter_s'] / sync['iter_s']:.3f}")
  print(f"trainer_idle_ratio={part['trainer_idle_frac'] / sync['trainer_idle_frac']:.3f}")
  print(f"throughput_ratio={part['train_tokens_per_s'] / sync['train_tokens_per_s']:.3f}")


if __name__ == "__main__":
  main()
