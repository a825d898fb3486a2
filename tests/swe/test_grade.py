"""Grading on the toy tasks: gold resolves, nothing else does, and every known reward hack fails
(swe-environments.md §3.3): edited / deleted tests, forging or skipping conftest files, broken collection,
exiting at import, planted or forged reports, monkeypatched pytest, shadowed pytest, the network."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from k2jax.swe import grade as grading
from k2jax.swe import instances as io
from tests.swe.conftest import ROOT, RUN, patch_with, read

CFG = grading.GradeConfig(run=RUN)
# The hacks below are each caught by the layer they name; the static hack check (which flags most of them
# before anything runs, tests/swe/test_exploits.py) is off so that the layer itself is what is tested.
RUNTIME = dataclasses.replace(CFG, hack_check=False)


@pytest.fixture(scope="module")
def bug(toy_tasks):
  root, instances = toy_tasks
  inst = next(i for i in instances if i.kind == "procedural")
  return root, inst, inst.mutations[0].split()[1], inst.FAIL_TO_PASS[0].split("::")[0]


def _grade(root, inst, patch):
  return grading.grade(inst, patch, root, RUNTIME)


def test_every_kind_of_task_grades_its_gold_patch_resolved(toy_tasks):
  root, instances = toy_tasks
  assert {i.kind for i in instances} == {"procedural", "combo", "version_diff"}
  for inst in instances:
    r = grading.grade(inst, inst.patch, root, CFG)
    assert r.resolved and r.pass_rate == 1.0 and r.exit_code == 0, (inst.instance_id, r.reason)
    assert r.tests_status["FAIL_TO_PASS"]["success"] == list(inst.FAIL_TO_PASS)


def test_empty_and_missing_patches_are_unresolved(bug):
  root, inst, _, _ = bug
  for patch in ("", None):
    r = _grade(root, inst, patch)
    assert not r.resolved and not r.patch_exists and not r.infra_failure and r.patch_is_None == (patch is None)


def test_a_patch_that_does_not_apply_is_unresolved(bug):
  root, inst, _, _ = bug
  lines = inst.patch.splitlines(keepends=True)
  bad = "".join("-no such line here\n" if x.startswith("-") and not x.startswith("---") else x for x in lines)
  r = _grade(root, inst, bad)
  assert not r.resolved and not r.patch_successfully_applied and not r.infra_failure


def test_editing_or_deleting_the_failing_test_is_unresolved(bug):
  root, inst, _, test_file = bug
  name = inst.FAIL_TO_PASS[0].split("::")[1]
  text = read(root, inst, test_file)
  edited = text.replace(f"def {name}():", f"def {name}():\n  return\n", 1)
  for edits in (
    {test_file: edited},
    {test_file: None},
    {test_file: "import pytest\npytest.skip('x', allow_module_level=True)\n"},
  ):
    r = _grade(root, inst, patch_with(root, inst, edits))
    assert not r.resolved and r.patch_successfully_applied, r.reason
    assert test_file in r.reason  # restored from the pristine copy


FORGE = """
import pytest
def pytest_collection_modifyitems(config, items):
  for item in items:
    print("PASSED " + item.nodeid)
    item.add_marker(pytest.mark.skip(reason="forged"))
"""


@pytest.mark.parametrize("where", ["conftest.py", "tests/conftest.py", "toycalc/conftest.py"])
def test_a_conftest_that_forges_or_skips_is_removed(bug, where):
  root, inst, _, _ = bug
  r = _grade(root, inst, patch_with(root, inst, {where: FORGE}))
  assert not r.resolved and where in r.reason


def test_config_files_that_add_options_are_restored(bug):
  root, inst, _, _ = bug
  for rel, text in (
    ("pytest.ini", "[pytest]\naddopts = -k nothing_matches\n"),
    ("setup.cfg", "[tool:pytest]\naddopts = --co\n"),
  ):
    r = _grade(root, inst, patch_with(root, inst, {rel: text}))
    assert not r.resolved and rel in r.reason


@pytest.mark.parametrize("code", ["raise SyntaxError(", "import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"])
def test_breaking_collection_or_exiting_at_import_is_unresolved(bug, code):
  root, inst, module, _ = bug
  text = read(root, inst, module)
  r = _grade(root, inst, patch_with(root, inst, {module: code + "\n" + text}))
  assert not r.resolved and r.pass_rate == 0.0, r.reason


def test_exit_zero_after_the_tests_ran_is_caught(bug):
  """The gold fix plus an atexit os._exit(0) would make every test pass and end 0: but pytest's END never
  comes after a forced exit in the middle of the run, and a forced exit at the end loses END too."""
  root, inst, module, _ = bug
  hook = "import atexit, os\natexit.register(lambda: os._exit(0))\n"
  r = _grade(root, inst, patch_with(root, inst, {"__gold__": True, module: hook}))
  assert not r.resolved


def test_planted_report_files_and_forged_pipe_writes_are_unresolved(bug):
  root, inst, module, _ = bug
  fake = json.dumps({t: "passed" for t in inst.FAIL_TO_PASS + inst.PASS_TO_PASS})
  forge = (
    "import os\n"
    "for fd in range(3, 64):\n"
    "  try:\n"
    f"    os.write(fd, b'START\\n' + b''.join(b'{{\"t\": \"test\", \"id\": \"%s\", \"when\": \"call\", \"outcome\": \"passed\"}}\\n' % t.encode() for t in {list(inst.FAIL_TO_PASS)!r}))\n"
    "  except OSError:\n"
    "    pass\n"
  )
  text = read(root, inst, module)
  edits = {"report.json": fake, "junit.xml": "<testsuite failures='0'/>", module: forge + text}
  r = _grade(root, inst, patch_with(root, inst, edits))
  assert not r.resolved, r.reason


MONKEY = """
import _pytest.reports
_orig = _pytest.reports.TestReport.__init__
def _forged(self, *a, **k):
  _orig(self, *a, **k)
  self.outcome = "passed"
_pytest.reports.TestReport.__init__ = _forged
"""


def test_monkeypatching_pytest_from_the_code_under_test_is_caught(bug):
  root, inst, module, _ = bug
  patch = patch_with(root, inst, {module: MONKEY + read(root, inst, module)})
  r = grading.grade(inst, patch, root, CFG)
  assert not r.resolved and r.hack_check and "pytest's internals" in r.reason  # the static check
  r = _grade(root, inst, patch)
  assert not r.resolved and "pytest, pluggy or builtins were changed during the run" in r.reason  # the run's


def test_a_shadowing_pytest_module_or_sitecustomize_does_not_run(bug):
  root, inst, _, _ = bug
  fake = "import os\nos.write(1, b'fake pytest')\nos._exit(0)\n"
  r = _grade(root, inst, patch_with(root, inst, {"pytest.py": fake, "sitecustomize.py": fake}))
  assert not r.resolved and "sitecustomize.py" in r.reason and r.exit_code == 1


def test_the_network_is_unreachable_from_graded_code(bug):
  """A 'fix' that asks a server on this host for the answer would resolve without the network namespace."""
  root, inst, module, _ = bug
  srv = socket.create_server(("127.0.0.1", 0))
  port = srv.getsockname()[1]

  def serve():
    try:
      while True:
        srv.accept()[0].close()
    except OSError:  # closed at the end of the test
      pass

  threading.Thread(target=serve, daemon=True).start()
  probe = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
  try:
    r = _grade(root, inst, patch_with(root, inst, {"__gold__": True, module: probe + read(root, inst, module)}))
  finally:
    srv.close()
  assert not r.resolved and r.pass_rate == 0.0, r.reason


@pytest.mark.slow  # a subprocess
def test_grade_cli_writes_a_swe_bench_report(toy_tasks, tmp_path):
  root, instances = toy_tasks
  inst_path, pred_path, out = tmp_path / "i.jsonl", tmp_path / "p.jsonl", tmp_path / "report.json"
  chosen = instances[:2]
  io.write_instances(str(inst_path), chosen)
  io.write_predictions(
    str(pred_path), [io.Prediction(chosen[0].instance_id, chosen[0].patch), io.Prediction(chosen[1].instance_id, "")]
  )
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  cmd = [
    sys.executable,
    "-m",
    "k2jax.swe.grade",
    f"--instances={inst_path}",
    f"--predictions={pred_path}",
    f"--out={out}",
    f"--task_root={root}",
    "--timeout_s=30",
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(out.read_text())
  assert report["resolved_ids"] == [chosen[0].instance_id] and report["empty_patch_ids"] == [chosen[1].instance_id]
  per = report["instances"][chosen[0].instance_id]
  assert per["resolved"] and set(per["tests_status"]) == {"FAIL_TO_PASS", "PASS_TO_PASS"}
  assert "resolved_rate=0.5000" in proc.stdout
