"""Environments: the simulated office world and the sandboxed code env in-process, the same episodes over
HTTP (many concurrent on loopback), and the process pool's timeouts and restarts."""

import concurrent.futures
import json
import os
import signal
import time

import pytest
import requests

from k2jax.agentic import Guard, GuardConfig
from k2jax.agentic.envs import EnvPool, EnvPoolConfig, EnvService, RemoteEnvConfig, RemoteEnvironment
from k2jax.agentic.envs.code import CodeEnv
from k2jax.agentic.envs.simulated import SimToolsEnv
from k2jax.sandbox.runner import isolation_error
from tests import procs

TASK = {
  "id": "t1",
  "instruction": "Fix the report and pay Bob 5 dollars.",
  "state": {"files": {"report.txt": "draft"}, "accounts": {"me": 1000, "bob": 0}},
  "checks": [
    {"kind": "file_equals", "name": "report.txt", "text": "final"},
    {"kind": "balance", "account": "bob", "cents": 500},
    {"kind": "answer_contains", "text": "done"},
  ],
  "followups": ["Anything else?"],
}


def call(tool, i, **args):
  return {"id": f"functions.{tool}:{i}", "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}


def play(env, task=TASK):
  obs = env.reset(task)
  assert obs["messages"][-1]["content"] == task["instruction"] and obs["tools"]
  steps = [
    {
      "role": "assistant",
      "content": "",
      "tool_calls": [call("read_file", 0, name="report.txt"), call("write_file", 1, name="report.txt", text="final")],
    },
    {
      "role": "assistant",
      "content": "",
      "tool_calls": [
        call("transfer", 2, source="me", dest="bob", cents=500),
        call("nope", 3),
        call("read_file", 4, name=5),
      ],
      "tool_call_error": "tool call 5 not terminated",
    },
    {"role": "assistant", "content": "I could not pay Bob."},
    {"role": "assistant", "content": "All done."},
  ]
  return [env.step(a) for a in steps]


def check_episode(results):
  first, second, third, last = results
  assert [m["content"] for m in first.observation["messages"]][0] == "draft" and not first.done
  kinds = [json.loads(m["content"]).get("error") for m in second.observation["messages"]]
  assert kinds == ["denied", "unknown_tool", "bad_arguments", "malformed_call"]
  assert third.observation["messages"] == [{"role": "user", "content": "Anything else?"}] and not third.done
  assert last.done and last.reward == pytest.approx(2 / 3) and last.info["checks_passed"] == 2


def test_sim_tools_in_process():
  env = SimToolsEnv()
  check_episode(play(env))
  # With a confirming guard the irreversible transfer runs and every check passes.
  ok = SimToolsEnv(Guard(GuardConfig(), confirm=lambda tool, c: True))
  assert play(ok)[-1].reward == 1.0


@pytest.mark.skipif(
  isolation_error() is not None, reason=f"this machine cannot create the sandbox's namespaces: {isolation_error()}"
)
def test_code_env_sandbox():
  env = CodeEnv()
  task = {"id": "c", "instruction": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}
  env.reset(task)
  r = env.step({"role": "assistant", "content": "", "tool_calls": [call("run_python", 0, code="print(6*7)")]})
  assert json.loads(r.observation["messages"][0]["content"])["stdout"].strip() == "42" and not r.done
  r = env.step(
    {"role": "assistant", "content": "", "tool_calls": [call("submit", 1, code="def add(a, b): return a + b")]}
  )
  assert r.done and r.reward == 1.0
  env.reset(task)  # no submit: the final message's code block is graded
  r = env.step({"role": "assistant", "content": "```python\ndef add(a, b):\n    return a - b\n```"})
  assert r.done and r.reward == 0.5
  with pytest.raises(ValueError, match="no 'tests'"):
    env.reset({"instruction": "x"})


def test_service_many_concurrent_episodes_on_loopback():
  service = EnvService("sim_tools").start()
  try:

    def one(_):
      env = RemoteEnvironment(RemoteEnvConfig(service.url))
      return play(env)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
      all_results = list(pool.map(one, range(64)))
    for results in all_results:
      check_episode(results)
    bad = RemoteEnvironment(RemoteEnvConfig(service.url))
    with pytest.raises(Exception, match="instruction"):
      bad.reset({"id": "no-instruction"})
  finally:
    service.close()


@pytest.mark.slow
def test_pool_restarts_dead_and_hung_workers():
  with EnvPool(EnvPoolConfig(num_workers=2, step_timeout_s=2.0)) as pool:
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
      for results in ex.map(lambda _: play(pool.episode()), range(8)):
        check_episode(results)
    for sig in (signal.SIGKILL, signal.SIGSTOP):  # crashed, then hung
      env = pool.episode()
      env.reset(TASK)
      os.kill(env._worker.proc.pid, sig)
      r = env.step({"role": "assistant", "content": "hi"})
      assert r.done and r.reward == 0.0 and "env_error" in r.info
    assert pool.restarts == 2
    check_episode(play(pool.episode()))  # the restarted workers serve again


def test_service_caps_episodes_and_expires_idle_ones():
  """Unclosed episodes cannot pile up: a cap answers 429, and idle episodes expire."""
  service = EnvService("sim_tools", max_episodes=3, episode_ttl_s=0.5).start()
  try:
    reset = lambda: requests.post(f"{service.url}/reset", json={"task": TASK}, timeout=30)  # noqa: E731
    assert [reset().status_code for _ in range(3)] == [200, 200, 200]
    full = reset()
    assert full.status_code == 429 and "cap" in full.json()["error"]["message"]
    time.sleep(0.6)
    assert reset().status_code == 200  # the three idle ones expired
    assert service.num_episodes() == 1
    bad = requests.post(f"{service.url}/step", json={"episode_id": 5, "action": {}}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "episode_id"
    deep = requests.post(f"{service.url}/reset", data=b"[" * 100_000, timeout=30)
    assert deep.status_code == 400
  finally:
    service.close()


def test_service_caps_running_steps():
  service = EnvService("sim_tools", max_running_steps=0).start()
  try:
    ep = requests.post(f"{service.url}/reset", json={"task": TASK}, timeout=30).json()["episode_id"]
    step = {"episode_id": ep, "action": {"role": "assistant", "content": "hi"}}
    r = requests.post(f"{service.url}/step", json=step, timeout=30)
    assert r.status_code == 429 and "steps running" in r.json()["error"]["message"]
  finally:
    service.close()


def test_pool_workers_die_with_a_killed_pool_process(tmp_path):
  """A learner SIGKILLed (no close, no atexit) takes its env workers with it: each holds its stdin pipe."""
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  script = (
    "import sys, time; sys.path.insert(0, sys.argv[1])\n"
    "from k2jax.agentic.envs import EnvPool, EnvPoolConfig\n"
    "pool = EnvPool(EnvPoolConfig(env='sim_tools', num_workers=2))\n"
    "print(*pool.worker_pids(), flush=True)\n"
    "time.sleep(600)\n"
  )
  owner = subprocess.Popen([sys.executable, "-c", script, root], stdout=subprocess.PIPE, text=True)
  try:
    pids = [int(p) for p in owner.stdout.readline().split()]
    assert len(pids) == 2 and all(procs.alive(p) for p in pids)
  finally:
    owner.kill()
    owner.wait()
  deadline = time.monotonic() + 20
  while left := [p for p in pids if procs.alive(p)]:
    assert time.monotonic() < deadline, f"env workers {left} outlived the process that started them"
    time.sleep(0.1)
