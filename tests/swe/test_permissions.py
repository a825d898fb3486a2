"""SWE grading, the coding environment and the sandbox under them work when the Python environment (and the
workspace) sit in a directory the sandbox's uid cannot enter: a venv in a 0700 home (Ubuntu's default is
0750). As root the sandbox drops to nobody; before the fix every grade was then `infra_failure` (`mount ...
site-packages: Permission denied`). Unprivileged callers run the sandbox as themselves: the same tests pass
there trivially (their own home is theirs)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from k2jax.agentic.envs.swe import SweEnv, SweEnvConfig
from k2jax.sandbox.runner import SandboxConfig, run_python
from k2jax.sandbox.workspace import (
  WorkspaceRunConfig,
  default_python_paths,
  prepare_workspace,
  run_command,
  sandbox_uid,
)
from k2jax.swe import grade as grading
from k2jax.swe import instances as io
from k2jax.swe.testrun import run_tests
from k2jax.swe.workspace import PoolConfig, WorkspacePool
from tests.swe.conftest import needs_isolation, patch_with, read

# pytest and what it imports, copied as a venv's site-packages holds them
_TOOLS = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py", "pytest_timeout.py")


def _locked_home(tmp_path) -> str:
  home = tmp_path / "home"
  home.mkdir()
  os.chmod(home, 0o700)
  return str(home)


def _locked_site_packages(home: str) -> str:
  """A site-packages with pytest in a 0700 home (a venv's lib/python3.X/site-packages)."""
  src = default_python_paths()[0]
  dst = os.path.join(home, "venv", "lib", "site-packages")
  os.makedirs(dst)
  for name in _TOOLS:
    path = os.path.join(src, name)
    if os.path.isdir(path):
      shutil.copytree(path, os.path.join(dst, name), ignore=shutil.ignore_patterns("__pycache__"))
    elif os.path.exists(path):
      shutil.copy(path, dst)
  return dst


def _unreadable_by_sandbox_uid(path: str) -> bool:
  uid = sandbox_uid()
  if uid is None:
    return False
  r = subprocess.run(["/bin/ls", path], user=uid, group=uid, extra_groups=[], capture_output=True, cwd="/")
  return r.returncode != 0


@needs_isolation
def test_binds_from_a_0700_dir_mount_read_only_and_no_permission_changes(tmp_path):
  home = _locked_home(tmp_path)
  data = os.path.join(home, "data")
  os.mkdir(data)
  with open(os.path.join(data, "x.txt"), "w") as f:
    f.write("from the locked home")
  modes = {p: os.stat(p).st_mode for p in (str(tmp_path), home, data)}
  if os.geteuid() == 0:
    assert _unreadable_by_sandbox_uid(data)  # the situation under test
  prog = (
    "print(open('/data/x.txt').read())\n"
    "try:\n  open('/data/y.txt', 'w')\nexcept OSError as e:\n  print('refused', e.errno)\n"
  )
  r = run_python({"main.py": prog}, "main.py", SandboxConfig(binds=((data, "/data", True),)))
  assert r.reason == "ok", r.stderr
  assert r.stdout.splitlines() == ["from the locked home", "refused 30"]  # EROFS
  assert {p: os.stat(p).st_mode for p in modes} == modes
  assert not os.path.exists(os.path.join(data, "y.txt"))


@needs_isolation
def test_pytest_from_a_venv_in_a_0700_home_runs_a_workspace_in_a_0700_dir(tmp_path):
  home = _locked_home(tmp_path)
  site = _locked_site_packages(home)
  ws = os.path.join(home, "work", "repo")
  os.makedirs(ws)
  with open(os.path.join(ws, "test_t.py"), "w") as f:
    f.write("def test_ok():\n  assert 1 + 1 == 2\n\ndef test_bad():\n  assert 1 + 1 == 3\n")
  prepare_workspace(ws)
  assert os.stat(home).st_mode & 0o777 == 0o700  # left as the user made it
  if os.geteuid() == 0:
    assert _unreadable_by_sandbox_uid(site) and _unreadable_by_sandbox_uid(ws)
  cfg = WorkspaceRunConfig(timeout_s=30.0, python_paths=(site,))
  run = run_tests(ws, ["test_t.py::test_ok", "test_t.py::test_bad"], cfg)
  assert run.consistent and run.outcomes == {"test_t.py::test_ok": "passed", "test_t.py::test_bad": "failed"}
  out = run_command(["bash", "-c", "python -c 'import pytest; print(pytest.__file__)' && touch made_here"], ws, cfg)
  assert out.returncode == 0 and out.output.strip() == os.path.join(site, "pytest", "__init__.py"), out.output
  assert os.path.exists(os.path.join(ws, "made_here"))  # the workspace is writable through its bind


@needs_isolation
def test_a_temp_dir_the_sandbox_uid_cannot_enter_still_runs(tmp_path, monkeypatch):
  """TMPDIR in a 0700 dir (bench/swe_env.py's own temp dir): the run's files are staged, its launcher's dir
  goes where the uid can reach it, and nothing is left behind."""
  home = _locked_home(tmp_path)
  monkeypatch.setattr(tempfile, "tempdir", home)
  r = run_python({"main.py": "import os; print(sorted(os.listdir('.')))"}, "main.py")
  assert r.reason == "ok" and r.stdout.strip() == "['main.py']", r.stderr
  assert os.listdir(home) == [] and os.stat(home).st_mode & 0o777 == 0o700


@needs_isolation
def test_an_interpreter_in_a_dir_the_sandbox_uid_cannot_enter_runs(tmp_path):
  exe = os.path.realpath(sys.executable)
  if not _unreadable_by_sandbox_uid(os.path.dirname(exe)):
    pytest.skip(f"{exe} is readable by the sandbox uid here (or the caller is not root): nothing to show")
  r = run_python({"main.py": "import sys; print(sys.version)"}, "main.py", SandboxConfig(python=exe))
  assert r.reason == "ok", r.stderr
  assert r.stdout.strip() == sys.version


@pytest.fixture(scope="module")
def locked_paths(tmp_path_factory):
  home = _locked_home(tmp_path_factory.mktemp("locked"))
  return (_locked_site_packages(home),)


def test_grading_with_the_test_tools_in_a_0700_home_is_not_an_infra_failure(toy_tasks, locked_paths):
  root, instances = toy_tasks
  inst = next(i for i in instances if i.kind == "procedural")
  cfg = grading.GradeConfig(run=WorkspaceRunConfig(timeout_s=30.0, python_paths=locked_paths))
  gold = grading.grade(inst, inst.patch, root, cfg)
  assert gold.resolved and not gold.infra_failure, gold.reason
  rel = inst.mutations[0].split()[1]
  noop = patch_with(root, inst, {rel: "# looked at it\n" + read(root, inst, rel)})  # applies, fixes nothing
  bad = grading.grade(inst, noop, root, cfg)
  assert not bad.resolved and not bad.infra_failure and bad.patch_successfully_applied, bad.reason


def test_the_coding_environment_with_a_0700_venv_resolves_the_gold_fix(toy_tasks, locked_paths, tmp_path):
  root, instances = toy_tasks
  io.write_instances(os.path.join(root, "instances.jsonl"), instances)
  inst = next(i for i in instances if i.kind == "procedural")
  run = WorkspaceRunConfig(timeout_s=30.0, python_paths=locked_paths)
  pool = WorkspacePool(PoolConfig(root_parent=_locked_home(tmp_path), ready_per_instance=1, max_ready=1))
  env = SweEnv(config=SweEnvConfig(bash=run, grade=grading.GradeConfig(run=run)), pool=pool)
  try:
    env.reset({"id": inst.instance_id, "instruction": "fix", "instance_id": inst.instance_id, "task_set": root})
    shell = env.step(_call("bash", command=f"python -m pytest -q -p no:cacheprovider {inst.FAIL_TO_PASS[0]}"))
    assert "1 failed" in shell.observation["messages"][0]["content"]
    rel = inst.mutations[0].split()[1]
    minus = [x[1:] for x in inst.patch.splitlines() if x.startswith("-") and not x.startswith("---")]
    plus = [x[1:] for x in inst.patch.splitlines() if x.startswith("+") and not x.startswith("+++")]
    edit = _call(
      "str_replace_editor", command="str_replace", path=rel, old_str="\n".join(minus), new_str="\n".join(plus)
    )
    assert "edited" in env.step(edit).observation["messages"][0]["content"]
    end = env.step(_call("finish"))
    assert end.done and end.reward == 1.0 and end.info["resolved"], end.info
  finally:
    env.close()
    pool.close()


def _call(name, **args):
  fn = {"name": name, "arguments": json.dumps(args)}
  call = {"id": f"functions.{name}:0", "type": "function", "function": fn}
  return {"role": "assistant", "content": "", "tool_calls": [call]}
