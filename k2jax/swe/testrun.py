"""Run a repository's pytest tests in the sandbox and read per-test outcomes from a channel the code under
test cannot forge by accident or by plan the way a log or a junit file can be.

The harness (an entry file run by `sandbox.workspace.run_entry` as `python -I -S`, so neither PYTHONPATH,
sitecustomize nor .pth files of the repository apply) does, in order:
1. takes the report pipe ($K2JAX_REPORT_FD) and a random per-run nonce, deletes its own file (the nonce
   leaves the filesystem), puts only the read-only test tools on sys.path and imports pytest from there
   (a `pytest.py` the repository adds cannot shadow it), writes `START`;
2. only then puts /testbed on sys.path and runs `pytest.main` with plugin autoloading off and a reporter
   plugin that writes one nonce-tagged JSON record per test phase and collection error, then `END <exit>`.
Here every line must carry the nonce (anything else on the pipe is tampering: the run counts as failed),
START must come (else it is an infrastructure failure: pytest never ran), END must come and agree with the
process's exit status (`os._exit(0)` or `sys.exit(0)` from the code under test, a crash, a timeout: no
agreement), and a test is passed only with a passing record. Residual risk, as in SWE-bench: the code under
test runs in the same process as pytest and could in principle find the nonce in memory; it cannot find it
on disk, in the environment or in the repository.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Sequence

from k2jax.sandbox.runner import SandboxUnavailable
from k2jax.sandbox.workspace import WorkspaceRunConfig, run_entry

PASSED = ("passed", "xfailed", "xpassed")  # SWE-bench: XFAIL counts as passed


@dataclasses.dataclass(frozen=True)
class TestRun:
  outcomes: dict[str, str]  # node id -> passed | failed | skipped | xfailed | xpassed | error
  collect_errors: tuple[str, ...]  # node ids (files) that failed to collect
  exit_code: int
  started: bool  # pytest was imported and began (False: an infrastructure failure)
  ended: bool  # the reporter wrote END
  end_code: int | None  # pytest's exit status as the reporter saw it
  tampered: bool  # a line without the nonce reached the report pipe
  timed_out: bool
  output: str  # the end of pytest's console output
  elapsed_s: float

  @property
  def consistent(self) -> bool:
    """pytest finished, its own exit status is the process's, and nothing forged records."""
    return self.started and self.ended and self.end_code == self.exit_code and not self.tampered

  def passed(self, node_id: str) -> bool:
    return self.consistent and self.outcomes.get(node_id) in PASSED


class InfraError(RuntimeError):
  """The tests could not be run at all (sandbox unavailable, pytest missing): masked, never scored."""


def run_tests(
  workspace: str, test_ids: Sequence[str] = (), config: WorkspaceRunConfig = WorkspaceRunConfig()
) -> TestRun:
  """Runs `test_ids` (all of the repository's tests when empty) of the tree at `workspace`."""
  nonce = secrets.token_hex(16)
  args = ["-p", "no:cacheprovider", "-q", "--continue-on-collection-errors", "-o", "addopts=", "--rootdir=/testbed"]
  try:
    import pytest_timeout  # noqa: F401  (the per-test deadline, when installed with the test tools)

    args += ["-p", "pytest_timeout", f"--timeout={max(1, int(config.timeout_s))}"]
  except ImportError:
    pass
  spec = json.dumps({"nonce": nonce, "args": args + list(test_ids)})
  try:
    r = run_entry({"harness.py": _HARNESS.replace("SPEC", json.dumps(spec))}, "harness.py", workspace, config)
  except SandboxUnavailable as e:
    raise InfraError(str(e)) from None
  run = _parse(r.report, nonce, r.returncode, r.timed_out, (r.stdout + r.stderr)[-6000:], r.elapsed_s)
  if not run.started:
    raise InfraError(f"pytest did not start in the sandbox ({r.reason}): {(r.stderr or r.stdout)[-500:]}")
  return run


def _parse(report: str, nonce: str, code: int, timed_out: bool, output: str, elapsed: float) -> TestRun:
  outcomes: dict[str, str] = {}
  collect_errors, started, end_code, tampered = [], False, None, False
  for line in report.splitlines():
    tag, _, body = line.partition(" ")
    if tag != nonce:
      tampered = True
      continue
    if body == "START":
      started = True
      continue
    if body.startswith("END "):
      end_code = int(body.split()[1])
      continue
    try:
      rec = json.loads(body)
    except json.JSONDecodeError:  # cut short (the report cap) or garbled: no verdict from this run
      tampered = True
      continue
    if rec["t"] == "collect":
      collect_errors.append(rec["id"])
    else:
      outcomes[rec["id"]] = _merge(outcomes.get(rec["id"]), rec)
  return TestRun(
    outcomes, tuple(collect_errors), code, started, end_code is not None, end_code, tampered, timed_out, output, elapsed
  )


def _merge(prev: str | None, rec: dict) -> str:
  """One test's outcome over its setup/call/teardown records: any failure fails it."""
  when, outcome = rec["when"], rec["outcome"]
  if prev in ("failed", "error"):
    return prev
  if outcome == "failed":
    return "failed" if when == "call" else "error"
  if outcome == "skipped":
    return "xfailed" if rec.get("xfail") else "skipped"
  if when == "call":
    return "xpassed" if rec.get("xfail") else "passed"
  return prev or ("pending" if when == "setup" else "passed")


_HARNESS = r'''
import json, os, sys
spec = json.loads(SPEC)
nonce = spec["nonce"]
out = os.fdopen(int(os.environ.pop("K2JAX_REPORT_FD")), "w", buffering=1)
os.unlink(__file__)
tools = os.environ["K2JAX_PYTHONPATH"].split(os.pathsep)[1:]
testbed = os.environ["K2JAX_TESTBED"]
sys.path[:0] = tools
os.environ.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONDONTWRITEBYTECODE="1", HOME=os.environ["HOME"])
os.environ.update(json.loads(os.environ["K2JAX_ENV"]))
import pytest, _pytest.config, pluggy  # noqa: E401  (from the read-only tools, before the repository is on the path)
emit = lambda text: out.write(nonce + " " + text + "\n")
emit("START")


def fingerprint():
    """Identity of every function and class (and class member) of pytest and pluggy: the code under test
    runs in this process and could monkeypatch the machinery that decides outcomes."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.split(".")[0] in ("_pytest", "pytest", "pluggy"):
            continue
        for key, val in list(vars(mod).items()):
            if callable(val):
                out[(name, key)] = id(val)
                if isinstance(val, type):
                    for k2, v2 in list(vars(val).items()):
                        out[(name, key, k2)] = id(v2)
    return out


class Reporter:
    before = None

    def pytest_sessionstart(self, session):
        Reporter.before = fingerprint()

    def pytest_sessionfinish(self, session):  # before pytest's own cleanup undoes its plugins' setattrs
        Reporter.after = fingerprint()

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and report.passed:
            return  # a passing setup/teardown adds nothing to the call's record (keeps the report small)
        rec = {"t": "test", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
               "xfail": bool(getattr(report, "wasxfail", None) is not None)}
        emit(json.dumps(rec))

    def pytest_collectreport(self, report):
        if report.failed:
            emit(json.dumps({"t": "collect", "id": report.nodeid or "<session>"}))


os.environ.pop("K2JAX_ENV", None)
sys.path.insert(0, testbed)
os.chdir(testbed)
code = int(pytest.main(spec["args"], plugins=[Reporter()]))
after = getattr(Reporter, "after", None) or {}
if Reporter.before is None or any(after.get(k) != v for k, v in Reporter.before.items()):
    out.write("TAMPERED %s\n" % [k for k, v in Reporter.before.items() if after.get(k) != v][:20])
emit("END %d" % code)
out.flush()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
'''
