"""A code environment on top of the RL sandbox (`k2jax.sandbox.runner`).

Tools: `run_python(code, stdin?)` runs a program in the sandbox and returns its exit status, stdout and
stderr (read-only for the world: every run gets a fresh temp dir, no network, rlimits); `submit(code)`
grades the solution against the task's unit tests and ends the episode. A final answer without a
submit is graded on its last fenced code block. Reward = test pass rate (K2 §3.1.1 real execution).

Task: `{"id", "instruction", "tests": ["assert f(1) == 2", ...], "max_turns"?}`.
"""

from __future__ import annotations

from typing import Any, Mapping

from k2jax.agentic.guards import Guard, GuardConfig
from k2jax.agentic.tools import Impact, ToolRegistry, ToolSpec
from k2jax.agentic.envs.base import StepResult, ToolEnvironment
from k2jax.sandbox.code import CodeRewardConfig, extract_code, run_tests
from k2jax.sandbox.runner import SandboxConfig, run_python

_CODE = {"type": "string", "minLength": 1, "maxLength": 20000}
TOOLS = (
  ToolSpec(
    "run_python",
    "Run a Python program in a sandbox; returns exit code, stdout and stderr.",
    {
      "type": "object",
      "properties": {"code": _CODE, "stdin": {"type": "string", "maxLength": 20000}},
      "required": ["code"],
      "additionalProperties": False,
    },
    Impact.READ_ONLY,
  ),
  ToolSpec(
    "submit",
    "Submit the final solution; it is graded by hidden unit tests.",
    {"type": "object", "properties": {"code": _CODE}, "required": ["code"], "additionalProperties": False},
    Impact.REVERSIBLE_WRITE,
  ),
)


class CodeEnv(ToolEnvironment):
  def __init__(self, guard: Guard | None = None, sandbox: SandboxConfig = SandboxConfig(), max_turns: int = 6):
    self.sandbox = sandbox
    impls = {"run_python": self._run, "submit": self._submit}
    super().__init__(ToolRegistry(TOOLS), impls, guard or Guard(GuardConfig()), max_turns)

  def reset(self, task: Mapping[str, Any]) -> dict:
    if not task.get("tests"):
      raise ValueError(f"CodeEnv: task {task.get('id')!r} has no 'tests'")
    return super().reset(task)

  def initial_state(self, task) -> dict:
    return {"submitted": None, "runs": 0}

  def step(self, action: Mapping[str, Any]) -> StepResult:
    result = super().step(action)
    if not result.done and self.state["submitted"] is not None:  # a submit ends the episode
      reward, details = self.score(self.task, self.state, action)
      return StepResult(result.observation, reward, True, {**result.info, **details})
    return result

  def score(self, task, state, final) -> tuple[float, dict]:
    code = state["submitted"] if state["submitted"] is not None else extract_code(final.get("content") or "")
    graded = run_tests(code, task["tests"], CodeRewardConfig(self.sandbox))
    return graded.reward, {"reason": graded.reason, "submitted": state["submitted"] is not None}

  def _run(self, args, net, state) -> dict:
    state["runs"] += 1
    r = run_python({"main.py": args["code"]}, "main.py", self.sandbox, stdin=args.get("stdin", ""))
    return {"returncode": r.returncode, "stdout": r.stdout[-2000:], "stderr": r.stderr[-2000:], "reason": r.reason}

  def _submit(self, args, net, state) -> dict:
    state["submitted"] = args["code"]
    return {"submitted": True}
