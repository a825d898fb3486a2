"""Cost of the sandbox's kernel isolation: seconds per graded program, isolated vs rlimits-only.

  python bench/sandbox.py [--reps=7] [--tests=10]

Baseline = the same run with isolation off (`unsafe_no_isolation`'s path: rlimits and a uid only),
measured in the same process, interleaved with the isolated runs: `isolated_over_unsafe` = median
isolated seconds / median unsafe seconds (min-max spread printed beside each median).
"""

import os
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from k2jax.sandbox import runner  # noqa: E402
from k2jax.sandbox.code import CodeRewardConfig, run_tests  # noqa: E402

_REPS = flags.DEFINE_integer("reps", 7, "Interleaved repetitions of each mode.")
_TESTS = flags.DEFINE_integer("tests", 10, "Unit tests per program.")

SOLUTION = "def add(a, b):\n    return a + b\n"


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
  _once(tests, True)  # warm: the one-off isolation probe and interpreter lookup
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
