"""Code reward: the response's last fenced program against the prompt's tests in the sandbox.

`prompt.data['tests']` is either a list of top-level-assert tests (`k2jax.sandbox.code.run_tests`: expected
values computed here, the program's values from the sandbox) or a dataset row in its own field names, graded by
`k2jax.sandbox.verify`: APPS/TACO `input_output`, LiveCodeBench `public_test_cases`/`private_test_cases` +
`metadata`, CodeContests `public_tests`/..., HumanEval `test` + `entry_point` (+ `prompt`), MBPP `test_list` +
`test_setup_code`, optionally a `checker`. A sandbox that could not start gives a NaN reward (the batch masks
it, `info['infra_error']` says why), never a 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from k2jax.grading.base import Completion, Prompt, RewardResult
from k2jax.sandbox.code import CodeRewardConfig, extract_code, run_tests
from k2jax.sandbox.verify import verify


def code_reward(prompt: Prompt, completion: Completion, config: CodeRewardConfig = CodeRewardConfig()) -> RewardResult:
  """Pass rate of `prompt.data['tests']` on the code in the completion."""
  if "tests" not in prompt.data:
    raise KeyError(f"code_reward: prompt {prompt.prompt_id} has no data['tests']")
  tests = prompt.data["tests"]
  code = extract_code(completion.text)
  if isinstance(tests, Mapping):
    try:
      graded = verify(code, tests, config)
    except ValueError as e:
      raise ValueError(f"code_reward: prompt {prompt.prompt_id}: data['tests']: {e}") from e
  else:
    graded = run_tests(code, tests, config)
  return RewardResult(**dataclasses.asdict(graded))
