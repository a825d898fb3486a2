"""The one multi-turn tool loop: an agent acts, the environment answers, until the environment ends the
episode, the agent cannot go on, or `max_turns` assistant turns have run.

Both users of agents run it: RL rollouts (`agentic.rollout.TokenAgent`: token-in/token-out through an
`Engine`, the environment an `agentic.envs` environment, local or behind HTTP) and agentic data synthesis
(`k2jax.synth.trajectories`: a chat-level agent through an OpenAI-style endpoint, the environment an LLM
world simulator with a simulated user). What differs is only how an agent turns its history into the
next assistant message and how it records what the environment said.

Agent protocol:
  start(observation)   the first observation: {"messages", "tools"}
  act(turn) -> dict     the next assistant message (`{"role": "assistant", "content", "tool_calls"?,
                        "tool_call_error"?}`); raises `StopEpisode(end, info)` when it cannot produce one
                        (engine abort or error, token budget spent)
  observe(messages)     what follows its message (tool results, the next user turn); may be empty
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol

from k2jax.agentic.envs.base import Environment
from k2jax.transport import ServiceError

ENDS = ("env_done", "max_turns", "budget", "abort", "env_error", "engine_error")


class Agent(Protocol):
  def start(self, observation: Mapping[str, Any]) -> None: ...

  def act(self, turn: int) -> dict: ...

  def observe(self, messages: list[dict]) -> None: ...


class StopEpisode(Exception):
  """Raised by `Agent.act` to end the episode without an action (`end` is one of ENDS)."""

  def __init__(self, end: str, info: Mapping[str, Any] | None = None):
    if end not in ENDS:
      raise ValueError(f"StopEpisode end {end!r} not in {ENDS}")
    super().__init__(end)
    self.end, self.info = end, dict(info or {})


@dataclasses.dataclass(frozen=True)
class EpisodeEnd:
  end: str  # one of ENDS
  reward: float  # the environment's, with env_done; else 0
  turns: int  # assistant turns the environment saw
  info: dict


def run_tool_loop(agent: Agent, env: Environment, task: Mapping[str, Any], max_turns: int) -> EpisodeEnd:
  """Runs one episode of `task`. Environment service failures end it with `env_error` (a pool restarts
  the service); an invalid task (`ValueError` from reset) propagates: it is the caller's data."""
  try:
    observation = env.reset(task)
  except ServiceError as e:
    return EpisodeEnd("env_error", 0.0, 0, {"error": str(e)[:500]})
  agent.start(observation)
  for turn in range(max_turns):
    try:
      action = agent.act(turn)
    except StopEpisode as stop:
      return EpisodeEnd(stop.end, 0.0, turn, stop.info)
    step = env.step(action)
    if "env_error" in step.info:
      return EpisodeEnd("env_error", 0.0, turn + 1, {"error": step.info["env_error"]})
    if step.done:
      return EpisodeEnd("env_done", float(step.reward), turn + 1, dict(step.info))
    agent.observe(list(step.observation.get("messages") or []))
  return EpisodeEnd("max_turns", 0.0, max_turns, {})
