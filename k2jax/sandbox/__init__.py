"""Running untrusted programs (model-written code) in an isolated process, and grading them against tests.

`k2jax.sandbox.verify.verify` grades a program against a dataset row in its published test format
(APPS/TACO, LiveCodeBench, CodeContests, HumanEval, MBPP, KodCode). Lower than `rl` and `agentic`: rewards
(`k2jax.grading`) and the code environment (`k2jax.agentic`) both use it.
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

__all__ = [
  "CodeRewardConfig",
  "Graded",
  "SandboxConfig",
  "SandboxResult",
  "SandboxUnavailable",
  "cgroup_error",
  "extract_code",
  "isolation_error",
  "run_python",
  "run_tests",
  "split_test",
]
