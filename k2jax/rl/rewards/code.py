"""Code reward: the response's last fenced program against the prompt's unit tests in the sandbox."""

from __future__ import annotations

import dataclasses

from k2jax.rl.rewards.base import Completion, Prompt, RewardResult
from k2jax.sandbox.code import CodeRewardConfig, extract_code, run_tests


def code_reward(prompt: Prompt, completion: Completion, config: CodeRewardConfig = CodeRewardConfig()) -> RewardResult:
  """Pass rate of `prompt.data['tests']` on the code in the completion."""
  if "tests" not in prompt.data:
    raise KeyError(f"code_reward: prompt {prompt.prompt_id} has no data['tests']")
  graded = run_tests(extract_code(completion.text), prompt.data["tests"], config)
  return RewardResult(**dataclasses.asdict(graded))
