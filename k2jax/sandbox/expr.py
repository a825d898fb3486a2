"""The grader's own evaluator for test expressions: expected values and comparisons, over plain data.

`code.py` keeps every part of an assert that does not need the solution out of the sandbox; this module
evaluates those parts here, in the trainer, by walking the test's AST itself (no `eval`, no `compile`).
It accepts a fixed set of node types, builtins, `math` functions and methods of plain types, and every
operation that can build a value larger than a constant factor of its inputs (`*`, `**`, `<<`,
`str.replace`, `str.join`, `range` materialised, ...) checks the size of its result BEFORE computing it,
against `Budget.max_items` (elements + characters + 64-bit int words): a value the program returned can
steer nothing here into unbounded time or memory. String formatting (`%` on str, `format`, f-strings)
is refused: a format spec is a program-sized allocation.

`EvalError`: the expression is outside what the grader evaluates (a test's fault when its expected side
needs it); `LimitError`: a result would exceed the budget (the grader's cap, not the sandbox's).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any

from k2jax.sandbox.expr_rules import (
  _BINOPS,
  _COMPARE,
  FUNCTIONS,
  MATH_CONSTANTS,
  MATH_FUNCTIONS,
  MATH_MODULE,
  MAX_INT_BITS,
  MAX_STR_DIGITS,
  METHODS,
  PLAIN_TYPES,
  Budget,
  EvalError,
  LimitError,
  Meter,
  _Function,
  _iterable,
  _numbers,
  _src,
  items,
  plain_types,
)

__all__ = [
  "FUNCTIONS",
  "MATH_CONSTANTS",
  "MATH_FUNCTIONS",
  "MATH_MODULE",
  "MAX_INT_BITS",
  "MAX_STR_DIGITS",
  "METHODS",
  "PLAIN_TYPES",
  "Budget",
  "EvalError",
  "Evaluator",
  "LimitError",
  "Slot",
  "items",
  "plain_types",
]


class Slot(ast.expr):
  """A leaf `code.py` puts in a check: value `index` of `kind` ("value": from the sandbox, "const": ours)."""

  _fields = ()

  def __init__(self, kind: str = "value", index: int = 0):  # defaults: copy.deepcopy rebuilds it empty
    super().__init__()
    self.kind, self.index = kind, index


class Evaluator(Meter):
  """Evaluates one trusted AST (the test's) over `slots`; `names` maps test constants to values."""

  def __init__(self, budget: Budget, slots: Mapping[tuple[str, int], Any] = {}, names: Mapping[str, Any] = {}):
    super().__init__(budget)
    self.slots, self.names = slots, names

  def __call__(self, node: ast.AST) -> Any:
    method = getattr(self, "_" + type(node).__name__, None)
    if method is None:
      raise EvalError(f"`{_src(node)}`: {type(node).__name__} is not evaluated by the grader")
    return method(node)

  # Leaves.
  def _Slot(self, node: Slot) -> Any:
    return self.slots[(node.kind, node.index)]

  def _Constant(self, node: ast.Constant) -> Any:
    if node.value is Ellipsis or type(node.value) is complex:
      raise EvalError(f"`{_src(node)}`: constant not evaluated by the grader")
    return self.check(node.value)

  def _Name(self, node: ast.Name) -> Any:
    if node.id in self.names:
      return self.names[node.id]
    if node.id in FUNCTIONS:
      return FUNCTIONS[node.id]
    if node.id == "math":
      return MATH_MODULE
    raise EvalError(f"name `{node.id}` is not known to the grader")

  def _Attribute(self, node: ast.Attribute, base: Any = None) -> Any:
    base = self(node.value) if base is None else base
    if base is MATH_MODULE and node.attr in MATH_CONSTANTS:
      return MATH_CONSTANTS[node.attr]
    if base is MATH_MODULE and node.attr in MATH_FUNCTIONS:
      return MATH_FUNCTIONS[node.attr]
    raise EvalError(f"`{_src(node)}`: attribute not evaluated by the grader")

  # Displays.
  def _Tuple(self, node):
    return self.check(tuple(self._elts(node.elts)))

  def _List(self, node):
    return self.check(self._elts(node.elts))

  def _Set(self, node):
    return self.check(set(self._elts(node.elts)))

  def _Dict(self, node):
    if None in node.keys:
      raise EvalError(f"`{_src(node)}`: ** in a dict display is not evaluated by the grader")
    return self.check({self(k): self(v) for k, v in zip(node.keys, node.values)})

  def _elts(self, elts):
    if any(isinstance(e, ast.Starred) for e in elts):
      raise EvalError("a starred element is not evaluated by the grader")
    return [self(e) for e in elts]

  # Operators.
  def _UnaryOp(self, node: ast.UnaryOp) -> Any:
    v = self(node.operand)
    if isinstance(node.op, ast.Not):
      return not v
    _numbers("unary operator", v)
    op = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}[type(node.op)]
    return op(v)

  def _BoolOp(self, node: ast.BoolOp) -> Any:
    v = None
    for part in node.values:
      v = self(part)
      if bool(v) == isinstance(node.op, ast.Or):  # short-circuit exactly as Python does
        return v
    return v

  # Comprehensions: loop variables in a scope of their own; iterations and the items built count against
  # the budget. A generator expression is built as a list: all(), any(), sum(), sorted() take it alike.
  def _ListComp(self, node: ast.ListComp) -> list:
    return self._comprehension(node, lambda: self(node.elt))

  _GeneratorExp = _ListComp

  def _SetComp(self, node: ast.SetComp) -> set:
    return set(self._comprehension(node, lambda: self(node.elt)))

  def _DictComp(self, node: ast.DictComp) -> dict:
    return dict(self._comprehension(node, lambda: (self(node.key), self(node.value))))

  def _comprehension(self, node, produce: Callable[[], Any]) -> list:
    out, outer, counts = [], self.names, [0, 0]  # iterations, items built

    def loop(k: int, scope: Mapping[str, Any]) -> None:
      self.names = scope
      if k == len(node.generators):
        out.append(produce())
        counts[1] += items(out[-1], self.budget.max_items)
        self.need(counts[1], "a comprehension's result")
        return
      gen = node.generators[k]
      if gen.is_async:
        raise EvalError("an async comprehension is not evaluated by the grader")
      for item in _iterable(self, self(gen.iter), "a comprehension over"):
        counts[0] += 1
        self.need(counts[0], "a comprehension's iterations")
        inner = {**scope, **_unpack(gen.target, item)}
        self.names = inner
        if all(self(c) for c in gen.ifs):
          loop(k + 1, inner)

    try:
      loop(0, outer)
    finally:
      self.names = outer
    return out

  def _IfExp(self, node: ast.IfExp) -> Any:
    return self(node.body) if self(node.test) else self(node.orelse)

  def _Compare(self, node: ast.Compare) -> bool:
    left = self(node.left)
    for op, comp in zip(node.ops, node.comparators):
      right = self(comp)
      if type(right) is range and isinstance(op, (ast.In, ast.NotIn)) and type(left) not in (int, bool):
        left = int(left) if type(left) is float and left.is_integer() else None  # else range iterates itself
      if not _COMPARE[type(op)](left, right):  # cost bounded by the operands' sizes
        return False
      left = right
    return True

  def _BinOp(self, node: ast.BinOp) -> Any:
    a, b = self(node.left), self(node.right)
    rule = _BINOPS.get(type(node.op))
    if rule is None:
      raise EvalError(f"`{_src(node)}`: operator {type(node.op).__name__} is not evaluated by the grader")
    return self.check(rule(self, a, b))

  def _Subscript(self, node: ast.Subscript) -> Any:
    base = self(node.value)
    if type(base) not in (str, bytes, list, tuple, dict, range):
      raise EvalError(f"`{_src(node)}`: subscript of a {type(base).__name__}")
    if isinstance(node.slice, ast.Slice):
      parts = [None if p is None else self(p) for p in (node.slice.lower, node.slice.upper, node.slice.step)]
      for p in parts:
        if p is not None and type(p) not in (int, bool):
          raise EvalError(f"`{_src(node)}`: slice bounds must be ints")
      return base[slice(*parts)]  # never larger than the base
    return base[self(node.slice)]

  def _Call(self, node: ast.Call) -> Any:
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
      raise EvalError(f"`{_src(node)}`: * or ** arguments are not evaluated by the grader")
    if isinstance(node.func, ast.Attribute):
      obj = self(node.func.value)
      if obj is not MATH_MODULE:  # `math.f(...)` (or an alias of math) is a function, the rest methods
        return self._method(node, obj)
    if isinstance(node.func, ast.Name) and node.func.id == "isinstance" and "isinstance" not in self.names:
      if len(node.args) != 2 or node.keywords:
        raise EvalError(f"`{_src(node)}`: isinstance takes (value, type or tuple of types)")
      return isinstance(self(node.args[0]), plain_types(node.args[1]))
    fn = self._Attribute(node.func, MATH_MODULE) if isinstance(node.func, ast.Attribute) else self(node.func)
    if not isinstance(fn, _Function):
      raise EvalError(f"`{_src(node)}`: calls {type(fn).__name__}, not a function the grader knows")
    return self.check(fn(self, [self(a) for a in node.args], {k.arg: self(k.value) for k in node.keywords}))

  def _method(self, node: ast.Call, obj: Any) -> Any:
    name = node.func.attr
    rule = METHODS.get((type(obj), name))
    if rule is None:
      raise EvalError(f"`{_src(node)}`: method {type(obj).__name__}.{name} is not evaluated by the grader")
    args = [self(a) for a in node.args]
    kwargs = {k.arg: self(k.value) for k in node.keywords}
    if rule is not True:
      rule(self, obj, args, kwargs)  # a size check before the call
    return self.check(getattr(obj, name)(*args, **kwargs))


def _unpack(target: ast.expr, value: Any) -> dict[str, Any]:
  """A comprehension's `for` target bound to one item: a name, or (nested) tuples of names."""
  if isinstance(target, ast.Name):
    return {target.id: value}
  if isinstance(target, (ast.Tuple, ast.List)) and not any(isinstance(e, ast.Starred) for e in target.elts):
    if type(value) not in (tuple, list, str, bytes) or len(value) != len(target.elts):
      raise EvalError(f"cannot unpack a {type(value).__name__} into `{_src(target)}`")
    out = {}
    for t, v in zip(target.elts, value):
      out.update(_unpack(t, v))
    return out
  raise EvalError(f"`{_src(target)}`: a loop target other than names is not evaluated by the grader")
