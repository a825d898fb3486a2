"""One code verifier for the published test formats: `verify(code, row)` reads a dataset row by its own fields.

`k2jax.sandbox.formats.parse_row` reads a row by its own field names (APPS/TACO/DeepCoder `input_output`,
LiveCodeBench `public_test_cases`/`private_test_cases`, CodeContests `public_tests`/..., HumanEval `test` +
`entry_point`, MBPP `test_list`, KodCode's pytest `test`, an optional trusted `checker`); the formats are
listed there. This module runs a Problem's cases in the sandbox and compares what they printed or returned.

How cases run (`_solution_driver.py`, `_test_driver.py`):
- stdin and call cases: ONE sandbox launch per program, holding the inputs and never an expected output;
  its driver forks each case (fresh `__main__`, CPU limit, deadline `case_time_s`, output cap) and reports
  what the case printed or returned. Everything is compared HERE, in the grader's process: the expected
  outputs never enter the solution's process.
- trusted test code (HumanEval's check with its loops, helpers and `random`; MBPP's asserts after their setup
  code): in its OWN sandbox, separate from the solution's. The names it calls into the solution are proxies
  whose calls cross two FIFOs as plain data (`_wire`: no object, so no always-equal `__eq__`, can cross), one
  worker process per case on the solution's side. The verdict is written by the test's process, which runs
  no code of the solution's: nothing the solution does reaches it.
- a checker runs in a sandbox of its own on the outputs (data) of the cases that ran cleanly.

Comparison (`CodeRewardConfig.compare`): `k2jax.sandbox.compare`.

Verdicts: `Graded.reward` is the share of cases passed (every case in the denominator: a crash, a timeout,
`sys.exit` before the answer, an over-long output each fail their own case), or with
`stop_at_first_failure` 1.0 only when all pass (cases after a crash or timeout are not run). A sandbox that
could not start at all is an infrastructure error: reward NaN (the RL batch masks it), `info["infra_error"]`
says why; never a 0. A malformed row raises ValueError naming the field.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from k2jax.sandbox import _wire, runner
from k2jax.sandbox.code import CodeRewardConfig, Graded
from k2jax.sandbox.compare import COMPARE_MODES, compare_output, values_equal
from k2jax.sandbox.formats import Problem, parse_row
from k2jax.sandbox.runner import SandboxResult, SandboxUnavailable, run_python
from k2jax.sandbox.workspace import default_python_paths

_HERE = pathlib.Path(__file__).parent
_WIRE = (_HERE / "_wire.py").read_text()
_SOLUTION_DRIVER = (_HERE / "_solution_driver.py").read_text()
_TEST_DRIVER = (_HERE / "_test_driver.py").read_text()
_CHAN_MOUNT = "/k2jax-chan"
_STARTUP_S = 20.0  # how long the test's sandbox waits for the solution's to connect
# What call-based (LeetCode-style) code may use unimported, like LiveCodeBench's own import prelude: `List`,
# `Optional`, `defaultdict`, `heappush`, `bisect_left`, `accumulate`, `lru_cache`, the modules themselves.
CALL_PRELUDE = (
  "from typing import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\n"
  "from itertools import *\nfrom functools import *\nimport math, string, re, collections, heapq, bisect, itertools, "
  "functools\n"
)
_SOLUTION_PROCESSES = 16  # the driver and a case's process and threads (competitive code's deep-recursion thread)


# ---- running ---------------------------------------------------------------------------------------------
def verify(code: str, row: Mapping[str, Any] | Problem, config: CodeRewardConfig = CodeRewardConfig()) -> Graded:
  """The verdict on program `code` against the tests of `row` (a dataset row, or a parsed Problem)."""
  if config.compare not in COMPARE_MODES:
    raise ValueError(f"CodeRewardConfig.compare: {config.compare!r} is not one of {COMPARE_MODES}")
  problem = row if isinstance(row, Problem) else parse_row(row)
  try:
    if problem.kind in ("module", "pytest"):
      outcomes, info = _run_module(code, problem, config)
    else:
      outcomes, info = _run_cases(code, problem, config)
  except _Infra as e:
    return _infra_graded(e)
  return _graded(problem, outcomes, info, config)


def _infra_graded(e: Exception) -> Graded:
  return Graded(math.nan, f"infrastructure error (masked, not a verdict): {e}", {"infra_error": str(e)})


def _graded(problem: Problem, outcomes: list[tuple[bool, str]], info: dict, config: CodeRewardConfig) -> Graded:
  passed = sum(ok for ok, _ in outcomes)
  total = len(outcomes)  # every case the row defines (pytest: every test collected, at least every def test_)
  failures = [(i, why) for i, (ok, why) in enumerate(outcomes) if not ok]
  if config.stop_at_first_failure:
    reward = 1.0 if passed == total else 0.0
  else:
    reward = passed / total
  reason = f"{passed}/{total} tests passed" + (f"; test {failures[0][0]}: {failures[0][1]}" if failures else "")
  return Graded(
    reward, reason, {**info, "format": problem.source, "passed": passed, "total": total, "outcomes": outcomes}
  )


def verify_batch(
  jobs: Sequence[tuple[str, Mapping[str, Any] | Problem]],
  config: CodeRewardConfig = CodeRewardConfig(),
  max_workers: int = 4,
) -> list[Graded]:
  """`verify` over (code, row) pairs, in order, `max_workers` solution sandboxes at once. Every row is parsed
  first, so a malformed one raises before any program runs. HumanEval/MBPP-style rows share ONE test sandbox
  (their trusted tests run one after another in it, each against its own solution's sandbox, which sees only
  its own FIFO pair): one launch per sample instead of two. Solutions never share a sandbox."""
  if config.compare not in COMPARE_MODES:
    raise ValueError(f"CodeRewardConfig.compare: {config.compare!r} is not one of {COMPARE_MODES}")
  parsed = [(code, row if isinstance(row, Problem) else parse_row(row)) for code, row in jobs]
  out: list[Graded | None] = [None] * len(parsed)
  module = [i for i, (_, p) in enumerate(parsed) if p.kind == "module"]
  rest = [i for i in range(len(parsed)) if i not in set(module)] if len(module) > 1 else list(range(len(parsed)))
  with concurrent.futures.ThreadPoolExecutor(max(1, max_workers)) as pool:
    if len(module) > 1:
      for i, g in zip(module, _run_module_batch([parsed[i] for i in module], config, pool), strict=True):
        out[i] = g
    for i, g in zip(rest, pool.map(lambda i: verify(parsed[i][0], parsed[i][1], config), rest), strict=True):
      out[i] = g
  return out  # type: ignore[return-value]


class _Infra(Exception):
  """A sandbox that could not start at all: no verdict on the program."""


def _sandbox_for(config: CodeRewardConfig, n: int, files_bytes: int, processes: int, binds=()):
  sb = config.sandbox
  scratch = max(sb.scratch_bytes, 2 * files_bytes + 16 * 2**20)
  return dataclasses.replace(
    sb,
    max_processes=processes,
    cpu_time_s=math.ceil(config.case_time_s) + 5,
    wall_time_s=n * (config.case_time_s + 1.0) + _STARTUP_S + 10.0,
    max_output_bytes=min(64 * 2**20, n * (2 * config.max_case_output_bytes + 4096) + 65536),
    scratch_bytes=scratch,
    total_memory_bytes=max(sb.total_memory_bytes, scratch + 2 * sb.memory_bytes + 64 * 2**20),
    binds=tuple(binds),
  )


def _records(report: str) -> list[dict]:
  out = []
  for line in report.splitlines():
    try:
      obj = json.loads(line)
    except ValueError:
      continue
    if isinstance(obj, dict):
      out.append(obj)
  return out


def _run(files: dict[str, str], config) -> SandboxResult:
  try:
    return run_python(files, "main.py", config)
  except SandboxUnavailable as e:
    raise _Infra(f"the sandbox could not start: {e}") from None


def _started(result: SandboxResult, what: str) -> list[dict]:
  recs = _records(result.report)
  if not recs or "ready" not in recs[0]:
    raise _Infra(f"the {what} sandbox did not start its driver: {result.reason}; {result.stderr[-300:]}".strip())
  return recs


def _case_failure(rec: dict) -> str | None:
  if rec.get("timeout"):
    return f"timed out after {rec['time']}s"
  if rec.get("over"):
    return "output over the cap"
  if "signal" in rec:
    return f"killed by signal {rec['signal']}" + (" (CPU limit)" if rec["signal"] in (9, 24) else "")
  if rec.get("exit") != 0:
    tail = (rec.get("err") or "").strip().splitlines()[-1:] or [""]
    return f"exit status {rec.get('exit')}: {tail[0][:200]}".rstrip(": ")
  return None


def _launch_cases(code: str, p: Problem, config: CodeRewardConfig, prelude: str) -> tuple[list, SandboxResult]:
  """Runs the stdin or call cases of `p` in one solution sandbox: (a record or a failure reason per case, the
  sandbox's result). A record carries what the case printed (`out`) or returned (`res`, `_wire` text)."""
  inputs = list(p.inputs) if p.kind == "stdin" else [_wire.encode(list(a)) for a in p.inputs]
  plan = {
    "mode": p.kind,
    "fn_name": p.fn_name,
    "case_time_s": config.case_time_s,
    "cpu_s": math.ceil(config.case_time_s),
    "max_case_output": config.max_case_output_bytes,
    "stop_at_first_failure": config.stop_at_first_failure,
    "prelude": prelude,
    "isolated": runner.isolation_error(config.sandbox) is None,
  }
  files = {
    "main.py": _SOLUTION_DRIVER,
    "_wire.py": _WIRE,
    "solution.py": code,
    "plan.json": json.dumps(plan),
    "inputs.json": json.dumps(inputs),
  }
  size = sum(len(t.encode()) for t in files.values())
  result = _run(files, _sandbox_for(config, len(inputs), size, processes=_SOLUTION_PROCESSES))
  recs = _started(result, "solution's")
  load_error = next((r["load_error"] for r in recs if "load_error" in r), None)
  by_case = {r["case"]: r for r in recs if type(r.get("case")) is int}
  stopped = next((r["stopped"] for r in recs if "stopped" in r), None)
  out: list[dict | str] = []
  for i in range(len(inputs)):
    rec = by_case.get(i)
    if load_error is not None:
      out.append(f"the program does not compile: {load_error}")
    elif rec is None:
      why = f"not run: stopped after case {stopped} failed" if stopped is not None else "no record (the run ended)"
      out.append(f"{why}; sandbox: {result.reason}")
    else:
      out.append(_case_failure(rec) or rec)
  return out, result


def call_results(
  code: str, fn_name: str, args: Sequence[Sequence[Any]], config: CodeRewardConfig | None = None, prelude: str = ""
) -> list[tuple[bool, Any]]:
  """What `fn_name` of program `code` returns on each argument list, run in the sandbox as call cases are:
  (True, the value as plain data) or (False, why the case failed: crash, timeout, not plain data). For graders
  that compare by their own rule (EvalPlus: expected outputs from a canonical solution, its `atol`).
  A sandbox that cannot start raises RuntimeError (an infrastructure failure, not a verdict)."""
  if not (isinstance(fn_name, str) and fn_name.isidentifier()):
    raise ValueError(f"call_results: fn_name must be an identifier, got {fn_name!r}")
  config = config or CodeRewardConfig()
  problem = Problem("call", "calls", tuple(list(a) for a in args), (None,) * len(args), fn_name=fn_name)
  try:
    cases, _ = _launch_cases(code, problem, config, prelude)
  except _Infra as e:
    raise RuntimeError(str(e)) from None
  out: list[tuple[bool, Any]] = []
  for case in cases:
    if isinstance(case, str):
      out.append((False, case))
      continue
    line = case["res"].split("\n", 1)[0]
    if not line:
      out.append((False, "no result (the call ended without returning)"))
      continue
    try:
      out.append((True, _wire.loads(line)))
    except (ValueError, TypeError, RecursionError) as e:
      out.append((False, f"the result is not plain data: {e}"[:200]))
  return out


def _run_cases(code: str, p: Problem, config: CodeRewardConfig) -> tuple[list[tuple[bool, str]], dict]:
  cases, result = _launch_cases(code, p, config, CALL_PRELUDE if p.kind == "call" else "")
  info = {
    "sandbox_reason": result.reason,
    "layers": result.layers,
    "elapsed_s": result.elapsed_s,
    "denied_syscalls": result.denied,  # refused by the sandbox's filter (EPERM), by name
  }
  outcomes: list[tuple[bool, str] | None] = []
  to_check = []
  for i, rec in enumerate(cases):
    if isinstance(rec, str):
      outcomes.append((False, rec))
    elif p.kind == "stdin" and p.checker is not None:
      outcomes.append(None)
      to_check.append({"case": i, "input": p.inputs[i], "output": rec["out"], "expected": p.expected[i]})
    elif p.kind == "stdin":
      outcomes.append(compare_output(rec["out"], p.expected[i], config.compare, config.float_tol))
    else:
      outcomes.append(_compare_call(rec["res"], p.expected[i], p.wrapped_outputs, config.float_tol))
  if to_check:
    for i, verdict in _run_checker(p.checker, to_check, config).items():
      outcomes[i] = verdict
  return [o if o is not None else (False, "the checker gave no verdict") for o in outcomes], info


def _compare_call(res: str, want: Any, wrapped: bool, float_tol: float) -> tuple[bool, str]:
  line = res.split("\n", 1)[0]
  if not line:
    return False, "no result (the call ended without returning)"
  try:
    got = _wire.loads(line)
  except (ValueError, TypeError, RecursionError) as e:
    return False, f"the result is not plain data: {e}"[:200]
  if values_equal(got, want, float_tol):
    return True, ""
  if wrapped and isinstance(want, list) and len(want) == 1 and values_equal(got, want[0], float_tol):
    return True, ""
  return False, f"returned {repr(got)[:80]}, expected {repr(want)[:80]}"


def _run_checker(checker: str, cases: list[dict], config: CodeRewardConfig) -> dict[int, tuple[bool, str]]:
  plan = {
    "mode": "checker",
    "checker": checker,
    "case_time_s": config.case_time_s,
    "max_case_output": config.max_case_output_bytes,
  }
  files = {"main.py": _TEST_DRIVER, "_wire.py": _WIRE, "plan.json": json.dumps(plan), "cases.json": json.dumps(cases)}
  size = sum(len(t.encode()) for t in files.values())
  result = _run(files, _sandbox_for(config, len(cases), size, processes=1))
  recs = _started(result, "checker's")
  err = next((r["test_error"] for r in recs if "test_error" in r), None)
  if err is not None:
    raise ValueError(f"field 'checker': the checker program fails: {err}")
  return {
    r["case"]: (bool(r["ok"]) if type(r.get("ok")) is bool else False, str(r.get("why", "")))
    for r in recs
    if type(r.get("case")) is int
  }


def _fifo_dir(path: str | None = None) -> str:
  if path is None:
    chan = tempfile.mkdtemp(prefix="k2jax-verify-chan-")
  else:
    os.mkdir(path)
    chan = path
  os.chmod(chan, 0o755)
  for name in ("calls", "results"):
    path = os.path.join(chan, name)
    os.mkfifo(path)
    os.chmod(path, 0o666)  # both sandboxes' uids (mapped to nobody here) open it
  return chan


def _unblock(chan: str) -> list[int]:
  """When one side could not start: hold both FIFOs open (O_RDWR never blocks) with a stop line in each, so the
  other side's driver, blocked opening its end or waiting for its peer, reads it and ends at once. The
  caller closes the fds once that side has ended."""
  fds = []
  for name in ("calls", "results"):
    fd = os.open(os.path.join(chan, name), os.O_RDWR | os.O_NONBLOCK)
    fds.append(fd)
    os.write(fd, b'{"stop": "the other sandbox could not start"}\n')
  return fds


def _run_module(code: str, p: Problem, config: CodeRewardConfig) -> tuple[list[tuple[bool, str]], dict]:
  chan = _fifo_dir()
  try:
    sol_files = _serve_files(code, p, config)
    test_plan = {**_common_plan(config), "mode": "module", **_job_plan(p, _CHAN_MOUNT)}
    test_files = {"main.py": _TEST_DRIVER, "_wire.py": _WIRE, "plan.json": json.dumps(test_plan)}
    binds = ((chan, _CHAN_MOUNT, True),)
    test_binds = binds
    if p.kind == "pytest":
      paths = default_python_paths()  # pytest and its dependencies, read-only in the test's sandbox
      test_plan.update(mode="pytest", python_paths=list(paths))
      test_files.update({"plan.json": json.dumps(test_plan), "test_solution.py": p.test})
      test_binds = (*binds, *((q, q, True) for q in paths))
    n = len(p.cases) + 2
    sol_cfg = _sandbox_for(config, n, sum(map(len, sol_files.values())), processes=_SOLUTION_PROCESSES, binds=binds)
    test_cfg = _sandbox_for(config, n, sum(map(len, test_files.values())), processes=1, binds=test_binds)
    held: list[int] = []
    try:
      with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {pool.submit(_run, sol_files, sol_cfg): "solution", pool.submit(_run, test_files, test_cfg): "test"}
        results, infra = {}, None
        for f in concurrent.futures.as_completed(futures):
          try:
            results[futures[f]] = f.result()
          except _Infra as e:
            if infra is None:
              held = _unblock(chan)  # the other side waits for a peer that will never come
            infra = infra or e
    finally:
      for fd in held:
        os.close(fd)
    if infra is not None:
      raise infra
  finally:
    shutil.rmtree(chan, ignore_errors=True)
  _started(results["solution"], "solution's")
  recs = _started(results["test"], "test's")
  peer = next((r["no_peer"] for r in recs if "no_peer" in r), None)
  if peer is not None:
    raise _Infra(peer)
  info = {
    "sandbox_reason": results["solution"].reason,
    "test_sandbox_reason": results["test"].reason,
    "layers": results["test"].layers,
    "elapsed_s": max(r.elapsed_s for r in results.values()),
    "denied_syscalls": _denied(results["solution"], results["test"]),
  }
  return _module_outcomes(p, recs, info, config)


def _denied(*results: SandboxResult) -> tuple[str, ...]:
  """System calls the filter refused in any of the run's sandboxes, by name, first made first."""
  return tuple(dict.fromkeys(n for r in results for n in r.denied))


def _common_plan(config: CodeRewardConfig) -> dict:
  return {
    "case_time_s": config.case_time_s,
    "max_case_output": config.max_case_output_bytes,
    "stop_at_first_failure": config.stop_at_first_failure,
    "startup_s": _STARTUP_S,
  }


def _job_plan(p: Problem, chan: str) -> dict:
  return {
    "chan": chan,
    "prompt": p.prompt,
    "setup": p.setup,
    "test": p.test,
    "cases": list(p.cases),
    "remote": list(p.remote),
    "bind": dict(p.bind),
    "setup_classes": list(p.setup_classes),
  }


def _serve_files(code: str, p: Problem, config: CodeRewardConfig) -> dict[str, str]:
  plan = {
    **_common_plan(config),
    "chan": _CHAN_MOUNT,
    "mode": "serve",
    "cpu_s": math.ceil(config.case_time_s),
    "isolated": runner.isolation_error(config.sandbox) is None,
    "setup_classes": list(p.setup_classes),
  }
  solution = f"{p.setup}\n{code}" if p.setup else code
  return {"main.py": _SOLUTION_DRIVER, "_wire.py": _WIRE, "solution.py": solution, "plan.json": json.dumps(plan)}


def _run_module_batch(
  jobs: list[tuple[str, Problem]], config: CodeRewardConfig, pool: concurrent.futures.Executor
) -> list[Graded]:
  root = tempfile.mkdtemp(prefix="k2jax-verify-chans-")
  os.chmod(root, 0o755)
  held: list[int] = []
  try:
    chans = []
    for k in range(len(jobs)):
      chan = _fifo_dir(os.path.join(root, str(k)))
      chans.append(chan)
    plan = {**_common_plan(config), "mode": "batch"}
    plan["jobs"] = [_job_plan(p, f"{_CHAN_MOUNT}/{k}") for k, (_, p) in enumerate(jobs)]
    test_files = {"main.py": _TEST_DRIVER, "_wire.py": _WIRE, "plan.json": json.dumps(plan)}
    n = sum(len(p.cases) + 2 for _, p in jobs)
    test_cfg = _sandbox_for(config, n, sum(map(len, test_files.values())), 1, ((root, _CHAN_MOUNT, True),))
    # The test's sandbox has no worker slot of the pool's: it waits for the solutions, which wait for it.
    test_thread = concurrent.futures.ThreadPoolExecutor(1)
    test_future = test_thread.submit(_run, test_files, test_cfg)
    lock = threading.Lock()

    def release_all(_future) -> None:  # the test's sandbox ended (or never started): no solution waits for it
      with lock:
        for chan in chans:
          held.extend(_unblock(chan))

    test_future.add_done_callback(release_all)

    def solution(k: int) -> SandboxResult | _Infra:
      code, p = jobs[k]
      files = _serve_files(code, p, config)
      cfg = _sandbox_for(
        config, len(p.cases) + 2, sum(map(len, files.values())), _SOLUTION_PROCESSES, ((chans[k], _CHAN_MOUNT, True),)
      )
      if test_future.done() and test_future.exception() is not None:
        return _Infra(str(test_future.exception()))
      try:
        return _run(files, cfg)
      except _Infra as e:
        with lock:
          held.extend(_unblock(chans[k]))  # the test's sandbox would wait for this solution
        return e

    sol_results = list(pool.map(solution, range(len(jobs))))
    try:
      test_result = test_future.result()
      test_error: _Infra | None = None
    except _Infra as e:
      test_result, test_error = None, e
    test_thread.shutdown()
  finally:
    for fd in held:
      os.close(fd)
    shutil.rmtree(root, ignore_errors=True)
  out = []
  try:
    recs = _started(test_result, "test's") if test_result is not None else None
  except _Infra as e:
    recs, test_error = None, e
  for k, ((_, p), sol) in enumerate(zip(jobs, sol_results, strict=True)):
    if recs is None or isinstance(sol, _Infra):
      out.append(_infra_graded(test_error if recs is None else sol))
      continue
    try:
      _started(sol, "solution's")
    except _Infra as e:
      out.append(_infra_graded(e))
      continue
    mine = [r for r in recs if r.get("job") == k]
    peer = next((r["no_peer"] for r in mine if "no_peer" in r), None)
    if peer is not None:
      out.append(_infra_graded(_Infra(peer)))
      continue
    info = {
      "sandbox_reason": sol.reason,
      "test_sandbox_reason": test_result.reason,
      "layers": sol.layers,
      "elapsed_s": sol.elapsed_s,
      "denied_syscalls": _denied(sol, test_result),
    }
    outcomes, info = _module_outcomes(p, mine, info, config)
    out.append(_graded(p, outcomes, info, config))
  return out


def _module_outcomes(p: Problem, recs: list[dict], info: dict, config: CodeRewardConfig):
  err = next((r["test_error"] for r in recs if "test_error" in r), None)
  if err is not None:
    return [(False, f"the test module failed before any case: {err.splitlines()[0]}")] * len(p.cases), {
      **info,
      "test_error": err,
    }
  by_case = {r["case"]: r for r in recs if type(r.get("case")) is int}
  n_cases = len(p.cases)
  if p.kind == "pytest":
    collected = next((r["collected"] for r in recs if type(r.get("collected")) is int), 0)
    n_cases = max(n_cases, collected)
    collect_error = next((r["collect_error"] for r in recs if "collect_error" in r), None)
    if collect_error is not None and not by_case:
      last = [line for line in str(collect_error).splitlines() if line.strip()][-1:] or [""]
      return [(False, f"collection failed: {last[0][:200]}")] * n_cases, info
  outcomes = []
  for i in range(n_cases):
    r = by_case.get(i)
    if r is None:
      outcomes.append((False, "not run" + (" (stopped at the first failure)" if config.stop_at_first_failure else "")))
    else:
      outcomes.append((r.get("ok") is True, str(r.get("why", ""))[:300]))
  return outcomes, info


def is_infra_error(graded: Graded) -> bool:
  return bool(graded.info.get("infra_error"))


__all__ = [
  "Problem",
  "call_results",
  "is_infra_error",
  "parse_row",
  "verify",
  "verify_batch",
]
