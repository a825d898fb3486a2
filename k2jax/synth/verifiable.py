"""Synthesised tasks with code tests: graded by the code verifier as well as by the judge.

A task may carry `tests`: a dataset row in any format `k2jax.sandbox.formats.parse_row` reads (APPS/TACO
`input_output`, LiveCodeBench `public_test_cases`, CodeContests `public_tests`, HumanEval `test` + `entry_point`,
MBPP `test_list`, KodCode's pytest `test`, optionally a `checker`). It is checked when the task is made (a
generated task with malformed tests is dropped and counted) and when tasks.jsonl is read by the trajectories stage
(a ValueError naming the file, the task and the field). Neither the agent, the simulated user nor the judge sees it.

In the sft stage, the program in the agent's final answer (its last assistant message; the last fenced Python
block, `k2jax.sandbox.code.extract_code`, the code reward's rule) is graded by `k2jax.sandbox.verify.verify`
before the judge is asked: below `SynthConfig.code_min_score` the trajectory is rejected
(`verifier: 0.50 (1/2 tests passed; test 1: ...)`); a kept record carries `verifier_score` and
`verifier_reason` next to the judge's. A sandbox that could not start is no verdict on the
trajectory: `VerifierUnavailable` leaves the unit undone (`errors` in stats.json) and a rerun grades it again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from k2jax.sandbox.code import CodeRewardConfig, extract_code
from k2jax.sandbox.formats import parse_row
from k2jax.sandbox.verify import is_infra_error, verify
from k2jax.synth.llm import InvalidOutput


class VerifierUnavailable(RuntimeError):
  """The sandbox could not start: no verdict on the trajectory, its unit is retried on a rerun."""


def check_tests(task: Mapping[str, Any], where: str) -> None:
  """ValueError naming `where` and the field when the task's `tests` is not a row the verifier reads."""
  if task.get("tests") is None:
    return
  try:
    parse_row(task["tests"])
  except ValueError as e:
    raise ValueError(f"{where}: field 'tests': {e}") from None


def final_answer(messages: Sequence[Mapping[str, Any]]) -> str:
  """The content of the last assistant message ('' when the agent never answered)."""
  for m in reversed(messages):
    if m.get("role") == "assistant":
      return m.get("content") or ""
  return ""


def grade(trajectory: Mapping[str, Any], min_score: float) -> dict:
  """The verifier's metadata for the SFT record when the final answer's program scores >= `min_score` on the
  task's tests; InvalidOutput("verifier") below it; VerifierUnavailable when the sandbox could not start."""
  graded = verify(extract_code(final_answer(trajectory["messages"])), trajectory["task"]["tests"], CodeRewardConfig())
  if is_infra_error(graded) or math.isnan(graded.reward):
    raise VerifierUnavailable(graded.reason)
  if graded.reward < min_score:
    raise InvalidOutput("verifier", f"{graded.reward:.2f} ({graded.reason})")
  return {"verifier_score": graded.reward, "verifier_reason": graded.reason[:500]}
