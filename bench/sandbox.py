"""Cost of the sandbox's isolation and of its memory/disk limits: start-to-verdict seconds per graded program.

  python bench/sandbox.py [--reps=5] [--tests=10] [--concurrency=8,64]

1. `sandbox_overhead_ratio`: a batch of N programs graded at once (N threads, each a
   `run_tests` from start to verdict), with the limits (private tmpfs scratch, IPC namespace limits, no
   nested user namespaces, a cgroup where this host gives one) over the same batch without them
   (`SandboxConfig(kernel_limits=False)`: the sandbox as it was before them), per N. Modes interleaved
   A B A B ..., `reps` rounds; the ratio is the median of the per-round ratios, min-max spread beside it.
   `_cpu` figures: CPU seconds of the runs' processes (user + system, children reaped), which a
   neighbour's load on a shared machine barely moves.
2. `isolated_over_unsafe`: one program, isolated vs rlimits only (`unsafe_no_isolation`'s path).
"""

import concurrent.futures
import dataclasses
import os
import resource
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench.interleave import load_average  # noqa: E402
from k2jax.sandbox import runner  # noqa: E402
from k2jax.sandbox.code import CodeRewardConfig, run_tests  # noqa: E402

_REPS = flags.DEFINE_integer("reps", 5, "Interleaved repetitions of each mode.")
_TESTS = flags.DEFINE_integer("tests", 10, "Unit tests per program.")
_CONCURRENCY = flags.DEFINE_list("concurrency", ["8", "64"], "Programs graded at once.")

SOLUTION = "def add(a, b):\n    return a + b\n"


def _children_cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_CHILDREN)
  return r.ru_utime + r.ru_stime


def _batch(tests, config: runner.SandboxConfig, n: int) -> tuple[float, float]:
  """(wall seconds, children CPU seconds) to grade `n` programs at once, start to last verdict."""
  cfg = CodeRewardConfig(config)
  start, cpu = time.perf_counter(), _children_cpu()
  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    graded = list(pool.map(lambda _: run_tests(SOLUTION, tests, cfg), range(n)))
  wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
  for g in graded:
    assert g.reward == 1.0, g
    assert ("scratch_tmpfs" in g.info["layers"]) == config.kernel_limits, g.info["layers"]
  return wall, cpu


def _overhead(tests, reps: int) -> None:
  new = runner.SandboxConfig()
  old = dataclasses.replace(new, kernel_limits=False)
  cgroup = runner.cgroup_error(new)
  print(f"limits: scratch tmpfs, ipc namespace limits, no nested userns; cgroup: {cgroup or 'yes'}; {load_average()}")
  for n in (int(c) for c in _CONCURRENCY.value):
    _batch(tests, new, n)  # warm: page cache, interpreter lookup
    walls = {"old": [], "new": []}
    cpus = {"old": [], "new": []}
    for _ in range(reps):
      for name, cfg in (("old", old), ("new", new)):
        w, c = _batch(tests, cfg, n)
        walls[name].append(w)
        cpus[name].append(c)
    for name in ("old", "new"):
      v, c = walls[name], cpus[name]
      print(
        f"n={n} {name}_s_per_batch={statistics.median(v):.3f} (min {min(v):.3f}, max {max(v):.3f}) "
        f"{name}_cpu_s={statistics.median(c):.3f}"
      )
    for label, t in (("", walls), ("_cpu", cpus)):
      r = [a / b for a, b in zip(t["new"], t["old"])]
      print(
        f"n={n} sandbox_overhead_ratio{label}={statistics.median(r):.3f} spread=[{min(r):.3f},{max(r):.3f}] reps={reps}"
      )


def _once(tests, isolated: bool) -> float:
  config = CodeRewardConfig(runner.SandboxConfig(unsafe_no_isolation=not isolated))
  why = None if isolated else "benchmark baseline: isolation off"
  with mock.patch.object(runner, "isolation_error", lambda config=None: why):
    start = time.perf_counter()
    graded = run_tests(SOLUTION, tests, config)
    elapsed = time.perf_counter() - start
  assert graded.reward == 1.0, graded
  assert ("pidns" in graded.info["layers"]) == isolated, graded.info["layers"]
  return elapsed


def main(argv):
  del argv
  why = runner.isolation_error()
  if why is not None:
    sys.exit(f"bench/sandbox.py: this machine cannot isolate ({why}); nothing to compare")
  tests = [f"assert add({i}, {i}) == {2 * i}" for i in range(_TESTS.value)]
  _overhead(tests, _REPS.value)
  _once(tests, True)
  times = {True: [], False: []}
  for _ in range(_REPS.value):
    for isolated in (False, True):
      times[isolated].append(_once(tests, isolated))
  med = {k: statistics.median(v) for k, v in times.items()}
  for isolated, label in ((False, "unsafe"), (True, "isolated")):
    v = times[isolated]
    print(f"{label}_s_per_program={med[isolated]:.3f} (min {min(v):.3f}, max {max(v):.3f})")
  print(f"isolated_over_unsafe={med[True] / med[False]:.2f}")


if __name__ == "__main__":
  app.run(main)
