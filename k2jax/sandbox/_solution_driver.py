"""The solution's side of `verify.py`, run as the entry of the solution's sandbox (standard library only).

It holds the cases' inputs and never an expected output, and it runs no code of the solution itself: each
case is a forked child (a fresh `__main__`, the compiled solution executed in it) with its own stdin, stdout
and result pipes, CPU limit and wall-clock deadline, killed with its process group when the case ends. The
driver is not dumpable, so a child cannot ptrace it or write its memory; a child that kills it ends the run,
and the cases left without a record fail in the grader. Modes (`plan.json`):
  stdin  case i's input is its stdin; the record carries what it printed (capped)
  call   case i calls `fn_name` (a top-level function or a method of `class Solution`) on its arguments;
         the record carries the result as plain data (`_wire`)
  serve  the trusted test's own sandbox calls functions of the solution through two FIFOs (bound at
         plan["chan"]): one worker child per test case, requests relayed to it and results back as plain data
Records go to $K2JAX_REPORT_FD as JSON lines, after a first {"ready": ...} line written before any case runs.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's dir off
import _wire  # noqa: E402
from _wire import Lines, write_all  # noqa: E402

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36

report = os.fdopen(int(os.environ.pop("K2JAX_REPORT_FD")), "w")
plan = json.load(open("plan.json"))
try:
  _libc = ctypes.CDLL(None)
  _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
  _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # a case's orphans become ours, to kill and reap
except (OSError, AttributeError):
  pass
# Isolated, this driver's parent is PID 1 of the run's own PID namespace: kill(-1) reaches exactly the run's
# other processes. Unisolated (the unsafe mode) it would reach every process of the uid: never used there.
OWN_PID_NAMESPACE = plan.get("isolated") is True and os.getppid() == 1
if plan.get("prelude"):  # the modules a LeetCode-style prelude star-imports, loaded once before any fork
  for _m in ("typing", "collections", "heapq", "bisect", "itertools", "functools", "math", "string", "re"):
    __import__(_m)
CODE, LOAD_ERROR = None, None


def compile_solution():
  """Compiled once here (compiling runs none of its code); a program that does not compile fails every case."""
  global CODE, LOAD_ERROR
  try:
    CODE = compile(open("solution.py").read(), "solution.py", "exec", dont_inherit=True, optimize=0)
  except BaseException as e:  # noqa: B036 - SyntaxError, RecursionError, MemoryError: the program's fault
    LOAD_ERROR = f"{type(e).__name__}: {e}"[:300]


CAP = plan["max_case_output"]
CPU = plan["cpu_s"]
CLASSES = {}


def emit(obj):
  report.write(json.dumps(obj) + "\n")
  report.flush()


def load_module():
  """In a case's child: the solution run as a fresh __main__ (its namespace), or SystemExit/exception."""
  m = types.ModuleType("__main__")
  m.__file__ = "solution.py"
  sys.modules["__main__"] = m
  sys.argv = ["solution.py"]
  if plan.get("prelude"):
    exec(compile(plan["prelude"], "<prelude>", "exec", dont_inherit=True), m.__dict__)
  exec(CODE, m.__dict__)
  for name in plan.get("setup_classes", ()):
    if isinstance(m.__dict__.get(name), type):
      CLASSES[name] = m.__dict__[name]
  return m.__dict__


def entry(ns, name):
  """`name` in the solution: a top-level callable, else a method of a fresh `Solution()` (LeetCode)."""
  sol = ns.get("Solution")
  if isinstance(sol, type) and hasattr(sol, name):
    return getattr(sol(), name)
  if name in ns and callable(ns[name]):
    return ns[name]
  raise NameError(f"the solution defines no function {name!r} (nor a Solution class with that method)")


def end_case(pid):
  """Kills case `pid`'s process group, and isolated every other process but this one (what a case left
  behind, in any session: nothing outlives its case), and reaps them all."""
  for target in (-pid, -1) if OWN_PID_NAMESPACE else (-pid,):
    try:
      os.kill(target, signal.SIGKILL)
    except OSError:
      pass
  status = None
  while True:
    try:
      got, st = os.waitpid(-1, 0)
    except ChildProcessError:
      return status
    if got == pid:
      status = st


def child_setup(keep):
  os.setpgid(0, 0)
  for fd in range(3, 256):
    if fd not in keep:
      try:
        os.close(fd)
      except OSError:
        pass
  resource.setrlimit(resource.RLIMIT_CPU, (CPU, CPU + 1))


def child_exit(status):
  for f in (sys.stdout, sys.stderr):
    try:
      f.flush()
    except BaseException:  # noqa: B036 - a closed or broken stream: the case's own doing
      pass
  os._exit(status)


def exit_status(e):
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code & 0xFF
  try:
    sys.stderr.write(f"{e.code}\n")
  except BaseException:  # noqa: B036
    pass
  return 1


def run_case(i, case_input):
  """Forks case i's child, collects its stdout, result and stderr until it ends or its deadline passes."""
  with open(f"in{i}", "w") as f:
    f.write(case_input if plan["mode"] == "stdin" else "")
  pipes = [os.pipe() for _ in range(3)]  # stdout, result, stderr
  pid = os.fork()
  if pid == 0:
    try:
      (_, w_out), (_, w_res), (_, w_err) = pipes
      fd_in = os.open(f"in{i}", os.O_RDONLY)
      os.dup2(fd_in, 0)
      os.dup2(w_out, 1)
      os.dup2(w_err, 2)
      child_setup({w_res})
    except BaseException:  # noqa: B036
      os._exit(125)
    status = 0
    try:
      ns = load_module()
      if plan["mode"] == "call":
        args = _wire.decode(case_input, CLASSES)
        result = entry(ns, plan["fn_name"])(*args)
        line = (_wire.dumps(result, CLASSES) + "\n").encode()
        view = memoryview(line)
        while view:
          view = view[os.write(w_res, view) :]
    except SystemExit as e:
      status = exit_status(e)
    except BaseException:  # noqa: B036 - the case crashed: its traceback is its stderr
      status = 1
      try:
        traceback.print_exc()
      except BaseException:  # noqa: B036
        pass
    child_exit(status)
  for _, w in pipes:
    os.close(w)
  start = time.monotonic()
  deadline = start + plan["case_time_s"]
  bufs = {r: bytearray() for r, _ in pipes}
  caps = {pipes[0][0]: CAP, pipes[1][0]: CAP, pipes[2][0]: 2000}
  pidfd = os.pidfd_open(pid)
  open_fds = set(bufs)
  timed_out = over = False
  exited = False
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      timed_out = not exited
      break
    if exited:  # the case is its main process: once it ends, take what is already written, nothing more
      left = 0
    ready, _, _ = select.select([*open_fds, *([] if exited else [pidfd])], [], [], left)
    if exited and not ready:
      break
    for fd in ready:
      if fd == pidfd:
        exited = True
        continue
      chunk = os.read(fd, 65536)
      if not chunk:
        open_fds.discard(fd)
        continue
      if fd == pipes[2][0]:
        bufs[fd] = (bufs[fd] + chunk)[-caps[fd] :]  # stderr: the tail says why
      else:
        bufs[fd] += chunk
        if len(bufs[fd]) > caps[fd]:
          over = True
    if over or (exited and not open_fds):
      break
  elapsed = time.monotonic() - start
  st = end_case(pid)
  os.close(pidfd)
  for r, _ in pipes:
    os.close(r)
  os.unlink(f"in{i}")
  rec = {"case": i, "time": round(elapsed, 4), "timeout": timed_out, "over": over}
  if os.WIFSIGNALED(st):
    rec["signal"] = os.WTERMSIG(st)
  else:
    rec["exit"] = os.WEXITSTATUS(st)
  rec["out"] = bytes(bufs[pipes[0][0]][: CAP + 1]).decode("utf-8", "replace")
  rec["res"] = bytes(bufs[pipes[1][0]][: CAP + 1]).decode("utf-8", "replace")
  rec["err"] = bytes(bufs[pipes[2][0]]).decode("utf-8", "replace")
  return rec


def failed(rec):
  return rec["timeout"] or rec["over"] or rec.get("exit") != 0


def run_cases():
  inputs = json.load(open("inputs.json"))
  emit({"ready": len(inputs)})
  compile_solution()
  if LOAD_ERROR is not None:
    emit({"load_error": LOAD_ERROR})
    return
  for i, case_input in enumerate(inputs):
    rec = run_case(i, case_input)
    emit(rec)
    if plan["stop_at_first_failure"] and failed(rec):
      emit({"stopped": i})
      return


def serve():
  """Relays the test's calls to one worker per test case; the worker answers as plain data."""
  chan = plan["chan"]
  calls = Lines(os.open(os.path.join(chan, "calls"), os.O_RDONLY), CAP)  # blocks until the test connects
  results = os.open(os.path.join(chan, "results"), os.O_WRONLY)
  signal.signal(signal.SIGPIPE, signal.SIG_IGN)
  emit({"ready": "serve"})
  compile_solution()
  worker = None  # [case, pid, to-worker fd, Lines from the worker, pending request id]

  def stop(w):
    end_case(w[1])
    os.close(w[2])
    os.close(w[3].fd)

  def start(case):
    r_req, w_req = os.pipe()
    r_res, w_res = os.pipe()
    pid = os.fork()
    if pid == 0:
      try:
        fd_null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
          os.dup2(fd_null, fd)
        child_setup({r_req, w_res})
      except BaseException:  # noqa: B036
        os._exit(125)
      worker_loop(r_req, w_res)
    os.close(r_req)
    os.close(w_res)
    return [case, pid, w_req, Lines(r_res, CAP), None]

  try:
    while not calls.eof:
      ready, _, _ = select.select([calls.fd, *([worker[3].fd] if worker else [])], [], [])
      if worker is not None and worker[3].fd in ready:
        for line in worker[3].read():
          write_all(results, line)
          worker[4] = None
        if worker[3].eof:
          if worker[4] is not None:
            write_all(results, (json.dumps({"id": worker[4], "dead": "the solution's process ended"}) + "\n").encode())
          stop(worker)
          worker = None
      if calls.fd in ready:
        for line in calls.read():
          req = json.loads(line)
          if "stop" in req:  # the grader's: the test's sandbox could not start
            return
          if worker is None or worker[0] != req["case"]:
            if worker is not None:
              stop(worker)
            worker = start(req["case"])
          worker[4] = req["id"]
          try:
            write_all(worker[2], line)
          except OSError:
            pass  # the worker is gone: its EOF answers the request
  finally:
    if worker is not None:
      stop(worker)


def worker_loop(r_req, w_res):
  """One test case's worker: load the solution, then answer each call with its result or exception."""
  reader = os.fdopen(r_req, "rb")

  def answer(obj):
    data = (json.dumps(obj) + "\n").encode()
    view = memoryview(data)
    while view:
      view = view[os.write(w_res, view) :]

  ns, why = None, LOAD_ERROR
  if CODE is not None:
    try:
      ns = load_module()
    except SystemExit as e:
      why = f"the solution exited while loading (status {exit_status(e)})"
    except BaseException as e:  # noqa: B036
      why = f"{type(e).__name__}: {e}"[:300]
  while True:
    line = reader.readline()
    if not line:
      os._exit(0)
    req = json.loads(line)
    if ns is None:
      answer({"id": req["id"], "exc": ["RuntimeError", f"the solution did not load: {why}"]})
      continue
    try:
      fn = ns[req["fn"]] if req["fn"] in ns else entry(ns, req["fn"])
      args = _wire.decode(req["args"], CLASSES)
      kwargs = _wire.decode(req["kwargs"], CLASSES)
      out = {"id": req["id"], "ok": _wire.encode(fn(*args, **kwargs), CLASSES)}
    except SystemExit as e:
      out = {"id": req["id"], "exc": ["SystemExit", f"the solution called exit({exit_status(e)})"]}
    except BaseException as e:  # noqa: B036 - the solution's exception crosses as its type name and text
      out = {"id": req["id"], "exc": [type(e).__name__, str(e)[:300]]}
    try:
      answer(out)
    except (TypeError, ValueError, RecursionError) as e:
      answer({"id": req["id"], "exc": ["TypeError", f"unencodable result: {e}"[:300]]})


if plan["mode"] == "serve":
  serve()
else:
  run_cases()
report.close()
