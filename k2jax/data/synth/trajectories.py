"""Stage (d): multi-turn trajectories (K2 §3.1.1). Three LLM roles talk:
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

from k2jax.agentic.calls import parse_openai_calls
from k2jax.agentic.tools import ToolRegistry
from k2jax.data.synth.llm import LLM

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
  registry = ToolRegistry.from_dicts(agent["tools"])
  tools = registry.openai_tools()
  persona = task.get("user_persona") or default_persona
  user_system = USER_PROMPT.format(persona=persona, instruction=task["instruction"])
  messages = [
    {"role": "system", "content": agent["system_prompt"]},
    {"role": "user", "content": _user_turn(llm, user_system, [])},
  ]
  state: dict = {}
  modes, end, calls_made = [], "max_turns", 0
  for _ in range(max_turns):
    reply = llm.chat(messages, tools=tools, max_tokens=agent_max_tokens, role="agent")
    content = reply.get("content") or ""
    calls, errors = parse_openai_calls(reply.get("tool_calls") or [], registry)
    raw_calls = reply.get("tool_calls") if calls or errors else None
    messages.append({"role": "assistant", "content": content, **({"tool_calls": raw_calls} if raw_calls else {})})
    if raw_calls:
      for call in calls:
        mode = draw_mode(seed, task["id"], calls_made, p_failure, p_edge)
        calls_made += 1
        modes.append(mode)
        result, state = _simulate(llm, registry[call.name].to_mcp(), call.arguments, state, mode)
        messages.append({"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": result})
      for err in errors:
        messages.append({"role": "tool", "tool_call_id": err.call_id, "content": err.content()})
      continue
    if not content.strip():
      raise llm.invalid("agent", "empty assistant turn without tool calls")
    user = _user_turn(llm, user_system, messages[1:])
    if "[DONE]" in user:
      end = "user_done"
      break
    messages.append({"role": "user", "content": user})
  return {
    "agent_id": agent["id"],
    "task": task,
    "messages": messages,
    "tools": tools,
    "world_state": state,
    "injected_modes": modes,
    "end": end,
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
