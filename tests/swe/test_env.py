"""The SWE environment: tools confined to a fresh workspace, bash in the sandbox, budgets, grading of the
episode's diff, workspaces and processes reaped; the bounded pool; a scripted agent through the tool loop."""

import json
import os

import pytest

from k2jax.agentic.envs.swe import SweEnv, SweEnvConfig
from k2jax.sandbox.workspace import WorkspaceRunConfig
from k2jax.swe import instances as io
from k2jax.swe.grade import GradeConfig
from k2jax.swe.workspace import PoolConfig, WorkspacePool, reap_dead_pools
from tests.swe.conftest import RUN


@pytest.fixture(scope="module")
def task_set(toy_tasks):
  root, instances = toy_tasks
  io.write_instances(os.path.join(root, "instances.jsonl"), instances)
  return root, instances


@pytest.fixture()
def pool(tmp_path):
  p = WorkspacePool(PoolConfig(root_parent=str(tmp_path), ready_per_instance=1, max_ready=2))
  yield p
  p.close()
  assert os.listdir(tmp_path) == []


def _env(pool, **kw):
  cfg = SweEnvConfig(bash=WorkspaceRunConfig(timeout_s=10.0), grade=GradeConfig(run=RUN), **kw)
  return SweEnv(config=cfg, pool=pool)


def _call(name, **args):
  return {
    "role": "assistant",
    "content": "",
    "tool_calls": [
      {"id": f"functions.{name}:0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    ],
  }


def _task(root, inst):
  return {
    "id": inst.instance_id,
    "instruction": inst.problem_statement,
    "instance_id": inst.instance_id,
    "task_set": root,
  }


def _out(step):
  return step.observation["messages"][0]["content"]


def test_gold_fix_through_the_editor_resolves_and_the_workspace_is_gone(task_set, pool):
  root, instances = task_set
  inst = next(i for i in instances if i.kind == "procedural")
  rel = inst.mutations[0].split()[1]
  env = _env(pool)
  obs = env.reset(_task(root, inst))
  assert [t["function"]["name"] for t in obs["tools"]] == ["bash", "str_replace_editor", "finish"]
  ws = env.ws.path
  assert "def " in _out(env.step(_call("str_replace_editor", command="view", path=f"/testbed/{rel}")))
  minus = [x[1:] for x in inst.patch.splitlines() if x.startswith("-") and not x.startswith("---")]
  plus = [x[1:] for x in inst.patch.splitlines() if x.startswith("+") and not x.startswith("+++")]
  s = env.step(
    _call("str_replace_editor", command="str_replace", path=rel, old_str="\n".join(minus), new_str="\n".join(plus))
  )
  assert "edited" in _out(s)
  out = _out(env.step(_call("bash", command=f"python -m pytest -q -p no:cacheprovider {inst.FAIL_TO_PASS[0]}")))
  assert "exit code: 0" in out and "1 passed" in out
  end = env.step(_call("finish"))
  assert end.done and end.reward == 1.0 and end.info["resolved"] and end.info["pass_rate"] == 1.0
  env.close()
  assert not os.path.exists(ws)


def test_no_fix_scores_zero_and_editor_undo_restores(task_set, pool):
  root, instances = task_set
  inst = instances[0]
  rel = inst.mutations[0].split()[1]
  env = _env(pool)
  env.reset(_task(root, inst))
  before = open(os.path.join(env.ws.path, rel)).read()
  env.step(_call("str_replace_editor", command="insert", path=rel, insert_line=0, new_str="# note"))
  env.step(_call("str_replace_editor", command="create", path="new/mod.py", file_text="x = 1\n"))
  assert open(os.path.join(env.ws.path, rel)).read() == "# note\n" + before
  assert "exit code: 0" in _out(env.step(_call("bash", command="echo y >> new/mod.py && cat new/mod.py")))
  env.step(_call("str_replace_editor", command="undo_edit", path=rel))
  assert open(os.path.join(env.ws.path, rel)).read() == before
  end = env.step({"role": "assistant", "content": "I am done."})
  assert end.done and end.reward == 0.0 and not end.info["resolved"] and "env_error" not in end.info
  env.close()


def test_tools_stay_inside_the_workspace(task_set, pool):
  root, instances = task_set
  env = _env(pool)
  env.reset(_task(root, instances[0]))
  os.symlink("/etc", os.path.join(env.ws.path, "etc_link"))
  for path in ("/etc/passwd", "../../etc/passwd", "/testbed/../etc/hostname", "etc_link/passwd"):
    out = _out(env.step(_call("str_replace_editor", command="view", path=path)))
    assert "outside_workspace" in out, (path, out)
  out = _out(
    env.step(
      _call("bash", command="ls /root /work/main 2>&1; cat /etc/hostname 2>&1; git log --all 2>&1 | head -1; ls -a")
    )
  )
  assert "No such file" in out and "not a git repository" in out and ".git" not in out.split("\n", 3)[-1]
  probe = "python -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\" 2>&1 | tail -1"
  assert "Network is unreachable" in _out(env.step(_call("bash", command=probe)))
  env.close()


def test_bash_deadline_kills_every_process(task_set, pool):
  root, instances = task_set
  env = _env(pool)
  env.reset(_task(root, instances[0]))
  out = _out(env.step(_call("bash", command="(sleep 313 &) ; sleep 314")))
  assert "exit code: 124" in out and "timed out" in out
  assert not [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).startswith(("sleep 313", "sleep 314"))]
  env.close()


def _cmdline(pid):
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().replace(b"\0", b" ").decode()
  except OSError:
    return ""


def test_turn_and_time_budgets_end_the_episode(task_set, pool):
  root, instances = task_set
  env = _env(pool, max_turns=2)
  env.reset(_task(root, instances[0]))
  assert not env.step(_call("bash", command="true")).done
  end = env.step(_call("bash", command="true"))
  assert end.done and end.info["out_of_turns"] and end.reward == 0.0
  env.close()
  env = _env(pool, episode_timeout_s=0.0)
  env.reset(_task(root, instances[0]))
  end = env.step(_call("bash", command="true"))
  assert end.done and end.info["out_of_time"] and "out_of_time" in _out(end)
  env.close()


def test_grading_infrastructure_failure_is_an_env_error(task_set, pool, tmp_path):
  root, instances = task_set
  inst = instances[0]
  env = _env(pool)
  env.reset(_task(root, inst))
  env.state["instance"] = io.Instance(**{**inst.__dict__, "base_commit": "0" * 40})  # the snapshot no longer matches
  env.step(_call("str_replace_editor", command="create", path="notes.txt", file_text="x\n"))
  end = env.step(_call("finish"))
  assert end.done and "does not hash" in end.info["env_error"] and end.reward == 0.0
  env.close()


def test_pool_prepares_ahead_bounds_ready_copies_and_reaps(task_set, tmp_path):
  root, instances = task_set
  p = WorkspacePool(PoolConfig(root_parent=str(tmp_path), ready_per_instance=2, max_ready=3))
  snaps = [i.snapshot_dir(root) for i in instances[:3]]
  got = [p.acquire(s) for s in snaps]
  p._workers.submit(lambda: None).result()
  p._workers.shutdown(wait=True)  # let the refills land (no new ones are scheduled after this)
  c = p.counts()
  assert c["live"] == 3 and c["ready"] <= 3 and c["dirs"] == 3 + c["ready"]
  for w in got:
    p.release(w)
  assert p.counts()["live"] == 0
  p._closed = True
  p.close()
  os.makedirs(tmp_path / "k2jax-swe-ws-999999999-x")  # a pool whose process died
  assert reap_dead_pools(str(tmp_path)) == ["k2jax-swe-ws-999999999-x"] and os.listdir(tmp_path) == []
