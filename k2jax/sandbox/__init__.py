"""Running untrusted programs (model-written code) in an isolated process, and grading them against tests.

`verify` grades a program against a dataset row in its published test format (APPS/TACO, LiveCodeBench,
CodeContests, HumanEval, MBPP, KodCode; verify.py). Lower than `rl` and `agentic`: rewards (`k2jax.rl.rewards`)
and the code environment (`k2jax.agentic`) both use it.
"""

from k2jax.sandbox.code import CodeRewardConfig, Graded, extract_code, run_tests, split_test
from k2jax.sandbox.runner import (
  SandboxConfig,
  SandboxResult,
  SandboxUnavailable,
  cgroup_error,
  isolation_error,
  run_python,
)
from k2jax.sandbox.verify import Problem, parse_row, verify, verify_batch

__all__ = [
  "CodeRewardConfig",
  "Graded",
  "Problem",
  "SandboxConfig",
  "SandboxResult",
  "SandboxUnavailable",
  "cgroup_error",
  "extract_code",
  "isolation_error",
  "parse_row",
  "run_python",
  "run_tests",
  "split_test",
  "verify",
  "verify_batch",
]
