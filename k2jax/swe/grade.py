"""Grading a patch in a fresh sandbox from the diff alone, closing every known reward hack.

  python -m k2jax.swe.grade --instances=I.jsonl --predictions=P.jsonl --out=REPORT.json [--task_root=DIR]

For one (instance, patch):
1. check the pristine snapshot still hashes to `base_commit` (else: infrastructure failure, masked);
2. copy it to a new temp dir (no .git anywhere: there is no history to read the fix from) and apply the
   patch with `git apply`, then `patch` (SWE-bench's order); a patch that does not apply is unresolved;
   the static hack check (`hackcheck.py`) reads the patch's added non-test lines: introspection of the
   interpreter or the test machinery (frames, gc, sys.modules, __main__, pytest/pluggy internals, ctypes,
   tracing hooks, os._exit, always-equal objects) is unresolved, the findings in `hack_check`;
3. restore every test file, conftest file and test configuration (pytest.ini, tox.ini, setup.cfg,
   pyproject.toml, *.pth, sitecustomize) from the pristine copy, deleting any the patch added, then apply
   the instance's `test_patch` (hidden tests of version-diff tasks): edited, deleted, skipped or forged
   tests are gone before anything runs;
4. delete compiled caches (a planted `__pycache__` is not the source), hash the test files, run
   FAIL_TO_PASS + PASS_TO_PASS in the sandbox (no network, rlimits, a deadline) with outcomes read from
   the nonce-tagged report pipe and the harness's checks of pytest's plugins, hooks and test functions
   (`testrun.py`: not a file the patch can plant, not a log it can print into), require pytest's exit
   status to be the process's and 0, and the test files to hash as before; any tampering is unresolved,
   named in `tampering` and `reason`;
5. SWE-bench's rules: a missing or skipped FAIL_TO_PASS test fails; a skipped PASS_TO_PASS test is kept.
`GradeConfig(rules="swebench")` grades a published SWE-bench row as the SWE-bench harness does instead
(`harness.py`): only the files `test_patch` touches are restored in step 3 (a package's `testing/` module is
source the model may fix; the hack check reads every other file the patch adds lines to), the whole files
`test_patch` names run, and the names are matched in the report as the harness's log parser reads them (a
parametrized id cut at a space included); other tests of those files may fail (no exit status 0 asked).
`resolved` (0/1) is the reward; `pass_rate` (K2: FAIL_TO_PASS share passing x [all PASS_TO_PASS pass]) is
logged beside it. A run that could not happen (sandbox unavailable, pytest absent, broken task data) is
`infra_failure`: masked from the loss, never scored 0.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence

from k2jax.sandbox.workspace import WorkspaceRunConfig, default_python_paths, prepare_workspace
from k2jax.swe import hackcheck, harness, snapshot
from k2jax.swe.instances import Instance, InstanceReport, Prediction, summary
from k2jax.swe.testrun import InfraError, TestRun, run_tests


@dataclasses.dataclass(frozen=True)
class GradeConfig:
  run: WorkspaceRunConfig = WorkspaceRunConfig(timeout_s=300.0)  # SWE-bench/R2E-Gym: 300 s of tests
  check_snapshot: bool = True  # re-hash the pristine snapshot against base_commit before grading
  hack_check: bool = True  # the static check of the patch's added lines (off only to test the runtime layers)
  # "k2jax": k2jax's offline tasks (every test path restored, FAIL_TO_PASS + PASS_TO_PASS node ids run, exit 0);
  # "swebench": the SWE-bench harness's (published rows: test_patch's files restored and run whole, harness.py)
  rules: str = "k2jax"

  def __post_init__(self):
    if self.rules not in ("k2jax", "swebench"):
      raise ValueError(f"GradeConfig.rules: {self.rules!r} is not 'k2jax' or 'swebench'")


def grade(instance: Instance, patch: str | None, task_root: str, config: GradeConfig = GradeConfig()) -> InstanceReport:
  """Grades `patch` (a unified diff, '' or None for none) against `instance`."""
  t0 = time.monotonic()
  report = _Report(instance)
  if patch is None or not patch.strip():
    return report.done(patch_is_None=patch is None, exists=False, reason="no patch", t0=t0)
  pristine = instance.snapshot_dir(task_root)
  if not os.path.isdir(pristine):
    return report.done(infra=True, reason=f"snapshot {pristine!r} is missing", t0=t0)
  if config.check_snapshot and snapshot.tree_hash(pristine) != instance.base_commit:
    return report.done(infra=True, reason=f"snapshot {pristine!r} does not hash to base_commit", t0=t0)
  with tempfile.TemporaryDirectory(prefix="k2jax-swe-grade-") as tmp:
    work = os.path.join(tmp, "repo")
    snapshot.copy_tree(pristine, work)
    try:
      snapshot.apply_patch(patch, work)
    except snapshot.PatchError as e:
      return report.done(reason=str(e)[:500], t0=t0)
    harness_rules = config.rules == "swebench"
    if harness_rules:  # what grading restores is what the hack check may leave alone
      edited, created = harness.patch_files(instance.test_patch)
      restores = set(edited + created).__contains__
    else:
      restores = snapshot.is_test_path
    findings = [str(f) for f in hackcheck.check_patch(patch, work, restores)] if config.hack_check else []
    if findings:
      why = f"unresolved: the hack check flags {len(findings)} added lines: " + "; ".join(findings[:3])
      return report.done(applied=True, reason=why[:1000], hack_check=findings, t0=t0)
    try:
      if harness_rules:
        restored = harness.restore_test_patch_files(pristine, work, instance.test_patch)
      else:
        restored = snapshot.restore_tests(pristine, work)
    except ValueError as e:  # the patch made a directory on a test file's path a link
      return report.done(applied=True, reason=f"unresolved: {e}"[:500], t0=t0)
    try:
      snapshot.apply_patch(instance.test_patch, work)
    except snapshot.PatchError as e:
      return report.done(applied=True, infra=True, reason=f"the instance's test_patch does not apply: {e}"[:500], t0=t0)
    _drop_caches(work)
    tests_before = _test_hashes(work)
    prepare_workspace(work)
    try:
      changed = sorted(hackcheck.added_lines(patch))
      if harness_rules:  # whole files, as the harness's test command takes them
        ids = tuple(harness.test_directives(instance.test_patch))
      else:
        ids = (*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS)
      run = run_tests(work, ids, config.run, changed)
    except InfraError as e:
      return report.done(applied=True, infra=True, reason=str(e)[:500], t0=t0)
    now = _test_hashes(work)
    touched = sorted(k for k in set(tests_before) | set(now) if tests_before.get(k) != now.get(k))
  outside = [f"test files changed during the run: {touched[:5]}"] if touched else []
  if harness_rules:
    return report.from_harness(run, restored, t0, outside)
  return report.from_run(run, restored, t0, outside)


def _drop_caches(root: str) -> None:
  """Compiled caches come from the patch, never from the source: pytest would load a planted one."""
  for d, dirs, names in os.walk(root):
    for n in dirs:
      if n == "__pycache__":
        shutil.rmtree(os.path.join(d, n))
    dirs[:] = [n for n in dirs if n != "__pycache__"]
    for n in names:
      if n.endswith(snapshot.SKIP_SUFFIXES):
        os.unlink(os.path.join(d, n))


def _test_hashes(root: str) -> dict[str, str]:
  """sha256 of every test path (tests, conftest files, test configuration) under `root`."""
  out = {}
  for rel in snapshot.walk_files(root):
    if snapshot.is_test_path(rel):
      p = os.path.join(root, rel)
      data = os.readlink(p).encode() if os.path.islink(p) else open(p, "rb").read()
      out[rel] = hashlib.sha256(data).hexdigest()
  return out


def grade_all(
  instances: Sequence[Instance],
  predictions: Sequence[Prediction],
  task_root: str,
  config: GradeConfig,
  workers: int = 0,
) -> list[InstanceReport]:
  by_id = {i.instance_id: i for i in instances}
  unknown = [p.instance_id for p in predictions if p.instance_id not in by_id]
  if unknown:
    raise ValueError(f"predictions for unknown instances: {unknown[:10]}")
  n = workers or os.cpu_count() or 1
  with concurrent.futures.ThreadPoolExecutor(n) as pool:  # each grade waits on its own sandbox process
    return list(pool.map(lambda p: grade(by_id[p.instance_id], p.model_patch, task_root, config), predictions))


class _Report:
  def __init__(self, instance: Instance):
    self.i = instance

  def done(self, *, patch_is_None=False, exists=True, applied=False, infra=False, reason="", hack_check=(), t0=0.0):
    status = {k: {"success": [], "failure": list(v)} for k, v in self._lists().items()}
    took = time.monotonic() - t0
    return InstanceReport(
      self.i.instance_id, patch_is_None, exists, applied, False, infra, status, 0.0, reason, None, took,
      list(hack_check),
    )  # fmt: skip

  def from_run(self, run: TestRun, restored: list[str], t0: float, outside: list[str] = ()) -> InstanceReport:
    status = {}
    for key, tests in self._lists().items():
      ok = [
        t
        for t in tests
        if run.passed(t) or (key == "PASS_TO_PASS" and run.consistent and run.outcomes.get(t) == "skipped")
      ]
      status[key] = {"success": ok, "failure": [t for t in tests if t not in ok]}
    tampering = [*outside, *run.tamper]  # what was checked outside the sandbox first
    trusted = run.consistent and not outside
    f2p_ok, p2p_ok = len(status["FAIL_TO_PASS"]["success"]), not status["PASS_TO_PASS"]["failure"]
    resolved = trusted and run.exit_code == 0 and p2p_ok and f2p_ok == len(self.i.FAIL_TO_PASS)
    pass_rate = f2p_ok / len(self.i.FAIL_TO_PASS) * float(p2p_ok) if trusted else 0.0
    reason = f"unresolved: tampering: {'; '.join(tampering[:5])}" if tampering else _why(run, status, resolved)
    if restored:
      reason += f"; restored from pristine: {restored[:5]}"
    return InstanceReport(
      self.i.instance_id, False, True, True, resolved, False, status, pass_rate, reason, run.exit_code,
      time.monotonic() - t0, [], tampering, {}, run.timed_out,
    )  # fmt: skip

  def from_harness(self, run: TestRun, restored: list[str], t0: float, outside: list[str] = ()) -> InstanceReport:
    """The SWE-bench harness's verdict on the run (harness.py), on a run nothing tampered with."""
    sm = harness.status_map(run.outcomes, self.i.repo) if run.consistent else {}
    status = harness.tests_status(self.i.FAIL_TO_PASS, self.i.PASS_TO_PASS, sm)
    tampering = [*outside, *run.tamper]
    missing = "" if not run.consistent else harness.no_results(sm, run.exit_code)
    trusted = run.consistent and not outside and not missing
    f2p_ok, p2p_ok = len(status["FAIL_TO_PASS"]["success"]), not status["PASS_TO_PASS"]["failure"]
    resolved = trusted and p2p_ok and f2p_ok == len(self.i.FAIL_TO_PASS)
    pass_rate = f2p_ok / len(self.i.FAIL_TO_PASS) * float(p2p_ok) if trusted else 0.0
    skips = harness.skipped(self.i.FAIL_TO_PASS, self.i.PASS_TO_PASS, sm)
    if tampering:
      reason = f"unresolved: tampering: {'; '.join(tampering[:5])}"
    elif missing or run.reason:
      reason = f"unresolved: {missing or run.reason}"
    else:
      reason = _why(run, status, resolved)
    if skips["FAIL_TO_PASS"] or skips["PASS_TO_PASS"]:
      reason += (
        f"; skipped, as SWE-bench counts them: {len(skips['FAIL_TO_PASS'])} FAIL_TO_PASS (failed), "
        f"{len(skips['PASS_TO_PASS'])} PASS_TO_PASS (kept)"
      )
    if restored:
      reason += f"; restored from base_commit: {restored[:5]}"
    return InstanceReport(
      self.i.instance_id, False, True, True, resolved, False, status, pass_rate, reason, run.exit_code,
      time.monotonic() - t0, [], tampering, skips, run.timed_out,
    )  # fmt: skip

  def _lists(self) -> dict[str, tuple[str, ...]]:
    return {"FAIL_TO_PASS": self.i.FAIL_TO_PASS, "PASS_TO_PASS": self.i.PASS_TO_PASS}


def _why(run: TestRun, status: dict, resolved: bool) -> str:
  if resolved:
    return "resolved: every FAIL_TO_PASS and PASS_TO_PASS test passed"
  if run.reason:
    return f"unresolved: {run.reason}"
  failed = status["FAIL_TO_PASS"]["failure"] + status["PASS_TO_PASS"]["failure"]
  missing = [t for t in failed if t not in run.outcomes]
  return f"unresolved: {len(failed)} tests failed ({len(missing)} missing), exit {run.exit_code}: {failed[:3]}"


def main(argv) -> None:  # the absl entry of `python -m k2jax.swe.grade`
  from absl import flags

  from k2jax.swe.instances import read_instances, read_predictions

  f = flags.FLAGS
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {argv[1:]}")
  instances = read_instances(f.instances)
  predictions = read_predictions(f.predictions)
  root = f.task_root or os.path.dirname(os.path.abspath(f.instances))
  run = WorkspaceRunConfig(timeout_s=f.timeout_s, python_paths=default_python_paths())
  reports = grade_all(instances, predictions, root, GradeConfig(run=run), f.workers)
  out = summary(reports, [i.instance_id for i in instances])
  tmp = f.out + ".tmp"
  with open(tmp, "w") as fh:
    json.dump(out, fh, indent=1, sort_keys=True)
  os.replace(tmp, f.out)
  print(json.dumps({k: out[k] for k in ("resolved_instances", "unresolved_instances", "infra_failure_instances")}))
  print(f"resolved_rate={out['resolved_rate']:.4f} pass_rate_mean={out['pass_rate_mean']:.4f} report={f.out}")


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_string(
    "instances", None, "SWE-bench-style instances JSONL (k2jax-built: with snapshots).", required=True
  )
  flags.DEFINE_string(
    "predictions", None, "Predictions JSONL: instance_id, model_name_or_path, model_patch.", required=True
  )
  flags.DEFINE_string(
    "out", None, "Report JSON to write (SWE-bench run summary + per-instance reports).", required=True
  )
  flags.DEFINE_string("task_root", "", "Directory the instances' snapshot paths are relative to ('' = the file's).")
  flags.DEFINE_float("timeout_s", 300.0, "Test deadline per instance.")
  flags.DEFINE_integer("workers", 0, "Instances graded at once (0 = CPU count).")
  app.run(main)
