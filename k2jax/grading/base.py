"""The reward contract: plain functions returning a `RewardResult` (value, human-readable reason, details)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class RewardResult:
  reward: float
  reason: str
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One RL prompt: token ids for the engine, the task (selects budget and reward), task data (answer, tests)."""

  prompt_id: str
  task: str
  input_ids: tuple[int, ...]
  text: str = ""
  data: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Completion:
  """A finished response handed to reward functions."""

  output_ids: tuple[int, ...]
  text: str
  finish_reason: str  # "stop" or "length"
  truncated: bool  # hit the task's total token budget
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # episodes: env_reward, end, env details


# A group reward scores the K completions of one prompt together (needed by pairwise judges).
GroupRewardFn = Callable[[Prompt, Sequence[Completion]], Sequence[RewardResult]]


def per_sample(fn: Callable[[Prompt, Completion], RewardResult]) -> GroupRewardFn:
  """Lifts a per-completion reward to the group signature the rollout manager calls."""

  def group_fn(prompt: Prompt, completions: Sequence[Completion]) -> list[RewardResult]:
    return [fn(prompt, c) for c in completions]

  return group_fn
