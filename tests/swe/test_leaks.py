"""Nothing leaks when an episode fails: a reset or step that raises, a grading run killed at its deadline, a
copy that fails midway, the pool closed while a copy is being made. After each: no workspace dir, no temp
dir, no process left (what bench/swe_env.py counts as leaked_workspaces / leaked_dirs / leaked_procs)."""

import os
import signal
import tempfile
import threading
import time

import pytest

from k2jax.agentic.envs import swe as swe_env
from k2jax.agentic.envs.base import ToolEnvironment
from k2jax.agentic.envs.swe import SweEnv, SweEnvConfig
from k2jax.sandbox.workspace import WorkspaceRunConfig
from k2jax.swe import snapshot
from k2jax.swe import workspace as ws_mod
from k2jax.swe.grade import GradeConfig, grade
from k2jax.swe.instances import read_instances
from k2jax.swe.workspace import PoolConfig, WorkspacePool
from tests.swe.conftest import ROOT, RUN, needs_isolation, patch_with

TASKS = os.path.join(ROOT, "data", "swe", "toy_tasks")
pytestmark = needs_isolation


@pytest.fixture(scope="module")
def inst():
  return read_instances(os.path.join(TASKS, "instances.jsonl"))[0]


@pytest.fixture()
def tmp(tmp_path, monkeypatch):
  """A temp dir of this test's own (tempfile's default, so grading's dirs land here too)."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  return tmp_path


def _procs(marker: str) -> list[str]:
  """Live processes whose command line holds `marker`. A process already sent SIGKILL (the kernel's teardown of
  a PID namespace whose init died) or already exiting is not counted: it cannot run again, and on a loaded
  machine it may not have been scheduled to finish dying by the time the grader returns."""
  out = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
      doomed = marker in cmd and _doomed(pid)
    except OSError:
      continue
    if marker in cmd and str(os.getpid()) != pid and not doomed:
      out.append(f"{pid}: {cmd[:200]}")
  return out


def _doomed(pid: str) -> bool:
  """SIGKILL pending for the thread or its group, or the process is a zombie / dead."""
  with open(f"/proc/{pid}/status") as f:
    fields = dict(line.split(":", 1) for line in f if ":" in line)
  sigkill = 1 << (signal.SIGKILL - 1)
  pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
  return bool(pending & sigkill) or fields["State"].strip()[:1] in ("Z", "X")


def _task(inst):
  return {"id": inst.instance_id, "instruction": "fix", "instance_id": inst.instance_id, "task_set": TASKS}


def _env(pool):
  return SweEnv(config=SweEnvConfig(bash=WorkspaceRunConfig(timeout_s=10.0), grade=GradeConfig(run=RUN)), pool=pool)


def _call(name, **args):
  import json

  fn = {"name": name, "arguments": json.dumps(args)}
  return {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": f"functions.{name}:0", "type": "function", "function": fn}],
  }


def _no_leaks(pool, tmp):
  assert pool.wait_idle(30.0)
  c = pool.counts()
  assert c["live"] == 0 and c["dirs"] == c["ready"], c  # every dir under the root is a ready copy
  pool.close()
  assert os.listdir(tmp) == [], os.listdir(tmp)  # the pool's root and every grading dir are gone
  assert _procs(str(tmp)) == []


def test_a_reset_or_step_that_raises_releases_its_workspace(inst, tmp, monkeypatch):
  pool = WorkspacePool(PoolConfig(ready_per_instance=1, max_ready=2))
  env = _env(pool)

  def boom(*a, **k):
    raise RuntimeError("injected")

  with monkeypatch.context() as m:
    m.setattr(ToolEnvironment, "reset", boom)
    with pytest.raises(RuntimeError, match="injected"):
      env.reset(_task(inst))
  assert env.ws is None and pool.counts()["live"] == 0
  env.reset(_task(inst))
  assert pool.counts()["live"] == 1
  with monkeypatch.context() as m:
    m.setattr(swe_env, "grade", boom)  # the grader itself fails on finish
    with pytest.raises(RuntimeError, match="injected"):
      env.step(_call("finish"))
  assert env.ws is None and pool.counts()["live"] == 0
  env.close()  # a second close after the step's own is a no-op
  _no_leaks(pool, tmp)


def test_a_grading_run_killed_at_its_deadline_leaves_no_process_or_dir(inst, tmp):
  marker = "3170.5"  # sleep 3170.5: no other process on the machine sleeps this long
  hang = f"import subprocess, time\n\nsubprocess.Popen(['sleep', '{marker}'])\ntime.sleep({marker})\n"
  with open(os.path.join(inst.snapshot_dir(TASKS), "toycalc", "__init__.py")) as f:
    init = f.read() + "from toycalc import hang  # noqa: the tests hang at import\n"
  patch = patch_with(TASKS, inst, {"__gold__": True, "toycalc/hang.py": hang, "toycalc/__init__.py": init})
  cfg = GradeConfig(run=WorkspaceRunConfig(timeout_s=3.0, python_paths=RUN.python_paths), hack_check=False)
  t0 = time.monotonic()
  rep = grade(inst, patch, TASKS, cfg)
  assert not rep.resolved and time.monotonic() - t0 < 30.0, rep.reason
  assert _procs(f"sleep {marker}") == []
  assert os.listdir(tmp) == []


def test_a_copy_that_fails_midway_is_deleted(inst, tmp, monkeypatch):
  real = snapshot.copy_tree
  calls = []

  def half_copy(src, dst):
    calls.append(dst)
    real(src, dst)
    os.unlink(os.path.join(dst, "toycalc", "stats.py"))  # written, then the disk "fails"
    raise OSError(28, "No space left on device (injected)")

  monkeypatch.setattr(ws_mod.snapshot, "copy_tree", half_copy)
  pool = WorkspacePool(PoolConfig(ready_per_instance=2, max_ready=4))
  with pytest.raises(OSError, match="injected"):
    pool.acquire(inst.snapshot_dir(TASKS))
  assert pool.counts() == {"ready": 0, "live": 0, "preparing": 0, "dirs": 0}
  monkeypatch.setattr(ws_mod.snapshot, "copy_tree", real)
  ws = pool.acquire(inst.snapshot_dir(TASKS))  # the refills fail no more
  assert os.path.isfile(os.path.join(ws.path, "toycalc", "stats.py")) and len(calls) == 1
  pool.release(ws)
  _no_leaks(pool, tmp)


def test_a_pool_closed_while_copying_leaves_nothing(inst, tmp, monkeypatch):
  real, started, go = snapshot.copy_tree, threading.Event(), threading.Event()

  def slow_copy(src, dst):
    started.set()
    assert go.wait(30.0)
    real(src, dst)  # copytree makes dst's parents again: the pool's root, deleted by close()

  monkeypatch.setattr(ws_mod.snapshot, "copy_tree", slow_copy)
  pool = WorkspacePool(PoolConfig(ready_per_instance=1, max_ready=2))
  err = []

  def acquire():
    try:
      pool.acquire(inst.snapshot_dir(TASKS))
    except RuntimeError as e:
      err.append(str(e))

  t = threading.Thread(target=acquire)
  t.start()
  assert started.wait(30.0)
  pool.close()  # while the copy waits: the root goes now
  assert not os.path.exists(pool.root)
  go.set()
  t.join(30.0)
  assert err == ["workspace pool is closed"]
  assert os.listdir(tmp) == []  # the copy made the root again; acquire deleted it
  with pytest.raises(RuntimeError, match="closed"):
    pool.acquire(inst.snapshot_dir(TASKS))
