"""The trusted test's side of `verify.py`, run as the entry of its own sandbox (standard library only).

The solution runs in another sandbox (`_solution_driver.py`, mode serve): the names the test calls into
the solution are bound here to `Remote` proxies whose calls cross two FIFOs as plain data (`_wire`), so the
test's loops, helpers, randomness and expected values all live in this process, which runs no code of the
solution's. Each case runs under its own deadline (an interval timer raising `Deadline`, a BaseException the
test's own `except Exception` cannot swallow), compiled with optimize=0 (asserts stay, whatever the flags).
Modes (`plan.json`):
  module   exec the trusted `prompt` (HumanEval's helpers), `setup`, `test`; then each case's source
           (`check(candidate)`, or one MBPP assert) in a copy of that namespace
  batch    module mode for many problems in turn (`verify_batch`), each against its own solution's sandbox
  pytest   KodCode: pytest on the trusted test file, `solution` a module of Remote proxies (plugins pytest ships
           only), one case per collected test item
  checker  exec the trusted checker source, then `check(input, output, expected)` per case (no solution
           here: its outputs are data in `cases.json`); a true result passes
Records go to $K2JAX_REPORT_FD: {"ready": ...} first, then {"case": i, "ok": bool, "why": str} per case.
"""

import builtins
import json
import os
import select
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's dir off
import _wire  # noqa: E402
from _wire import Lines, write_all  # noqa: E402

report = os.fdopen(int(os.environ.pop("K2JAX_REPORT_FD")), "w")
plan = json.load(open("plan.json"))
CLASSES = {}


def emit(obj):
  report.write(json.dumps(obj) + "\n")
  report.flush()


class Deadline(BaseException):
  pass


class SolutionError(Exception):
  """The solution's process ended, exited or answered something that is not plain data."""


def _alarm(signum, frame):
  raise Deadline(f"case ran past {plan['case_time_s']}s")


class Channel:
  def __init__(self, chan, startup_s):
    deadline = time.monotonic() + startup_s
    while True:  # a FIFO opened for writing with O_NONBLOCK fails until its reader is there
      try:
        self.req = os.open(os.path.join(chan, "calls"), os.O_WRONLY | os.O_NONBLOCK)
        break
      except OSError:
        if time.monotonic() > deadline:
          raise
        time.sleep(0.002)
    os.set_blocking(self.req, True)
    self.res = os.open(os.path.join(chan, "results"), os.O_RDONLY)  # the solution's driver opens it next
    self.lines = Lines(self.res, plan["max_case_output"])
    self.queue = []
    self.next_id = 0
    self.case = 0

  def call(self, name, args, kwargs):
    self.next_id += 1
    rid = self.next_id
    msg = {"id": rid, "case": self.case, "fn": name}
    msg["args"], msg["kwargs"] = _wire.encode(list(args), CLASSES), _wire.encode(dict(kwargs), CLASSES)
    try:
      write_all(self.req, (json.dumps(msg) + "\n").encode())
    except OSError as e:
      raise SolutionError(f"the solution's process is gone ({e})") from None
    while True:
      while self.queue:
        line = self.queue.pop(0)
        try:
          ans = json.loads(line, parse_int=_wire._parse_int)
        except ValueError:
          continue
        if type(ans) is dict and "stop" in ans and len(ans) == 1:  # the grader's: the solution's sandbox is gone
          self.lines.eof = True
          raise SolutionError(str(ans["stop"])[:200])
        if type(ans) is dict and ans.get("id") == rid:
          return self._result(ans)
      if self.lines.eof:
        raise SolutionError("the solution's process is gone")
      select.select([self.res], [], [])  # the case's interval timer bounds the wait
      try:
        self.queue += self.lines.read()
      except BlockingIOError:
        pass

  def close(self):
    for fd in (self.req, self.res):
      try:
        os.close(fd)
      except OSError:
        pass

  def _result(self, ans):
    if "ok" in ans:
      try:
        return _wire.decode(ans["ok"], CLASSES)
      except (ValueError, TypeError, RecursionError) as e:
        raise SolutionError(f"the solution answered something that is not plain data: {e}") from None
    if "exc" in ans and type(ans["exc"]) is list and len(ans["exc"]) == 2:
      name, text = (str(x)[:300] for x in ans["exc"])
      cls = getattr(builtins, name, None)
      if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, SolutionError):
        try:
          raise cls(text)
        except TypeError:  # an exception type whose constructor wants other arguments
          pass
      raise SolutionError(f"{name}: {text}")
    raise SolutionError(str(ans.get("dead", "the solution answered a malformed line"))[:300])


class Remote:
  """Stands for the solution's function `name`: called with plain data, returns plain data."""

  def __init__(self, channel, name):
    self._channel, self.__name__, self.__qualname__ = channel, name, name

  def __call__(self, *args, **kwargs):
    return self._channel.call(self.__name__, args, kwargs)

  def __repr__(self):
    return f"<the solution's {self.__name__}>"


def run(source, ns, i):
  signal.setitimer(signal.ITIMER_REAL, plan["case_time_s"])
  try:
    exec(compile(source, f"<case {i}>", "exec", dont_inherit=True, optimize=0), ns)
    return True, ""
  except BaseException as e:  # noqa: B036 - a failed assert, the solution's exception, the deadline
    return False, (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:300]
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)


def exec_trusted(source, ns, what):
  exec(compile(source, f"<{what}>", "exec", dont_inherit=True, optimize=0), ns)


def module_mode():
  try:
    channel = Channel(plan["chan"], plan["startup_s"])
  except OSError as e:
    emit({"no_peer": f"the solution's sandbox never connected: {e}"})
    return
  emit({"ready": len(plan["cases"])})
  run_job(plan, channel, {})
  channel.close()


def batch_mode():
  """Many problems' trusted tests, one after another in this process, each against its own solution's sandbox
  (its own FIFO pair): records carry the job's index."""
  emit({"ready": len(plan["jobs"])})
  for k, job in enumerate(plan["jobs"]):
    try:
      channel = Channel(job["chan"], plan["startup_s"])
    except OSError as e:
      emit({"job": k, "no_peer": f"the solution's sandbox never connected: {e}"})
      continue
    run_job(job, channel, {"job": k})
    channel.close()


def run_job(job, channel, tag):
  CLASSES.clear()
  ns = {"__name__": "__main__", "__builtins__": builtins}
  try:
    signal.setitimer(signal.ITIMER_REAL, plan["case_time_s"] * 2)
    for what in ("prompt", "setup"):
      if job.get(what):
        exec_trusted(job[what], ns, what)
    for name in job.get("setup_classes", ()):
      if isinstance(ns.get(name), type):
        CLASSES[name] = ns[name]
    for name in job["remote"]:  # the solution's functions, overriding the prompt's stubs
      ns[name] = Remote(channel, name)
    for alias, name in job.get("bind", {}).items():
      ns[alias] = Remote(channel, name)
    if job.get("test"):
      exec_trusted(job["test"], ns, "test")
    signal.setitimer(signal.ITIMER_REAL, 0)
  except BaseException as e:  # noqa: B036 - the trusted test itself is broken: every case fails, the row's fault
    signal.setitimer(signal.ITIMER_REAL, 0)
    emit({**tag, "test_error": f"{type(e).__name__}: {e}"[:300] + "\n" + traceback.format_exc()[-1500:]})
    return
  for i, source in enumerate(job["cases"]):
    channel.case = i
    ok, why = run(source, dict(ns), i)
    emit({**tag, "case": i, "ok": ok, "why": why})
    if plan["stop_at_first_failure"] and not ok:
      return


def checker_mode():
  cases = json.load(open("cases.json"))
  emit({"ready": len(cases)})
  ns = {"__name__": "checker", "__builtins__": builtins}
  try:
    exec_trusted(plan["checker"], ns, "checker")
    check = ns["check"]
  except BaseException as e:  # noqa: B036
    emit({"test_error": f"checker: {type(e).__name__}: {e}"[:300]})
    return
  for i, case in enumerate(cases):
    signal.setitimer(signal.ITIMER_REAL, plan["case_time_s"])
    try:
      verdict = check(case["input"], case["output"], case["expected"])
      ok, why = verdict is True or (type(verdict) in (int, float) and verdict == 1), ""
      if not ok:
        why = f"the checker said {str(verdict)[:100]}"
    except BaseException as e:  # noqa: B036
      ok, why = False, f"checker: {type(e).__name__}: {e}"[:300]
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
    emit({"case": case["case"], "ok": ok, "why": why})


def pytest_mode():
  """KodCode: the trusted pytest file, `from solution import f` giving Remote proxies; one case per test item."""
  try:
    channel = Channel(plan["chan"], plan["startup_s"])
  except OSError as e:
    emit({"no_peer": f"the solution's sandbox never connected: {e}"})
    return
  emit({"ready": "pytest"})
  os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only the plugins pytest itself ships
  sys.path[:0] = plan["python_paths"]
  import types

  import pytest

  solution = types.ModuleType("solution")

  def remote(name):
    if name.startswith("__"):
      raise AttributeError(name)
    return Remote(channel, name)

  solution.__getattr__ = remote
  sys.modules["solution"] = solution

  class Recorder:
    def __init__(self):
      self.index, self.outcome = {}, {}

    def pytest_collection_modifyitems(self, items):
      self.index = {item.nodeid: i for i, item in enumerate(items)}
      emit({"collected": len(items)})

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
      channel.case = self.index.get(item.nodeid, -1)  # a fresh worker of the solution's per test
      signal.setitimer(signal.ITIMER_REAL, plan["case_time_s"])

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item):
      signal.setitimer(signal.ITIMER_REAL, 0)

    def pytest_runtest_logreport(self, report):
      i = self.index.get(report.nodeid)
      if i is None:
        return
      ok, why = self.outcome.get(i, (True, ""))
      if not ok:
        return
      if report.failed:
        text = str(report.longrepr).strip().splitlines()
        self.outcome[i] = (False, f"{report.when}: {text[-1] if text else 'failed'}"[:300])
      elif report.skipped:
        self.outcome[i] = (False, f"{report.when}: skipped (a skipped test verifies nothing)")
      elif report.when == "call":
        self.outcome[i] = (True, "")

    def pytest_collectreport(self, report):
      if report.failed:
        emit({"collect_error": str(report.longrepr)[-600:]})

  rec = Recorder()
  args = ["test_solution.py", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", os.getcwd(), "-s"]
  with open(os.devnull, "w") as null:
    out, err = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = null
    try:
      pytest.main(args, plugins=[rec])
    finally:
      sys.stdout, sys.stderr = out, err
  for nodeid, i in rec.index.items():
    ok, why = rec.outcome.get(i, (False, "no call phase ran"))
    emit({"case": i, "ok": ok, "why": why, "name": nodeid})


signal.signal(signal.SIGALRM, _alarm)
sys.setrecursionlimit(max(sys.getrecursionlimit(), 3000))
if plan["mode"] == "checker":
  checker_mode()
elif plan["mode"] == "pytest":
  pytest_mode()
elif plan["mode"] == "batch":
  batch_mode()
else:
  module_mode()
report.close()
