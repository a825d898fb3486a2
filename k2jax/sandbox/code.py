"""Grading a program against unit tests in the sandbox; the score is the test pass rate.

Tests are Python snippets (typically `assert f(2) == 4`) run one by one in the namespace of the solution.
The harness reads a random nonce from stdin *before* importing the solution and prints it with the
results, so the program cannot forge the result line without reaching into the harness's frames (see the
sandbox module for what the process boundary does and does not stop).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any, Mapping, Sequence

from k2jax.sandbox.runner import SandboxConfig, run_python

_HARNESS = r'''
import json, sys
_nonce = sys.stdin.readline().strip()
_print, _dumps = print, json.dumps
_ns = {"__name__": "solution"}
_results = []
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), _ns)
    _load_error = None
except BaseException as e:  # noqa: B036 - SystemExit from the solution must not end the harness
    _load_error = f"{type(e).__name__}: {e}"
for _test in json.load(open("tests.json")):
    if _load_error is not None:
        _results.append([False, _load_error[:200]])
        continue
    try:
        exec(compile(_test, "<test>", "exec"), dict(_ns))
        _results.append([True, ""])
    except BaseException as e:  # noqa: B036
        _results.append([False, f"{type(e).__name__}: {e}"[:200]])
_print("K2JAX-RESULT", _nonce, _dumps(_results), flush=True)
'''

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


@dataclasses.dataclass(frozen=True)
class Graded:
  """The verdict on one program: `reward` is the pass rate in [0, 1]; `reason` says why in words."""

  reward: float
  reason: str
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CodeRewardConfig:
  sandbox: SandboxConfig = SandboxConfig()


def extract_code(text: str) -> str:
  """The last fenced code block, or the whole text when there is none."""
  blocks = _FENCE.findall(text)
  return blocks[-1] if blocks else text


def run_tests(code: str, tests: Sequence[str], config: CodeRewardConfig = CodeRewardConfig()) -> Graded:
  if not tests:
    raise ValueError("run_tests: no tests given")
  nonce = secrets.token_hex(16)
  result = run_python(
    {"main.py": _HARNESS, "solution.py": code, "tests.json": json.dumps(list(tests))},
    "main.py",
    config.sandbox,
    stdin=nonce + "\n",
  )
  info = {
    "sandbox_reason": result.reason,
    "layers": result.layers,
    "elapsed_s": result.elapsed_s,
    "stderr": result.stderr[-500:],
  }
  if result.reason != "ok":
    return Graded(0.0, result.reason, info)
  lines = [l for l in result.stdout.splitlines() if l.startswith(f"K2JAX-RESULT {nonce} ")]
  if len(lines) != 1:
    return Graded(0.0, "no result from the test harness", info)
  outcomes = json.loads(lines[0].split(" ", 2)[2])
  passed = sum(ok for ok, _ in outcomes)
  failures = [f"test {i}: {why}" for i, (ok, why) in enumerate(outcomes) if not ok]
  reason = f"{passed}/{len(outcomes)} tests passed" + (f"; {failures[0]}" if failures else "")
  if any(why.startswith("MemoryError") for _, why in outcomes):  # caught by the harness, not fatal
    reason = f"memory limit ({config.sandbox.memory_bytes} bytes) hit; {reason}"
  return Graded(passed / len(outcomes), reason, {**info, "outcomes": outcomes})
