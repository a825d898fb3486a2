"""Grading a program against unit tests: run it on the tests' inputs in the sandbox, judge its values here.

A test is Python source whose top-level `assert` statements are the checks: `assert add(2, 3) == 5`, or
`r = solve([3, 1])\nassert sorted(r) == [1, 3]`. Each test is split in this process (`split_test`):
- what needs the solution (calls into it, names it defines, the statements before an assert) goes into
  the sandbox, which evaluates it and writes the values to its report pipe as JSON of plain data;
- the rest of each assert (the comparison and the expected values) never enters the sandbox: it is
  evaluated here, on the decoded values, from a whitelist of node types and builtins. Constants the
  test assigns (`expected = [1, 3]`) stay here too, unless a later statement for the sandbox uses them.
So the verdict never comes from the program: whatever it prints or writes to the report pipe can only
supply values for its own calls, and values cross as plain data (None, bool, int, float, str, bytes,
list, tuple, dict, set, by exact type), so an object whose `__eq__` is always True cannot cross.
A test without a top-level assert (e.g. HumanEval's `check(candidate)`, or asserts inside a loop) would
be judged inside the sandbox and is rejected with ValueError: unroll it into top-level asserts.
"""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import json
import math
import re
from typing import Any, Mapping, Sequence

from k2jax.sandbox.runner import SandboxConfig, run_python

_HARNESS = r'''
import json, os
_out = os.fdopen(int(os.environ["K2JAX_REPORT_FD"]), "w")
_plan = json.load(open("calls.json"))
_ns = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), _ns)
    _load_error = None
except BaseException as e:  # noqa: B036 - SystemExit from the solution must not end the harness
    _load_error = f"{type(e).__name__}: {e}"[:200]


def _plain(v, depth=0):
    if depth > 64:
        raise ValueError("value nested deeper than 64 levels")
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t is list:
        return [_plain(x, depth + 1) for x in v]
    if t in (tuple, set, frozenset):
        return {t.__name__: [_plain(x, depth + 1) for x in v]}
    if t is dict:
        return {"dict": [[_plain(k, depth + 1), _plain(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": v.hex()}
    raise TypeError(f"a {t.__module__}.{t.__qualname__} is not plain data (None, bool, int, float, str, bytes, "
                    "list, tuple, dict, set)")


for _i, _steps in enumerate(_plan):
    if _load_error is not None:
        _line = {"test": _i, "error": _load_error}
    else:
        _g, _vals = dict(_ns), []
        try:
            for _kind, _src in _steps:
                if _kind == "exec":
                    exec(compile(_src, "<test>", "exec"), _g)
                else:
                    _vals.append(_plain(eval(compile(_src, "<test>", "eval"), _g)))
            _line = {"test": _i, "values": _vals}
        except BaseException as e:  # noqa: B036
            _line = {"test": _i, "error": f"{type(e).__name__}: {e}"[:200]}
    try:
        _text = json.dumps(_line)
    except (TypeError, ValueError, RecursionError) as e:
        _text = json.dumps({"test": _i, "error": f"unencodable value: {e}"[:200]})
    _out.write(_text + "\n")
    _out.flush()
'''

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)
# Evaluated here, on values from the sandbox: only operations whose cost is bounded by their inputs
# (no `*`, `**`, shifts: `[0] * value` would let the program size an allocation in this process).
_SAFE_CALLS = ("abs", "all", "any", "bool", "dict", "float", "frozenset", "int", "len", "list", "max", "min")
_SAFE_CALLS += ("round", "set", "sorted", "str", "sum", "tuple")
_MATH_CALLS = ("isclose", "isfinite", "isinf", "isnan", "fabs")
_BINOPS = (ast.Add, ast.Sub, ast.Div, ast.FloorDiv, ast.Mod)
_UNARYOPS = (ast.Not, ast.USub, ast.UAdd)
_TAGS = {"tuple": tuple, "set": set, "frozenset": frozenset}
_MAX_DEPTH = 66


@dataclasses.dataclass(frozen=True)
class Graded:
  """The verdict on one program: `reward` is the pass rate in [0, 1]; `reason` says why in words."""

  reward: float
  reason: str
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CodeRewardConfig:
  sandbox: SandboxConfig = SandboxConfig()


@dataclasses.dataclass(frozen=True)
class SplitTest:
  """One test: what the sandbox runs (`steps`) and the checks evaluated here on the values it reports."""

  steps: tuple[tuple[str, str], ...]  # ("exec", statement) | ("eval", expression), in source order
  checks: tuple[Any, ...]  # compiled expressions over _v0, _v1, ... (the "eval" steps' values)
  n_values: int


def extract_code(text: str) -> str:
  """The last fenced code block, or the whole text when there is none."""
  blocks = _FENCE.findall(text)
  return blocks[-1] if blocks else text


def split_test(source: str, name: str = "test") -> SplitTest:
  """Splits a test into sandbox steps and local checks; ValueError when it has no top-level assert."""
  try:
    module = ast.parse(source)
  except SyntaxError as e:
    raise ValueError(f"{name}: not valid Python ({e})") from e
  steps: list[tuple[str, str]] = []
  checks = []
  consts: dict[str, ast.expr] = {}  # `expected = [1, 2]`: kept here, so the sandbox never sees it
  for stmt in module.body:
    if isinstance(stmt, ast.Assert):
      test = _Inline(consts).visit(stmt.test)
      expr = ast.fix_missing_locations(ast.Expression(_Splitter(steps).outside(test)))
      checks.append(compile(expr, f"<{name}>", "eval"))
    elif _is_const_assign(stmt, consts):
      consts[stmt.targets[0].id] = _Inline(consts).visit(stmt.value)
    else:  # a statement that uses a constant may change it: from here on it lives in the sandbox
      for used in sorted({n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)} & set(consts)):
        steps.append(("exec", f"{used} = {ast.unparse(consts.pop(used))}"))
      steps.append(("exec", ast.unparse(stmt)))
  if not checks:
    raise ValueError(
      f"{name}: no top-level assert ({source[:80]!r}); checks inside functions or loops would be judged "
      "inside the sandbox: write them as top-level asserts"
    )
  n_values = sum(kind == "eval" for kind, _ in steps)
  return SplitTest(tuple(steps), tuple(checks), n_values)


def run_tests(code: str, tests: Sequence[str], config: CodeRewardConfig = CodeRewardConfig()) -> Graded:
  if not tests:
    raise ValueError("run_tests: no tests given")
  split = [split_test(t, f"test {i}") for i, t in enumerate(tests)]
  files = {"main.py": _HARNESS, "solution.py": code, "calls.json": json.dumps([s.steps for s in split])}
  result = run_python(files, "main.py", config.sandbox)
  info = {
    "sandbox_reason": result.reason,
    "layers": result.layers,
    "elapsed_s": result.elapsed_s,
    "stderr": result.stderr[-500:],
  }
  if result.reason != "ok":
    return Graded(0.0, result.reason, info)
  reported = _parse_report(result.report, len(tests))
  outcomes = [_grade(s, reported.get(i)) for i, s in enumerate(split)]
  passed = sum(ok for ok, _ in outcomes)
  failures = [f"test {i}: {why}" for i, (ok, why) in enumerate(outcomes) if not ok]
  reason = f"{passed}/{len(outcomes)} tests passed" + (f"; {failures[0]}" if failures else "")
  if any(why.startswith("MemoryError") for _, why in outcomes):  # caught by the harness, not fatal
    reason = f"memory limit ({config.sandbox.memory_bytes} bytes) hit; {reason}"
  return Graded(passed / len(outcomes), reason, {**info, "outcomes": outcomes})


class _Splitter:
  """Keeps the comparison part of an assert here; every other subexpression becomes a sandbox value."""

  def __init__(self, steps: list[tuple[str, str]]):
    self.steps = steps

  def outside(self, node: ast.expr) -> ast.expr:
    kids = self._local_children(node)
    if kids is None:
      self.steps.append(("eval", ast.unparse(node)))
      k = sum(kind == "eval" for kind, _ in self.steps) - 1
      return ast.copy_location(ast.Name(f"_v{k}", ast.Load()), node)
    for owner, field in kids:
      value = getattr(owner, field)
      setattr(owner, field, [self.outside(v) for v in value] if isinstance(value, list) else self.outside(value))
    return node

  @staticmethod
  def _local_children(node: ast.expr) -> list[tuple[ast.AST, str]] | None:
    """(node, field) pairs to split further when `node` itself may be evaluated here, else None."""
    if isinstance(node, ast.Constant):
      return []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
      return [(node, "elts")]
    if isinstance(node, ast.Dict) and None not in node.keys:
      return [(node, "keys"), (node, "values")]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARYOPS):
      return [(node, "operand")]
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS):
      return [(node, "left"), (node, "right")]
    if isinstance(node, ast.BoolOp):
      return [(node, "values")]
    if isinstance(node, ast.Compare):
      return [(node, "left"), (node, "comparators")]
    if isinstance(node, ast.IfExp):
      return [(node, "test"), (node, "body"), (node, "orelse")]
    if (
      isinstance(node, ast.Call) and _safe_callee(node.func) and not any(isinstance(a, ast.Starred) for a in node.args)
    ):
      if all(k.arg is not None for k in node.keywords):
        return [(node, "args")] + [(k, "value") for k in node.keywords]
    return None


class _Inline(ast.NodeTransformer):
  """Replaces names of the test's own constants with their literal values."""

  def __init__(self, consts: dict[str, ast.expr]):
    self.consts = consts

  def visit_Name(self, node: ast.Name) -> ast.expr:
    if isinstance(node.ctx, ast.Load) and node.id in self.consts:
      return ast.copy_location(copy.deepcopy(self.consts[node.id]), node)
    return node


def _is_const_assign(stmt: ast.stmt, consts: dict[str, ast.expr]) -> bool:
  """`name = <value computable here without the solution>` (a literal, or safe calls on literals)."""
  if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
    return False
  probe: list[tuple[str, str]] = []
  _Splitter(probe).outside(_Inline(consts).visit(copy.deepcopy(stmt.value)))
  return not probe


def _safe_callee(func: ast.expr) -> bool:
  if isinstance(func, ast.Name):
    return func.id in _SAFE_CALLS
  return (
    isinstance(func, ast.Attribute)
    and isinstance(func.value, ast.Name)
    and func.value.id == "math"
    and func.attr in _MATH_CALLS
  )


def _parse_report(report: str, n_tests: int) -> dict[int, tuple[str, Any]]:
  """test index -> ("values", [decoded]) | ("error", text); the first well-formed line per test counts."""
  out: dict[int, tuple[str, Any]] = {}
  for line in report.splitlines():
    try:
      obj = json.loads(line)
      i = obj["test"]
      if type(i) is not int or not 0 <= i < n_tests or i in out or len(obj) != 2:
        continue
      if "error" in obj and type(obj["error"]) is str:
        out[i] = ("error", obj["error"][:200])
      elif "values" in obj and type(obj["values"]) is list:
        out[i] = ("values", [_decode(v, 0) for v in obj["values"]])
    except (ValueError, TypeError, KeyError, RecursionError):
      continue  # not a line the harness wrote: the program's own output, which decides nothing
  return out


def _decode(v: Any, depth: int) -> Any:
  """Tagged JSON -> plain Python data; anything else is a ValueError."""
  if depth > _MAX_DEPTH:
    raise ValueError("value nested too deep")
  if v is None or type(v) in (bool, int, float, str):
    return v
  if type(v) is list:
    return [_decode(x, depth + 1) for x in v]
  if type(v) is dict and len(v) == 1:
    ((tag, body),) = v.items()
    if tag in _TAGS and type(body) is list:
      return _TAGS[tag](_decode(x, depth + 1) for x in body)
    if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
      return {_decode(k, depth + 1): _decode(x, depth + 1) for k, x in body}
    if tag == "bytes" and type(body) is str:
      return bytes.fromhex(body)
  raise ValueError(f"not a plain-data encoding: {str(v)[:80]}")


_CHECK_GLOBALS = {"__builtins__": {}, "math": math, **{n: getattr(builtins, n) for n in _SAFE_CALLS}}


def _grade(split: SplitTest, got: tuple[str, Any] | None) -> tuple[bool, str]:
  if got is None:
    return False, "no values reported"
  kind, payload = got
  if kind == "error":
    return False, payload
  if len(payload) != split.n_values:
    return False, f"{len(payload)} values reported, {split.n_values} expected"
  values = {f"_v{k}": v for k, v in enumerate(payload)}
  for check in split.checks:
    try:
      if not eval(check, dict(_CHECK_GLOBALS), values):  # whitelisted nodes over plain data only
        return False, "AssertionError: " + _describe(payload)
    except Exception as e:  # a comparison between mismatched plain types
      return False, f"{type(e).__name__} in the check: {e}"[:200]
  return True, ""


def _describe(values: list) -> str:
  return ("got " + ", ".join(repr(v)[:60] for v in values))[:200] if values else "assertion false"
