"""Synthesised tasks with code tests: the sft stage keeps a trajectory only when the program in the
agent's final answer passes the task's tests in the sandbox (k2jax.synth.verifiable) and the judge passes it;
tasks without tests are judged as before; malformed tests are a clear error naming the field; a sandbox that
cannot start leaves the unit to a rerun. The LLM is the scripted server of test_synth.py, with code tasks."""

import json
import logging

import pytest

from k2jax.llm_client import ChatConfig
from k2jax.sandbox import runner, verify as verify_mod
from k2jax.sandbox.runner import SandboxUnavailable
from k2jax.synth import SynthConfig, run_synth
from tests.agentic import scripted_llm

NOT_ISOLATED = runner.isolation_error()
pytestmark = pytest.mark.skipif(
  NOT_ISOLATED is not None, reason=f"this machine cannot create the sandbox's namespaces: {NOT_ISOLATED}"
)

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
SUM_TESTS = {"input_output": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})}
# The agent answers every program task with ADD: right for the sum, right on case 0 only of the product (2+2 = 2*2).
PRODUCT_TESTS = {"input_output": {"inputs": ["2 2\n", "1 3\n"], "outputs": ["4\n", "3\n"]}}
RUBRIC = {"success_criteria": ["a working program"], "expected_tools": [], "checkpoints": []}
TASKS = [
  {"instruction": "Write a program that prints the sum of two integers.", "rubric": RUBRIC, "tests": SUM_TESTS},
  {"instruction": "Write a program that prints the product of two integers.", "rubric": RUBRIC, "tests": PRODUCT_TESTS},
  {"instruction": "Please check the latest record.", "rubric": RUBRIC},  # no tests: judged as before
  # right program, but the scripted judge fails every "impossible" task: the verifier AND the judge must pass
  {
    "instruction": "Write the impossible program that prints the sum of two integers.",
    "rubric": RUBRIC,
    "tests": SUM_TESTS,
  },
  # malformed tests: dropped by the tasks stage, naming the field
  {
    "instruction": "Write a program that prints the sum.",
    "rubric": RUBRIC,
    "tests": {"input_output": {"inputs": "1 2"}},
  },
]


def answer(body: dict) -> dict:
  msgs = body["messages"]
  system = msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else ""
  role = system.split("\n", 1)[0].removeprefix("ROLE: ").strip()
  if body.get("tools") is not None and "program" in msgs[1]["content"]:  # the agent, asked for a program
    return {"role": "assistant", "content": f"Here it is:\n```python\n{ADD}```\nRun it with the two numbers."}
  if role == "task_generator":
    return {"role": "assistant", "content": json.dumps(TASKS)}
  if role == "user_simulator" and "(Start" in msgs[-1]["content"]:  # the user asks for the task's goal itself
    goal = system.split("Your goal: ", 1)[1].split("\n", 1)[0]
    return {"role": "assistant", "content": goal}
  return scripted_llm.reply(body)


def _config(url, **kw):
  return SynthConfig(
    llm=ChatConfig(url=url, max_retries=4),
    categories=("finance",),
    domains_per_category=1,
    num_agents=1,
    tasks_per_agent=len(TASKS),
    workers=4,
    **kw,
  )


def _by_id(path):
  return {r["id"]: r for r in map(json.loads, open(path))}


def test_code_tasks_graded_by_verifier_and_judge(tmp_path, monkeypatch, caplog):
  out = str(tmp_path / "synth")
  llm = scripted_llm.ScriptedLLM(answer)
  try:
    with caplog.at_level(logging.WARNING, logger="k2jax.synth.agents"):
      first = run_synth(_config(llm.url, stages=("tools", "agents", "tasks", "trajectories")), out)
    assert first["tasks"]["tasks"] == 4 and first["llm"]["invalid.task_generator"] == 1
    assert "agent0: proposed task 4: field 'tests': field 'input_output.inputs': must be a list" in caplog.text
    tasks = json.loads(open(f"{out}/tasks.jsonl").readline())["tasks"]
    assert [t.get("tests") for t in tasks] == [SUM_TESTS, PRODUCT_TESTS, None, SUM_TESTS]

    def no_sandbox(*a, **k):
      raise SandboxUnavailable("no namespaces (test)")

    monkeypatch.setattr(verify_mod, "run_python", no_sandbox)
    judge_calls = llm.calls["ROLE: judge"]
    down = run_synth(_config(llm.url, stages=("sft",)), out)  # no verdict: the three code units stay undone
    assert down["sft"]["errors"] == 3 and down["sft"]["accepted"] == 1 and "rejected" not in down["sft"]
    assert all("VerifierUnavailable" in e and "no namespaces" in e for e in down["sft"]["error_examples"])
    assert llm.calls["ROLE: judge"] == judge_calls + 1  # the judge is not asked before the verifier's verdict
    assert list(_by_id(f"{out}/sft.jsonl")) == ["agent0/task2"]

    monkeypatch.undo()
    stats = run_synth(_config(llm.url, stages=("sft",)), out)  # the rerun grades them
  finally:
    llm.close()
  assert stats["sft"]["skipped_done"] == 1 and stats["sft"]["accepted"] == 1 and stats["sft"]["rejected"] == 2
  assert "errors" not in stats["sft"] and stats["sft_records"] == 2
  kept, rejected = _by_id(f"{out}/sft.jsonl"), _by_id(f"{out}/sft.rejected.jsonl")
  assert kept["agent0/task0"]["verifier_score"] == 1.0 and kept["agent0/task0"]["judge_score"] == 9
  assert kept["agent0/task0"]["verifier_reason"] == "2/2 tests passed"
  assert "verifier_score" not in kept["agent0/task2"] and kept["agent0/task2"]["judge_score"] == 9
  product = rejected["agent0/task1"]
  assert (
    product["kind"] == "verifier"
    and product["reason"] == "verifier: 0.50 (1/2 tests passed; test 1: line 1: 4 is not within 1e-06 of 3)"
  )
  assert rejected["agent0/task3"]["kind"] == "judge_rejected"  # its program passed; the judge did not


def test_malformed_tests_in_tasks_file_name_the_field(tmp_path):
  out = tmp_path / "synth"
  out.mkdir()
  agent = {"id": "agent0", "name": "helper", "system_prompt": "You are a careful assistant.", "tools": []}
  (out / "agents.jsonl").write_text(json.dumps(agent) + "\n")
  bad = {"instruction": "Sum two numbers.", "rubric": RUBRIC, "tests": {"test_list": []}}
  (out / "tasks.jsonl").write_text(json.dumps({"id": "agent0", "agent_id": "agent0", "tasks": [bad]}) + "\n")
  with pytest.raises(ValueError, match=r"tasks\.jsonl: task agent0/task0: field 'tests': field 'test_list'"):
    run_synth(_config("http://127.0.0.1:9/v1", stages=("trajectories",)), str(out))
