"""`RemoteEnvironment`: the `Environment` interface over an environment service's HTTP API."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from k2jax.rl.envs.base import Environment, StepResult
from k2jax.transport import RetryPolicy, ServiceError, call_json


@dataclasses.dataclass(frozen=True)
class RemoteEnvConfig:
  url: str  # service root, e.g. http://env-sim-tools:8080
  reset_timeout_s: float = 60.0
  step_timeout_s: float = 60.0  # a step slower than this counts as a failed environment
  # Steps are not idempotent (a retried transfer would run twice), so they are never retried.
  retry: RetryPolicy = RetryPolicy(max_retries=0)


class RemoteEnvironment(Environment):
  def __init__(self, config: RemoteEnvConfig):
    self.config = config
    self._base = config.url.rstrip("/")
    self.episode_id: str | None = None

  def reset(self, task: Mapping[str, Any]) -> dict:
    body = call_json(
      f"{self._base}/reset",
      {"task": dict(task)},
      timeout_s=self.config.reset_timeout_s,
      retry=self.config.retry,
      validate=_reset_answer,
    )
    self.episode_id = body["episode_id"]
    return body["observation"]

  def step(self, action: Mapping[str, Any]) -> StepResult:
    if self.episode_id is None:
      raise RuntimeError(f"{self._base}: step() before reset()")
    body = call_json(
      f"{self._base}/step",
      {"episode_id": self.episode_id, "action": dict(action)},
      timeout_s=self.config.step_timeout_s,
      retry=self.config.retry,
      validate=_step_answer,
    )
    if body.done:
      self.episode_id = None
    return body

  def close(self) -> None:
    if self.episode_id is not None:
      try:
        call_json(
          f"{self._base}/close", {"episode_id": self.episode_id}, timeout_s=10.0, retry=RetryPolicy(max_retries=0)
        )
      except ServiceError:
        pass  # the service drops idle episodes itself
      self.episode_id = None


def _reset_answer(body: Any) -> dict:
  if not isinstance(body.get("episode_id"), str) or not isinstance(body.get("observation"), dict):
    raise ValueError("expected {episode_id, observation}")
  return body


def _step_answer(body: Any) -> StepResult:
  obs, reward, done = body["observation"], body["reward"], body["done"]
  if not isinstance(obs, dict) or not isinstance(reward, (int, float)) or not isinstance(done, bool):
    raise ValueError("expected {observation: object, reward: number, done: bool, info}")
  return StepResult(obs, float(reward), done, dict(body.get("info") or {}))
