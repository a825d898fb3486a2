"""Software-engineering RL tasks: SWE-bench-convention instances built offline from package sources
(AST-mutation bugs, combinations, version diffs), a bounded workspace pool, and a grader that runs a patch in a
fresh sandbox and closes the known reward hacks. The environment is `k2jax.agentic.envs.swe`. The grader,
`k2jax.swe.grade` (`grade`, `grade_all`, `GradeConfig`), is not imported here: it is also the CLI
`python -m k2jax.swe.grade`, which runpy must load first."""

from k2jax.swe.build import BuildConfig, build_repo, build_version_diff
from k2jax.swe.instances import (
  Instance,
  InstanceReport,
  Prediction,
  read_instances,
  read_predictions,
  summary,
  write_instances,
  write_predictions,
)
from k2jax.swe.mutate import Mutation, mutations
from k2jax.swe.taskset import build_task_set
from k2jax.swe.testrun import TestRun, run_tests
from k2jax.swe.workspace import PoolConfig, Workspace, WorkspacePool

__all__ = [
  "BuildConfig",
  "Instance",
  "InstanceReport",
  "Mutation",
  "PoolConfig",
  "Prediction",
  "TestRun",
  "Workspace",
  "WorkspacePool",
  "build_repo",
  "build_task_set",
  "build_version_diff",
  "mutations",
  "read_instances",
  "read_predictions",
  "run_tests",
  "summary",
  "write_instances",
  "write_predictions",
]
