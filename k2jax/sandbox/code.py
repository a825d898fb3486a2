"""Grading a program against unit tests: run its calls in the sandbox, compute everything else here.

A test is Python source whose top-level `assert` statements are the checks: `assert add(2, 3) == 5`, or
`r = solve([3, 1])\nassert sorted(r) == [1, 3]`. Each test is split in this process (`split_test`):
- the calls into the solution (a call, attribute or subscript chain rooted at a name the test does not
  define, and names bound by the test's own statements) go into the sandbox with the statements before
  the assert; the sandbox evaluates them and writes their values to its report pipe as JSON plain data;
- everything else (every expected value, `2**40`, `'abc'[::-1]`, `math.sqrt(2)`, `list(range(5))`, the
  test's constants, and every comparison and operator applied to the program's values) is computed here
  by `expr.Evaluator`, a tree walker over the test's AST with bounded cost (never `eval`), expected values
  once at split time. An assignment that mixes the two (`ok = f(1) == 2**40`) is split the same way and
  its expression reused by later asserts. A test the grader cannot evaluate that way is rejected with a
  ValueError naming the expression (a builtin it does not know, a function or class the test defines or
  a value it computed inside with a loop or `+=`, a comprehension whose body calls the solution, an assert
  inside a loop): it would otherwise be judged inside the sandbox.
So the program supplies only the values of its own calls, never an expected value or a verdict; it never
sees an expected value (they are not in the files it gets); values cross as plain data (None, bool, int,
float, str, bytes, list, tuple, dict, set, by exact type) within the report cap, ints of at most 4300
digits, so an object whose `__eq__` is always True cannot cross, and nothing the program returns can make
the grader format, parse or build anything larger than `CodeRewardConfig.max_check_items`.
"""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from k2jax import pyparse
from k2jax.sandbox import expr
from k2jax.sandbox._harness import HARNESS, parse_report
from k2jax.sandbox.runner import SandboxConfig, limit_named, run_python


_FENCE_TAGS = ("", "python", "py", "python3", "py3")
_MUTABLE = (list, dict, set)
_PLAIN_METHODS = {name for _, name in expr.METHODS}


@dataclasses.dataclass(frozen=True)
class Graded:
  """The verdict on one program: `reward` is the pass rate in [0, 1]; `reason` says why in words."""

  reward: float
  reason: str
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CodeRewardConfig:
  sandbox: SandboxConfig = SandboxConfig()
  # The grader's own memory cap: elements + characters + int words of any value a check builds here.
  max_check_items: int = 1 << 18
  # The dataset-format verifier (k2jax.sandbox.verify):
  case_time_s: float = 6.0  # per case, wall clock (LiveCodeBench's 6 s); the CPU limit is its ceiling
  compare: str = "tokens"  # stdin/stdout comparison: "exact" | "lines" | "tokens" (verify.py says each rule)
  float_tol: float = 1e-6  # tokens and call results: |a - b| <= float_tol * max(1, |b|)
  stop_at_first_failure: bool = False  # True: 1.0 only when every case passes, later cases may not run
  max_case_output_bytes: int = 1 << 20  # what one case may print or return; more fails the case


@dataclasses.dataclass(frozen=True)
class SplitTest:
  """One test: what the sandbox runs (`steps`) and the checks evaluated here on the values it reports."""

  steps: tuple[tuple[str, str], ...]  # ("exec", statement) | ("eval", expression), in source order
  # Each assert's AST with expr.Slot leaves (sandbox values, constants), and the test's names at that point.
  checks: tuple[tuple[ast.expr, Mapping[str, Any]], ...]
  n_values: int
  constants: tuple[Any, ...]  # Slot("const", k)'s values, computed here when the test was split


def extract_code(text: str) -> str:
  """The last fenced code block (untagged or Python), or the whole text when there is none. Linear time."""
  last, pos = None, 0
  while (start := text.find("```", pos)) != -1:
    eol = text.find("\n", start + 3)
    if eol == -1:
      break
    close = text.find("```", eol + 1)
    if close == -1:
      break
    if text[start + 3 : eol].strip().lower() in _FENCE_TAGS:
      last = text[eol + 1 : close]
    pos = close + 3
  return text if last is None else last


def split_test(source: str, name: str = "test", max_items: int = 1 << 18) -> SplitTest:
  """Splits a test into sandbox steps and checks evaluated here; ValueError when it cannot be split safely."""
  try:
    module = pyparse.parse(source)
  except SyntaxError as e:
    raise ValueError(f"{name}: not valid Python ({e})") from e
  splitter = _Splitter(name, expr.Budget(max_items))
  for stmt in module.body:
    splitter.statement(stmt)
  if not splitter.checks:
    raise ValueError(
      f"{name}: no top-level assert ({source[:80]!r}); checks inside functions or loops would be judged "
      "inside the sandbox: write them as top-level asserts"
    )
  n_values = sum(kind == "eval" for kind, _ in splitter.steps)
  return SplitTest(tuple(splitter.steps), tuple(splitter.checks), n_values, tuple(splitter.constants))


def run_tests(code: str, tests: Sequence[str], config: CodeRewardConfig = CodeRewardConfig()) -> Graded:
  if not tests:
    raise ValueError("run_tests: no tests given")
  split = [split_test(t, f"test {i}", config.max_check_items) for i, t in enumerate(tests)]
  files = {"main.py": HARNESS, "solution.py": code, "calls.json": json.dumps([s.steps for s in split])}
  result = run_python(files, "main.py", config.sandbox)
  info = {
    "sandbox_reason": result.reason,
    "layers": result.layers,
    "elapsed_s": result.elapsed_s,
    "stderr": result.stderr[-500:],
    "denied_syscalls": result.denied,  # refused by the sandbox's filter (EPERM), by name
  }
  if result.reason != "ok":
    return Graded(0.0, result.reason, info)
  reported = parse_report(result.report, len(tests))
  budget = expr.Budget(config.max_check_items)
  outcomes = [_grade(s, reported.get(i), budget) for i, s in enumerate(split)]
  passed = sum(ok for ok, _ in outcomes)
  failures = [f"test {i}: {why}" for i, (ok, why) in enumerate(outcomes) if not ok]
  reason = f"{passed}/{len(outcomes)} tests passed" + (f"; {failures[0]}" if failures else "")
  limits = [limit_named(why, config.sandbox) for ok, why in outcomes if not ok]  # caught inside, by the harness
  if limit := next((x for x in limits if x), None):  # the grader's own errors start "grader ...": never these
    reason = f"{limit} hit; {reason}"
  return Graded(passed / len(outcomes), reason, {**info, "outcomes": outcomes})


class _Splitter:
  """Walks a test's statements: what needs the solution becomes sandbox steps, the rest stays here."""

  def __init__(self, name: str, budget: expr.Budget):
    self.name, self.budget = name, budget
    self.steps: list[tuple[str, str]] = []
    self.checks: list[tuple[ast.expr, Mapping[str, Any]]] = []
    self.constants: list[Any] = []
    self.names: dict[str, Any] = {}  # the test's constants (and math imports), as values here
    self.sources: dict[str, str | None] = {}  # how to define each in the sandbox (None: already there)
    self.inside: set[str] = set()  # names bound by statements run in the sandbox
    self.code: set[str] = set()  # of those, test code (def, class, lambda, import) or its results inside
    self.derived: dict[str, ast.expr] = {}  # `ok = f(1) == 2`: computed here, as the split expression

  def statement(self, stmt: ast.stmt) -> None:
    if isinstance(stmt, ast.Assert):
      check = self.outside(stmt.test)
      self.checks.append((check, dict(self.names)))  # later statements may rebind a name it uses
    elif isinstance(stmt, (ast.Import, ast.ImportFrom)) and self._math_import(stmt):
      self.steps.append(("exec", ast.unparse(stmt)))
    elif self._const_assign(stmt) or self._derived_assign(stmt):
      pass
    else:
      self._to_sandbox(stmt)

  def outside(self, node: ast.expr) -> ast.expr:
    """`node` rewritten for the grader: pure parts become constants, calls into the solution sandbox values."""
    if isinstance(node, ast.Name) and node.id in self.derived:
      return copy.deepcopy(self.derived[node.id])
    if self._pure(node):
      self.constants.append(self._evaluate(node))
      return ast.copy_location(expr.Slot("const", len(self.constants) - 1), node)
    if _is_call(node, "isinstance") and self._known("isinstance") and len(node.args) == 2 and not node.keywords:
      try:
        expr.plain_types(node.args[1])  # the types stay names; only the value is split
      except expr.EvalError as e:
        raise ValueError(f"{self.name}: {e}") from e
      node.args[0] = self.outside(node.args[0])
      return node
    children = self._local_children(node)
    if children is None:
      return self._producer(node)
    for owner, field in children:
      value = getattr(owner, field)
      setattr(owner, field, [self.outside(v) for v in value] if isinstance(value, list) else self.outside(value))
    return node

  def _local_children(self, node: ast.expr) -> list[tuple[ast.AST, str]] | None:
    """(node, field) pairs to split further when the grader applies `node` itself, else None."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
      return [(node, "elts")]
    if isinstance(node, ast.Dict) and None not in node.keys:
      return [(node, "keys"), (node, "values")]
    if isinstance(node, (ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp)):
      return [(node, f) for f in node._fields if f not in ("op", "ops")]
    if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
      return [(node, "value"), (node, "slice")]
    if isinstance(node, ast.Subscript):
      return [(node, "value")] + [(node.slice, f) for f in ("lower", "upper", "step") if getattr(node.slice, f)]
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
      first = node.generators[0]  # over the program's values, the rest evaluated here: `x > 0 for x in f()`
      iterable, first.iter = first.iter, ast.Constant(())
      rest_pure = self._pure(node)
      first.iter = iterable
      return [(first, "iter")] if rest_pure else None
    if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args):
      return None
    if any(k.arg is None for k in node.keywords):
      return None
    func = node.func
    if self._pure(func) or (isinstance(func, ast.Attribute) and func.attr in _PLAIN_METHODS):
      owners = [(func, "value")] if isinstance(func, ast.Attribute) and not self._pure(func) else []
      return owners + [(node, "args")] + [(k, "value") for k in node.keywords]
    return None

  def _producer(self, node: ast.expr) -> ast.expr:
    """A sandbox value: checked to be a call into the solution, never a judgment made inside."""
    root = _root(node)
    src = ast.unparse(node)[:80]
    if root is None:
      raise ValueError(
        f"{self.name}: `{src}` mixes the program's values with an expression the grader does not evaluate "
        "(a comprehension, lambda, f-string, ...): inside the sandbox the program would judge it; "
        "compare the program's values with operators, builtins and math functions instead"
      )
    if root in self.code:
      raise ValueError(
        f"{self.name}: `{src}` uses `{root}`, which the test's own code defines or computes inside the sandbox "
        "(a def, class, import, loop or augmented assignment), where the program controls it; compare plain "
        "values in the assert instead"
      )
    if root not in self.inside and hasattr(builtins, root):
      raise ValueError(
        f"{self.name}: `{src}` uses the builtin `{root}`, which the grader does not evaluate: it would run "
        "inside the sandbox, where the program controls it"
      )
    self._send_names(node)
    self.steps.append(("eval", ast.unparse(node)))
    k = sum(kind == "eval" for kind, _ in self.steps) - 1
    return ast.copy_location(expr.Slot("value", k), node)

  def _to_sandbox(self, stmt: ast.stmt) -> None:
    if any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
      raise ValueError(
        f"{self.name}: an assert inside `{ast.unparse(stmt)[:60]}` would be judged inside the sandbox: "
        "write it as a top-level assert"
      )
    if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
      raise ValueError(f"{self.name}: `{ast.unparse(stmt)}`: import the names the test uses")
    used = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)} & set(self.derived)
    if used:
      raise ValueError(
        f"{self.name}: `{ast.unparse(stmt)[:60]}` uses `{sorted(used)[0]}`, which the grader computes from the "
        "program's values: a statement run in the sandbox cannot read it"
      )
    self._send_names(stmt)
    self.steps.append(("exec", ast.unparse(stmt)))
    bound, code = _bindings(stmt)
    if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Expr, ast.Import, ast.ImportFrom, ast.FunctionDef)):
      code |= bound  # a loop, branch or `+=` computed these with the test's logic, inside: never asserted
    elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None and _root(stmt.value) in self.code:
      code |= bound  # `expected = reference(3)`: the test's own code ran inside, where the program controls it
    for n in bound:
      self.derived.pop(n, None)
    for n in bound:
      self.names.pop(n, None)
      self.sources.pop(n, None)
    self.inside |= bound
    self.code = (self.code - bound) | code

  def _send_names(self, node: ast.AST) -> None:
    """Defines in the sandbox the test constants `node` reads; mutable ones move there for good."""
    for n in sorted({x.id for x in ast.walk(node) if isinstance(x, ast.Name)} & set(self.names)):
      src = self.sources.get(n)
      if src is not None:
        self.steps.append(("exec", src))
        self.sources[n] = None
      if isinstance(self.names[n], _MUTABLE):  # the sandbox may change it: from here on it lives there
        del self.names[n]
        self.sources.pop(n, None)
        self.inside.add(n)

  def _derived_assign(self, stmt: ast.stmt) -> bool:
    """`name = <expr over the program's values>` that is not just a call into the solution: split like an
    assert (so `ok = f(1) == 2**40` is never judged inside); later asserts use the split expression."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
      return False
    root = _root(stmt.value)
    known_here = root is not None and root not in self.inside and (self._known(root) or hasattr(builtins, root))
    if root is not None and not known_here:
      return False  # `r = solve(3)`, `y = r.strip()`, `t = TreeNode(1)`: bound in the sandbox
    name = stmt.targets[0].id
    self.derived[name] = self.outside(stmt.value)
    self.names.pop(name, None)
    self.sources.pop(name, None)
    self.inside.discard(name)
    self.code.discard(name)
    return True

  def _const_assign(self, stmt: ast.stmt) -> bool:
    """`name = <pure>` or `a, b = <pure>`: evaluated here; the sandbox gets it only when it reads it."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and self._pure(stmt.value)):
      return False
    target = stmt.targets[0]
    names = [target] if isinstance(target, ast.Name) else getattr(target, "elts", None)
    if not names or not all(isinstance(t, ast.Name) for t in names):
      return False
    value = self._evaluate(stmt.value)
    values = [value] if isinstance(target, ast.Name) else list(value)
    if len(values) != len(names):
      raise ValueError(f"{self.name}: `{ast.unparse(stmt)[:60]}` unpacks {len(values)} values into {len(names)}")
    for t, v in zip(names, values):
      self.derived.pop(t.id, None)
      self.names[t.id] = v
      self.sources[t.id] = f"{t.id} = {_to_source(v, self.name)}"
      self.inside.discard(t.id)
      self.code.discard(t.id)
    return True

  def _math_import(self, stmt: ast.Import | ast.ImportFrom) -> bool:
    """`import math [as m]` / `from math import sqrt, pi`: the grader's math, and the sandbox's too."""
    if isinstance(stmt, ast.Import):
      if any(a.name != "math" for a in stmt.names):
        return False
      for a in stmt.names:
        self._bind_here(a.asname or "math", expr.MATH_MODULE)
      return True
    if stmt.module != "math" or stmt.level:
      return False
    known = {**expr.MATH_CONSTANTS, **expr.MATH_FUNCTIONS}
    if any(a.name not in known for a in stmt.names):
      return False
    for a in stmt.names:
      self._bind_here(a.asname or a.name, known[a.name])
    return True

  def _bind_here(self, name: str, value: Any) -> None:
    self.derived.pop(name, None)
    self.names[name], self.sources[name] = value, None
    self.inside.discard(name)
    self.code.discard(name)

  def _known(self, name: str) -> bool:
    return name in self.names or (
      name not in self.inside and (name in expr.FUNCTIONS or name in ("math", "isinstance"))
    )

  def _pure(self, node: ast.AST) -> bool:
    """Computable here without the solution: every name is a test constant, one the grader knows, or a
    comprehension's loop variable."""
    targets = [t for c in ast.walk(node) if isinstance(c, ast.comprehension) for t in ast.walk(c.target)]
    loop = {t.id for t in targets if isinstance(t, ast.Name)}
    for n in ast.walk(node):
      if isinstance(n, ast.Name) and not (n.id in loop or (isinstance(n.ctx, ast.Load) and self._known(n.id))):
        return False
      if isinstance(n, expr.Slot):
        return False
    return True

  def _evaluate(self, node: ast.expr) -> Any:
    try:
      return expr.Evaluator(self.budget, names=self.names)(node)
    except expr.EvalError as e:
      raise ValueError(f"{self.name}: the grader cannot evaluate `{ast.unparse(node)[:80]}`: {e}") from e
    except Exception as e:  # a test whose expected side fails (1 / 0, a wrong type): the test's fault
      raise ValueError(f"{self.name}: `{ast.unparse(node)[:80]}` fails: {type(e).__name__}: {e}"[:300]) from e


def _is_call(node: ast.expr, name: str) -> bool:
  return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _root(node: ast.expr) -> str | None:
  """The name a call/attribute/subscript chain starts from (`solve` in `solve(1).x[0]()`), else None."""
  while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
    node = node.func if isinstance(node, ast.Call) else node.value
  return node.id if isinstance(node, ast.Name) else None


def _bindings(stmt: ast.stmt) -> tuple[set[str], set[str]]:
  """Names a top-level statement binds (not those local to a def/class/lambda/comprehension), and the code ones."""
  bound, code = set(), set()
  stack: list[ast.AST] = [stmt]
  while stack:
    n = stack.pop()
    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      bound.add(n.name)
      code.add(n.name)
      stack.extend(n.decorator_list)
      continue
    if isinstance(n, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
      continue
    if isinstance(n, (ast.Import, ast.ImportFrom)):
      for a in n.names:
        name = a.asname or a.name.split(".")[0]
        bound.add(name)
        code.add(name)
      continue
    if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
      bound.add(n.id)
    if isinstance(n, ast.ExceptHandler) and n.name:
      bound.add(n.name)
    if isinstance(n, (ast.Global, ast.Nonlocal)):
      bound.update(n.names)
    stack.extend(ast.iter_child_nodes(n))
  if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Lambda):
    code |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
  return bound, code


def _to_source(v: Any, name: str) -> str:
  """Python source that rebuilds the plain value `v` in the sandbox (a test constant a statement reads)."""
  t = type(v)
  if v is None or t in (bool, str, bytes, range):
    return repr(v)
  if t is int:
    return repr(v) if v.bit_length() < 3 * expr.MAX_STR_DIGITS else hex(v)  # hex: linear time at any size
  if t is float:
    return repr(v) if math.isfinite(v) else f"float({str(v)!r})"
  if t in (list, tuple):
    inner = ", ".join(_to_source(x, name) for x in v)
    return f"[{inner}]" if t is list else f"({inner}{',' if len(v) == 1 else ''})"
  if t in (set, frozenset):
    inner = ", ".join(_to_source(x, name) for x in v)
    return f"{t.__name__}([{inner}])"
  if t is dict:
    return "{" + ", ".join(f"{_to_source(k, name)}: {_to_source(x, name)}" for k, x in v.items()) + "}"
  raise ValueError(f"{name}: a test constant of type {t.__name__} is used by a statement run in the sandbox")


def _grade(split: SplitTest, got: tuple[str, Any] | None, budget: expr.Budget) -> tuple[bool, str]:
  if got is None:
    return False, "no values reported"
  kind, payload = got
  if kind == "error":
    return False, payload
  if len(payload) != split.n_values:
    return False, f"{len(payload)} values reported, {split.n_values} expected"
  slots = {("value", k): v for k, v in enumerate(payload)}
  slots.update({("const", k): v for k, v in enumerate(split.constants)})
  for check, names in split.checks:
    try:
      if not expr.Evaluator(budget, slots, names)(check):
        return False, "AssertionError: " + _describe(payload)
    except expr.LimitError as e:
      return False, f"grader limit (max_check_items={budget.max_items}, the caller's cap, not the sandbox's): {e}"[:300]
    except MemoryError:
      return False, "the grader ran out of memory evaluating the check (the caller's memory, not the sandbox's)"
    except Exception as e:  # a comparison between mismatched plain types, an operator the values do not support
      return False, f"{type(e).__name__} in the check: {e}"[:200]
  return True, ""


def _describe(values: list) -> str:
  return ("got " + ", ".join(repr(v)[:60] for v in values))[:200] if values else "assertion false"
