"""Stages (b) agents and (c) tasks (K2 §3.1.1): agents = a synthesised system prompt plus a tool subset
drawn from the repository; per agent, tasks from simple to complex, each with a rubric (success
criteria, expected tool use, evaluation checkpoints), a user persona for the simulated user, and for a
task whose answer is a program, optionally code `tests` (`verifiable.py`).

The tool subset is drawn deterministically from (seed, agent index): mostly one domain (so the tools
make sense together) plus a few from elsewhere. LLM outputs must be JSON with the fields checked
below; anything else is counted and dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random

from k2jax.synth import verifiable
from k2jax.synth.llm import LLM

log = logging.getLogger(__name__)

AGENT_PROMPT = """ROLE: agent_designer
You write the system prompt of an AI agent that uses the tools listed below. Give it a role,
expertise and a behaviour pattern (e.g. careful, asks before irreversible actions). Answer with JSON
{"name": short agent name, "system_prompt": the system prompt (at least two sentences)}."""

TASK_PROMPT = """ROLE: task_generator
You write tasks a user would bring to the agent below, from simple to complex, that need its tools.
Answer with a JSON array of {n} objects {{"instruction": what the user wants, "difficulty": "simple" |
"medium" | "complex", "user_persona": who the user is and how they talk, "rubric": {{"success_criteria":
[...], "expected_tools": [tool names], "checkpoints": [...]}}}}. Only for a task whose answer is a Python
program, add "tests": {{"test_list": [assert statements calling the program's function]}}."""


def pick_tools(tools: list[dict], index: int, seed: int, k: int, cross_domain: int) -> list[dict]:
  """k tools mostly from one domain, `cross_domain` from others; names unique."""
  rng = random.Random(hashlib.sha256(f"{seed}:agent:{index}".encode()).digest())
  domains = sorted({t["domain"] for t in tools})
  home = rng.choice(domains)
  local = [t for t in tools if t["domain"] == home]
  other = [t for t in tools if t["domain"] != home]
  picked = rng.sample(local, min(k, len(local))) + rng.sample(other, min(cross_domain, len(other)))
  return list({t["tool"]["name"]: t for t in picked}.values())


def make_agent(llm: LLM, tools: list[dict]) -> dict:
  listing = "\n".join(f"- {t['tool']['name']}: {t['tool'].get('description', '')}" for t in tools)
  value = llm.json(
    [{"role": "system", "content": AGENT_PROMPT}, {"role": "user", "content": f"Tools:\n{listing}"}],
    role="agent_designer",
  )
  prompt = value.get("system_prompt") if isinstance(value, dict) else None
  if not isinstance(prompt, str) or len(prompt.strip()) < 20:
    raise llm.invalid("agent_designer", "expected JSON with a system_prompt of at least 20 characters")
  return {
    "name": str(value.get("name") or "agent")[:80],
    "system_prompt": prompt.strip(),
    "tools": [t["tool"] for t in tools],
  }


def make_tasks(llm: LLM, agent: dict, n: int) -> list[dict]:
  """Up to n valid tasks; invalid entries are counted as invalid outputs and skipped."""
  names = {t["name"] for t in agent["tools"]}
  listing = json.dumps([{"name": t["name"], "description": t.get("description", "")} for t in agent["tools"]])
  value = llm.json(
    [
      {"role": "system", "content": TASK_PROMPT.format(n=n)},
      {"role": "user", "content": f"Agent system prompt:\n{agent['system_prompt']}\n\nTools: {listing}"},
    ],
    role="task_generator",
  )
  if not isinstance(value, list):
    raise llm.invalid("task_generator", "expected a JSON array of tasks")
  tasks, why_not = [], ""
  for i, raw in enumerate(value[:n]):
    task = _check_task(raw, names)
    if task is None:
      why_not = f"{agent['id']}: proposed task {i}: no instruction/rubric, or unknown tools"
      llm.invalid("task_generator", why_not)
      continue
    try:
      verifiable.check_tests(raw, f"{agent['id']}: proposed task {i}")
    except ValueError as e:  # a task that claims code tests the verifier cannot read is dropped, not kept untested
      why_not = str(e)
      log.warning("dropped: %s", why_not)
      llm.invalid("task_generator", why_not)
      continue
    if raw.get("tests") is not None:
      task["tests"] = raw["tests"]
    tasks.append(task)
  if not tasks:
    raise llm.invalid("task_generator", f"none of {len(value)} proposed tasks is valid (last: {why_not})")
  return tasks


def _check_task(raw, tool_names: set[str]) -> dict | None:
  if not isinstance(raw, dict) or not isinstance(raw.get("instruction"), str) or not raw["instruction"].strip():
    return None
  rubric = raw.get("rubric")
  if not isinstance(rubric, dict):
    return None
  criteria = rubric.get("success_criteria")
  expected = rubric.get("expected_tools", [])
  checkpoints = rubric.get("checkpoints", [])
  if (
    not isinstance(criteria, list)
    or not criteria
    or not all(isinstance(c, str) for c in criteria)
    or not isinstance(expected, list)
    or not set(map(str, expected)) <= tool_names
    or not isinstance(checkpoints, list)
  ):
    return None
  persona = raw.get("user_persona")
  return {
    "instruction": raw["instruction"].strip(),
    "difficulty": str(raw.get("difficulty", "medium")),
    "user_persona": persona.strip() if isinstance(persona, str) and persona.strip() else None,
    "rubric": {
      "success_criteria": criteria,
      "expected_tools": [str(e) for e in expected],
      "checkpoints": [str(c) for c in checkpoints],
    },
  }
