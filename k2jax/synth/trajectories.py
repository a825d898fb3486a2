"""Stage (d): multi-turn trajectories (K2 §3.1.1), run by the same tool loop as RL rollouts
(`k2jax.agentic.loop.run_tool_loop`: `ChatAgent` is the agent, `SimulatedWorld` the environment).
Three LLM roles talk:
- the simulated user, with the task's persona, opens the dialogue and answers the agent; it ends the
  dialogue by writing [DONE] once the task is settled;
- the agent: the agent's system prompt and tools, via the endpoint's OpenAI `tools` (tool calls come
  back as `message.tool_calls`, validated against the tool schemas like in RL: bad calls get a
  structured error result, as the agent would see in deployment);
- the tool simulator, "functionally equivalent to a world model": it executes a call against the
  episode's world state (a JSON object it returns updated, so effects persist across calls) and
  answers with the result. The outcome mode (success, partial failure, edge case) is drawn by the
  pipeline's seeded RNG, not left to the model, so the injected stochasticity is controlled and recorded.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, Mapping

from k2jax.agentic.calls import parse_openai_calls
from k2jax.agentic.envs.base import Environment, StepResult
from k2jax.agentic.loop import run_tool_loop
from k2jax.agentic.tools import ToolRegistry
from k2jax.synth.llm import LLM

USER_PROMPT = """ROLE: user_simulator
You play a user talking to an AI assistant. Persona: {persona}
Your goal: {instruction}
Write only your next message to the assistant, in the persona's style. When your goal is reached or
the assistant cannot help further, write [DONE] instead."""

TOOL_SIM_PROMPT = """ROLE: tool_simulator
You simulate the tool below as a real system would run it, against the current world state.
Outcome to produce: {mode} ({mode_help}).
Answer with JSON {{"result": what the tool returns, "state": the full world state after the call}}."""

MODES = {
  "success": "the call works as specified",
  "failure": "the call fails with a realistic error (timeout, permission, not found); state unchanged",
  "edge_case": "an unusual but valid outcome: empty result, partial data, a limit reached",
}


def draw_mode(seed: int, unit: str, call_index: int, p_failure: float, p_edge: float) -> str:
  r = random.Random(hashlib.sha256(f"{seed}:{unit}:{call_index}".encode()).digest()).random()
  return "failure" if r < p_failure else "edge_case" if r < p_failure + p_edge else "success"


class ChatAgent:
  """The synthesis side of `run_tool_loop`: an agent answering through the endpoint's chat API, with the
  tools as OpenAI `tools` (calls come back as `message.tool_calls`)."""

  def __init__(self, llm: LLM, system_prompt: str, max_tokens: int):
    self.llm, self.max_tokens = llm, max_tokens
    self.messages: list[dict] = [{"role": "system", "content": system_prompt}]
    self.tools: list[dict] = []

  def start(self, observation: Mapping[str, Any]) -> None:
    self.messages += list(observation["messages"])
    self.tools = list(observation.get("tools") or [])

  def act(self, turn: int) -> dict:
    reply = self.llm.chat(self.messages, tools=self.tools, max_tokens=self.max_tokens, role="agent")
    raw_calls = reply.get("tool_calls")
    message = {"role": "assistant", "content": reply.get("content") or ""}
    if raw_calls:
      message["tool_calls"] = raw_calls
    self.messages.append(message)
    return message

  def observe(self, messages: list[dict]) -> None:
    self.messages += messages


class SimulatedWorld(Environment):
  """The synthesis environment: tool calls are executed by the LLM tool simulator against a JSON world
  state; a turn without calls goes to the simulated user, whose [DONE] ends the episode (reward 0: the
  judge grades synthesis trajectories afterwards)."""

  def __init__(self, llm: LLM, agent: dict, *, seed: int, p_failure: float, p_edge: float, default_persona: str):
    self.llm, self.seed, self.p_failure, self.p_edge = llm, seed, p_failure, p_edge
    self.registry = ToolRegistry.from_dicts(agent["tools"])
    self.default_persona = default_persona
    self.state: dict = {}
    self.modes: list[str] = []
    self.history: list[dict] = []  # user/assistant turns, for the user simulator

  def reset(self, task: Mapping[str, Any]) -> dict:
    self.task = task
    persona = task.get("user_persona") or self.default_persona
    self.user_system = USER_PROMPT.format(persona=persona, instruction=task["instruction"])
    first = {"role": "user", "content": _user_turn(self.llm, self.user_system, [])}
    self.history = [first]
    return {"messages": [first], "tools": self.registry.openai_tools()}

  def step(self, action: Mapping[str, Any]) -> StepResult:
    self.history.append(dict(action))
    calls, errors = parse_openai_calls(action.get("tool_calls") or [], self.registry)
    if calls or errors:
      results = []
      for call in calls:
        mode = draw_mode(self.seed, self.task["id"], len(self.modes), self.p_failure, self.p_edge)
        self.modes.append(mode)
        text, self.state = _simulate(self.llm, self.registry[call.name].to_mcp(), call.arguments, self.state, mode)
        results.append({"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": text})
      results += [{"role": "tool", "tool_call_id": e.call_id, "content": e.content()} for e in errors]
      return StepResult({"messages": results}, 0.0, False, {})
    if not (action.get("content") or "").strip():
      raise self.llm.invalid("agent", "empty assistant turn without tool calls")
    user = _user_turn(self.llm, self.user_system, self.history)
    if "[DONE]" in user:
      return StepResult({"messages": []}, 0.0, True, {"user_done": True})
    message = {"role": "user", "content": user}
    self.history.append(message)
    return StepResult({"messages": [message]}, 0.0, False, {})


def make_trajectory(
  llm: LLM,
  task: dict,
  agent: dict,
  *,
  seed: int,
  max_turns: int,
  p_failure: float,
  p_edge: float,
  agent_max_tokens: int,
  default_persona: str,
) -> dict:
  """One synthesis dialogue through the agentic tool loop (`k2jax.agentic.loop.run_tool_loop`)."""
  world = SimulatedWorld(llm, agent, seed=seed, p_failure=p_failure, p_edge=p_edge, default_persona=default_persona)
  chat = ChatAgent(llm, agent["system_prompt"], agent_max_tokens)
  result = run_tool_loop(chat, world, task, max_turns)
  return {
    "agent_id": agent["id"],
    "task": task,
    "messages": chat.messages,
    "tools": chat.tools,
    "world_state": world.state,
    "injected_modes": world.modes,
    "end": "user_done" if result.end == "env_done" else result.end,
  }


def _user_turn(llm: LLM, system: str, history: list[dict]) -> str:
  """The simulated user's next message; the dialogue is shown with the roles swapped."""
  shown = [
    {"role": "user" if m["role"] == "assistant" else "assistant", "content": m.get("content") or ""}
    for m in history
    if m["role"] in ("user", "assistant") and (m.get("content") or "").strip()
  ]
  if not shown:
    shown = [{"role": "user", "content": "(Start the conversation.)"}]
  return llm.text([{"role": "system", "content": system}, *shown], role="user_simulator")


def _simulate(llm: LLM, tool: dict, arguments: dict, state: dict, mode: str) -> tuple[str, dict]:
  value = llm.json(
    [
      {"role": "system", "content": TOOL_SIM_PROMPT.format(mode=mode, mode_help=MODES[mode])},
      {
        "role": "user",
        "content": json.dumps({"tool": tool, "arguments": arguments, "world_state": state}, ensure_ascii=False),
      },
    ],
    role="tool_simulator",
  )
  if not isinstance(value, dict) or "result" not in value or not isinstance(value.get("state", {}), dict):
    raise llm.invalid("tool_simulator", "expected JSON {result, state}")
  result = value["result"]
  text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
  return text, value.get("state", state) if mode != "failure" else state
