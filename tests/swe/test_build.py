"""The task builder on the committed toy repository: bugs validate (FAIL_TO_PASS fails before and passes
after the gold patch), the kept tasks have stable F2P and P2P, version diffs carry the changelog entry, and
`launch/swe_build.py` writes a task set the env and the grader read."""

import os
import subprocess
import sys

import pytest

from k2jax.swe import instances as io
from k2jax.swe import snapshot, testrun
from k2jax.sandbox.workspace import prepare_workspace
from tests.swe.conftest import ROOT, RUN, TOY, needs_isolation


def _run(root, inst, patch, tests, tmp_path):
  work = str(tmp_path / inst.instance_id)
  snapshot.copy_tree(inst.snapshot_dir(root), work)
  snapshot.apply_patch(patch, work)
  snapshot.apply_patch(inst.test_patch, work)
  prepare_workspace(work)
  return testrun.run_tests(work, tests, RUN)


def test_bugs_validate_before_and_after_the_gold_patch(toy_tasks, tmp_path):
  root, instances = toy_tasks
  for inst in instances:
    assert 1 <= len(inst.FAIL_TO_PASS) and 1 <= len(inst.PASS_TO_PASS)
    assert not set(inst.FAIL_TO_PASS) & set(inst.PASS_TO_PASS)
    assert not os.path.exists(os.path.join(inst.snapshot_dir(root), ".git"))
    assert snapshot.tree_hash(inst.snapshot_dir(root)) == inst.base_commit
    assert inst.patch and not any(
      snapshot.is_test_path(line[6:]) for line in inst.patch.splitlines() if line.startswith("+++ b/")
    )
    before = _run(root, inst, "", inst.FAIL_TO_PASS, tmp_path / "before")
    assert before.consistent and not any(before.passed(t) for t in inst.FAIL_TO_PASS), inst.instance_id
    after = _run(root, inst, inst.patch, inst.FAIL_TO_PASS + inst.PASS_TO_PASS, tmp_path / "after")
    assert after.exit_code == 0 and all(after.passed(t) for t in inst.FAIL_TO_PASS + inst.PASS_TO_PASS)
  combo = next(i for i in instances if i.kind == "combo")
  assert len(combo.mutations) == 2 and combo.patch.count("diff --git") >= 1
  vd = next(i for i in instances if i.kind == "version_diff")
  assert "stats.mode" in vd.problem_statement and "test_mode" in vd.test_patch
  assert set(vd.FAIL_TO_PASS) == {"tests/test_stats.py::test_mode", "tests/test_stats.py::test_mode_empty"}
  assert "Bug report" in instances[0].problem_statement or "gives wrong results" in instances[0].problem_statement
  assert "+" not in instances[0].problem_statement.split("```")[0]  # the statement never quotes the diff


@pytest.mark.slow  # a subprocess that builds (runs the toy suite ~10 times in the sandbox)
@needs_isolation
def test_launch_swe_build_writes_a_task_set(tmp_path):
  out = tmp_path / "tasks"
  cmd = [
    sys.executable,
    "launch/swe_build.py",
    f"--sources={TOY}",
    f"--out={out}",
    "--max_candidates=4",
    "--max_bugs=1",
    "--combos=0",
    "--runs=2",
    "--timeout_s=30",
  ]
  proc = subprocess.run(
    cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT}
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "version_diff=1" in proc.stdout
  insts = io.read_instances(str(out / "instances.jsonl"))
  rl = io.read_jsonl(str(out / "rl_tasks.jsonl"))
  assert [r["instance_id"] for r in rl] == [i.instance_id for i in insts]
  assert all(r["task_set"] == str(out) and "/testbed" in r["instruction"] for r in rl)


def test_committed_toy_task_set_is_consistent():
  root = os.path.join(ROOT, "data", "swe", "toy_tasks")
  insts = io.read_instances(os.path.join(root, "instances.jsonl"))
  assert {i.kind for i in insts} == {"procedural", "combo", "version_diff"}
  for inst in insts:
    assert snapshot.tree_hash(inst.snapshot_dir(root)) == inst.base_commit
    assert inst.patch.startswith("diff --git") and inst.FAIL_TO_PASS
