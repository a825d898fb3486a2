"""The Gym-like environment interface for multi-turn agentic RL (K2 §3.3.4: "a unified Gym-inspired
environment interface"), and `ToolEnvironment`, the common base of tool-using environments.

Observations and actions are JSON objects so the same environment runs in-process or behind HTTP:
- `reset(task) -> observation`: `{"messages": [...OpenAI messages...], "tools": [...OpenAI tools...]}`.
- `step(action) -> StepResult`: the action is the assistant message just generated
  (`{"role": "assistant", "content", "tool_calls"?, "tool_call_error"?}`, as
  `k2jax.data.chat.parse_assistant` returns it); the observation holds the messages that follow it
  (tool results, or the next user turn) and no tools. The reward comes with `done=True`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Mapping

from k2jax.agentic.calls import ToolError, parse_openai_calls
from k2jax.agentic.guards import Guard, Net
from k2jax.agentic.tools import ToolRegistry

# A tool implementation inside an environment: (arguments, network handle, episode state) -> result.
EnvToolFn = Callable[[Mapping[str, Any], Net, dict], Any]


@dataclasses.dataclass(frozen=True)
class StepResult:
  observation: dict
  reward: float
  done: bool
  info: dict

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


class Environment(abc.ABC):
  """One episode at a time; create one instance per concurrent episode."""

  @abc.abstractmethod
  def reset(self, task: Mapping[str, Any]) -> dict:
    """Starts an episode of `task`; returns the first observation (messages and tools)."""

  @abc.abstractmethod
  def step(self, action: Mapping[str, Any]) -> StepResult:
    """Applies the agent's assistant message; returns what follows it."""

  def close(self) -> None:
    """Frees the episode's resources."""


class ToolEnvironment(Environment):
  """Runs the agent's tool calls through the registry's validation and the guard.

  A turn with calls gets one tool-result message per call (valid calls first, then errors); a turn
  without calls ends the episode unless the task has scripted user follow-ups left, then
  `score(task, state, final_message)` gives the reward. `max_turns` assistant turns end it too.
  Subclasses give the tools (`registry`, `impls`) and `initial_state` / `score`.
  """

  def __init__(self, registry: ToolRegistry, impls: Mapping[str, EnvToolFn], guard: Guard, max_turns: int = 8):
    missing = [n for n in registry.names if n not in impls]
    if missing:
      raise ValueError(f"{type(self).__name__}: tools without an implementation: {missing}")
    self.registry, self.impls, self.guard, self.max_turns = registry, dict(impls), guard, max_turns
    self.task: Mapping[str, Any] = {}
    self.state: dict = {}
    self.turns = 0
    self._followups: list[str] = []

  def initial_state(self, task: Mapping[str, Any]) -> dict:
    return {}

  @abc.abstractmethod
  def score(self, task: Mapping[str, Any], state: dict, final: Mapping[str, Any]) -> tuple[float, dict]:
    """(reward, details) at the end of an episode."""

  def reset(self, task: Mapping[str, Any]) -> dict:
    if not isinstance(task, Mapping) or not isinstance(task.get("instruction"), str):
      raise ValueError(f"{type(self).__name__}: task needs a string 'instruction', got {task!r:.200}")
    self.task, self.state, self.turns = task, self.initial_state(task), 0
    self._followups = [str(f) for f in task.get("followups", [])]
    names = task.get("tools") or self.registry.names
    messages = ([{"role": "system", "content": task["system"]}] if task.get("system") else []) + [
      {"role": "user", "content": task["instruction"]}
    ]
    return {"messages": messages, "tools": self.registry.openai_tools(names)}

  def step(self, action: Mapping[str, Any]) -> StepResult:
    self.turns += 1
    results = self._run_calls(action)
    out_of_turns = self.turns >= int(self.task.get("max_turns", self.max_turns))
    if results and not out_of_turns:
      return StepResult({"messages": results}, 0.0, False, {"turn": self.turns})
    if not results and self._followups and not out_of_turns:
      return StepResult(
        {"messages": [{"role": "user", "content": self._followups.pop(0)}]}, 0.0, False, {"turn": self.turns}
      )
    reward, details = self.score(self.task, self.state, action)
    return StepResult(
      {"messages": results},
      float(reward),
      True,
      {"turn": self.turns, "out_of_turns": out_of_turns and bool(results), **details},
    )

  def _run_calls(self, action: Mapping[str, Any]) -> list[dict]:
    calls, errors = parse_openai_calls(action.get("tool_calls") or [], self.registry)
    if action.get("tool_call_error"):
      errors.append(ToolError("malformed_call", str(action["tool_call_error"])))
    messages = []
    for call in calls:
      result = self.guard.run(
        self.registry[call.name], call, lambda a, net, c=call: self.impls[c.name](a, net, self.state)
      )
      content = result.content() if isinstance(result, ToolError) else _as_text(result)
      messages.append({"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": content})
    for err in errors:
      messages.append({"role": "tool", "tool_call_id": err.call_id, "content": err.content()})
    return messages


def _as_text(result: Any) -> str:
  import json

  return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, sort_keys=True)
