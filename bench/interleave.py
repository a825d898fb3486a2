"""Interleaved timing for bench/: A B A B ... repetitions, ratios as median with min-max spread.

Timing A's reps, then B's, lets a neighbour's load land on one side only; interleaving exposes both
sides to the same load, and the per-rep ratio A_i / B_i cancels most of it. Single-device figures
come from `one_device_subprocess` (a fresh process with one CPU device), never from a process whose
8 fake devices share the cores.
"""

import math
import os
import statistics
import subprocess
import sys
import time


def time_interleaved(
  fns: dict, reps: int, cpu: dict | None = None, min_rep_s: float = 0.05, before: dict | None = None
) -> dict[str, list[float]]:
  """Seconds per call of each blocking fn over `reps` rounds in dict order, a round timing each fn over
  enough back-to-back calls to last about `min_rep_s` (counted once, from one untimed call each, as
  `timeit`'s autorange does): a 2 ms call timed alone swings with the scheduler's tick and the other
  thread's wake-ups, and its ratio with it.

  If `cpu` is a dict, it receives the same for this process's CPU seconds (all threads, user + system):
  on a machine shared with other jobs, a call's CPU time barely moves with their load while its wall
  time can double, so CPU-time ratios (`<name>_cpu=`) are the figures to compare under load.

  `before[name]()`, when given, runs before every call of fns[name], outside the timing (setup such as
  syncing the disk or deleting the previous call's output)."""
  calls = {}
  before = before or {}
  for name, fn in fns.items():
    if name in before:
      before[name]()
    t = time.perf_counter()
    fn()
    calls[name] = max(1, math.ceil(min_rep_s / max(time.perf_counter() - t, 1e-9)))
  times = {name: [] for name in fns}
  if cpu is not None:
    cpu.update({name: [] for name in fns})
  for _ in range(reps):
    for name, fn in fns.items():
      wall = cpu_s = 0.0
      for chunk in [1] * calls[name] if name in before else [calls[name]]:  # with a setup: one timing per call
        if name in before:
          before[name]()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(chunk):
          fn()
        wall, cpu_s = wall + time.perf_counter() - t, cpu_s + time.process_time() - c
      times[name].append(wall / calls[name])
      if cpu is not None:
        cpu[name].append(cpu_s / calls[name])
  return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
  """(median, min, max) over reps of times[a][i] / times[b][i]."""
  r = [x / y for x, y in zip(times[a], times[b])]
  return statistics.median(r), min(r), max(r)


def fmt(name: str, r: tuple[float, float, float], reps: int) -> str:
  """`name=<median> name_spread=[min,max] reps=<n>`: one parseable line."""
  return f"{name}={r[0]:.3f} {name}_spread=[{r[1]:.3f},{r[2]:.3f}] reps={reps}"


def median_ms(times: list[float]) -> str:
  return f"{1e3 * statistics.median(times):.1f}[{1e3 * min(times):.1f},{1e3 * max(times):.1f}]"


def load_average() -> str:
  """The 1-minute load average (`load1=<x>/<cores>`), to print beside timings from a shared machine."""
  return f"load1={os.getloadavg()[0]:.1f}/{os.cpu_count()}"


def one_device_xla_flags(flags: str | None = None) -> str:
  """`flags` (default: this process's XLA_FLAGS) with one host-platform CPU device in place of any device
  count: the caller's other XLA flags (its optimisation level, its emitters) reach the child as they are."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join([*kept, "--xla_force_host_platform_device_count=1"])


def one_device_subprocess(script: str, *args: str) -> list[str]:
  """Run `python script *args` with one CPU device (`one_device_xla_flags`); echo and return its stdout lines."""
  env = dict(os.environ, XLA_FLAGS=one_device_xla_flags())
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  p = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, check=False)
  if p.returncode:
    raise RuntimeError(f"{script} {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
  lines = p.stdout.splitlines()
  for line in lines:
    print(line, flush=True)
  return lines
