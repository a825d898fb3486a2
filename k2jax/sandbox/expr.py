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
import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

MAX_INT_BITS = 1 << 16  # ints the grader builds; multiplying two of these stays microseconds
MAX_STR_DIGITS = 4300  # int <-> decimal str conversion is quadratic past this (CPython's own default cap)


class EvalError(ValueError):
  """The grader does not evaluate this expression (it names the node)."""


class LimitError(EvalError):
  """A result would exceed the grader's budget; nothing was allocated."""


@dataclasses.dataclass(frozen=True)
class Budget:
  max_items: int = 1 << 18  # elements + characters + int words of any one value the grader builds


class Slot(ast.expr):
  """A leaf `code.py` puts in a check: value `index` of `kind` ("value": from the sandbox, "const": ours)."""

  _fields = ()

  def __init__(self, kind: str, index: int):
    super().__init__()
    self.kind, self.index = kind, index


def items(v: Any, cap: int) -> int:
  """Size of `v` in budget units, counting stops once it passes `cap` (so it is O(cap) at worst)."""
  total, stack = 0, [v]
  while stack and total <= cap:
    x = stack.pop()
    t = type(x)
    if t in (str, bytes):
      total += 1 + len(x)
    elif t is int:
      total += 1 + x.bit_length() // 64
    elif t in (list, tuple, set, frozenset):
      total += 1
      stack.extend(x)
    elif t is dict:
      total += 1
      stack.extend(x.keys())
      stack.extend(x.values())
    else:  # None, bool, float, range, dict views: O(1), or already counted in their dict
      total += 1
  return total


class Evaluator:
  """Evaluates one trusted AST (the test's) over `slots`; `names` maps test constants to values."""

  def __init__(self, budget: Budget, slots: Mapping[tuple[str, int], Any] = {}, names: Mapping[str, Any] = {}):
    self.budget, self.slots, self.names = budget, slots, names

  def __call__(self, node: ast.AST) -> Any:
    method = getattr(self, "_" + type(node).__name__, None)
    if method is None:
      raise EvalError(f"`{_src(node)}`: {type(node).__name__} is not evaluated by the grader")
    return method(node)

  def check(self, value: Any) -> Any:
    if type(value) is int and value.bit_length() > MAX_INT_BITS:
      raise LimitError(f"an int of {value.bit_length()} bits (grader cap {MAX_INT_BITS})")
    n = items(value, self.budget.max_items)
    if n > self.budget.max_items:
      raise LimitError(f"a value of more than {self.budget.max_items} items (grader cap)")
    return value

  def need(self, n: int, what: str) -> None:
    if n > self.budget.max_items:
      raise LimitError(f"{what} would build about {n} items (grader cap {self.budget.max_items})")

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


PLAIN_TYPES = {t.__name__: t for t in (int, float, bool, str, bytes, list, tuple, dict, set, frozenset, range)}


def plain_types(node: ast.expr) -> tuple[type, ...]:
  """The second argument of an isinstance: names of plain types, or a tuple of them."""
  names = node.elts if isinstance(node, ast.Tuple) else [node]
  if not all(isinstance(n, ast.Name) and n.id in PLAIN_TYPES for n in names):
    raise EvalError(f"`{_src(node)}`: isinstance against types other than {sorted(PLAIN_TYPES)}")
  return tuple(PLAIN_TYPES[n.id] for n in names)


# --- operator rules: each checks the result's size from its operands' before building it -------------------


def _numbers(what: str, *vs) -> None:
  for v in vs:
    if type(v) not in (int, float, bool):
      raise EvalError(f"{what} on a {type(v).__name__} (the grader applies it to numbers only)")


def _add(ev: Evaluator, a, b):
  if type(a) in (int, float, bool) and type(b) in (int, float, bool):
    return a + b
  if type(a) is type(b) and type(a) in (str, bytes, list, tuple):
    ev.need(items(a, ev.budget.max_items) + items(b, ev.budget.max_items), "+")
    return a + b
  raise EvalError(f"+ between {type(a).__name__} and {type(b).__name__}")


def _mul(ev: Evaluator, a, b):
  if type(a) in (int, float, bool) and type(b) in (int, float, bool):
    if type(a) is int and type(b) is int and a.bit_length() + b.bit_length() > MAX_INT_BITS:
      raise LimitError(f"an int product of about {a.bit_length() + b.bit_length()} bits (grader cap {MAX_INT_BITS})")
    return a * b
  seq, n = (a, b) if type(b) in (int, bool) else (b, a)
  if type(seq) in (str, bytes, list, tuple) and type(n) in (int, bool):
    ev.need(items(seq, ev.budget.max_items) * max(n, 0), "sequence * int")
    return seq * n
  raise EvalError(f"* between {type(a).__name__} and {type(b).__name__}")


def _pow(ev: Evaluator, a, b):
  _numbers("**", a, b)
  if type(a) is int and type(b) is int and b > 0 and abs(a) > 1 and a.bit_length() * b > MAX_INT_BITS:
    raise LimitError(f"an int power of about {a.bit_length() * b} bits (grader cap {MAX_INT_BITS})")
  try:
    return a**b
  except OverflowError as e:
    raise EvalError(f"** overflows: {e}") from e


def _lshift(ev: Evaluator, a, b):
  if type(a) not in (int, bool) or type(b) not in (int, bool):
    raise EvalError("<< on non-ints")
  if a and a.bit_length() + b > MAX_INT_BITS:
    raise LimitError(f"an int shift to about {a.bit_length() + b} bits (grader cap {MAX_INT_BITS})")
  return a << b


def _arith(op: Callable) -> Callable:
  def rule(ev, a, b):
    _numbers(op.__name__, a, b)  # `%` on a str would format a program-chosen spec: numbers only
    return op(a, b)

  return rule


def _bits(op: Callable) -> Callable:
  def rule(ev, a, b):
    if type(a) in (int, bool) and type(b) in (int, bool):
      return op(a, b)
    if isinstance(a, (set, frozenset)) and isinstance(b, (set, frozenset)):
      return op(a, b)  # never larger than both operands together
    raise EvalError(f"{op.__name__} between {type(a).__name__} and {type(b).__name__}")

  return rule


_BINOPS = {
  ast.Add: _add,
  ast.Sub: lambda ev, a, b: (
    _bits(operator.sub)(ev, a, b) if isinstance(a, (set, frozenset)) else _arith(operator.sub)(ev, a, b)
  ),
  ast.Mult: _mul,
  ast.Div: _arith(operator.truediv),
  ast.FloorDiv: _arith(operator.floordiv),
  ast.Mod: _arith(operator.mod),
  ast.Pow: _pow,
  ast.LShift: _lshift,
  ast.RShift: _arith(operator.rshift),
  ast.BitAnd: _bits(operator.and_),
  ast.BitOr: _bits(operator.or_),
  ast.BitXor: _bits(operator.xor),
}
_COMPARE = {
  ast.Eq: operator.eq,
  ast.NotEq: operator.ne,
  ast.Lt: operator.lt,
  ast.LtE: operator.le,
  ast.Gt: operator.gt,
  ast.GtE: operator.ge,
  ast.In: lambda a, b: operator.contains(b, a),
  ast.NotIn: lambda a, b: not operator.contains(b, a),
  ast.Is: operator.is_,
  ast.IsNot: operator.is_not,
}


# --- functions: builtins and math, each with its own size rule ------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Function:
  name: str
  fn: Callable

  def __call__(self, ev: Evaluator, args: list, kwargs: dict) -> Any:
    try:
      return self.fn(ev, *args, **kwargs)
    except EvalError:
      raise
    except (TypeError, ValueError, ArithmeticError, KeyError, IndexError) as e:
      raise EvalError(f"{self.name}(): {type(e).__name__}: {e}"[:200]) from e


def _iterable(ev: Evaluator, v, what: str):
  if type(v) is range:
    ev.need(len(v), f"{what}(range)")
  elif type(v) not in (
    str,
    bytes,
    list,
    tuple,
    set,
    frozenset,
    dict,
    type({}.keys()),
    type({}.values()),
    type({}.items()),
  ):
    raise EvalError(f"{what}() of a {type(v).__name__}")
  return v


def _collect(kind):
  return lambda ev, *a: kind(_iterable(ev, a[0], kind.__name__)) if a else kind()


def _int(ev, v=0, base=None):
  if type(v) in (str, bytes) and len(v) > MAX_STR_DIGITS:
    raise LimitError(f"int() of a {len(v)}-character string (quadratic; grader cap {MAX_STR_DIGITS})")
  return int(v) if base is None else int(v, base)


def _float(ev, v=0.0):
  if type(v) in (str, bytes) and len(v) > MAX_STR_DIGITS:
    raise LimitError(f"float() of a {len(v)}-character string (grader cap {MAX_STR_DIGITS})")
  return float(v)


def _abs(ev, x):
  _numbers("abs()", x)
  return abs(x)


def _str(ev, v=""):
  if type(v) is int and v.bit_length() > MAX_STR_DIGITS * 3:
    raise LimitError(f"str() of an int of {v.bit_length()} bits (quadratic; grader cap {MAX_STR_DIGITS} digits)")
  ev.need(10 * items(v, ev.budget.max_items), "str()")  # a repr escapes a character to at most 10
  return str(v)


def _range(ev, *a):
  for x in a:
    if type(x) not in (int, bool):
      raise EvalError("range() of non-ints")
  return range(*a)  # lazy: materialising it is checked where it happens


def _sum(ev, v, start=0):
  _numbers("sum() start", start)
  vs = list(_iterable(ev, v, "sum"))
  _numbers("sum()", *vs)  # summing lists or strings would be quadratic
  return sum(vs, start)


def _round(ev, x, ndigits=None):
  if ndigits is not None and abs(ndigits) > 400:
    raise EvalError("round(): ndigits beyond 400")
  return round(x) if ndigits is None else round(x, ndigits)


def _minmax(fn):
  def rule(ev, *a, **kw):
    if set(kw) - {"default"}:
      raise EvalError(f"{fn.__name__}(): only default= is evaluated")
    return fn(_iterable(ev, a[0], fn.__name__), **kw) if len(a) == 1 else fn(*a, **kw)

  return rule


def _sorted(ev, v, reverse=False):
  return sorted(_iterable(ev, v, "sorted"), reverse=bool(reverse))


def _factorial(ev, n):
  if type(n) is not int or n > 2000:
    raise LimitError("math.factorial beyond 2000 (grader cap)")
  return math.factorial(n)


FUNCTIONS = {
  f.name: f
  for f in (
    _Function("abs", _abs),
    _Function("all", lambda ev, v: all(_iterable(ev, v, "all"))),
    _Function("any", lambda ev, v: any(_iterable(ev, v, "any"))),
    _Function("bool", lambda ev, v=False: bool(v)),
    _Function("dict", _collect(dict)),
    _Function("float", _float),
    _Function("frozenset", _collect(frozenset)),
    _Function("int", _int),
    _Function("len", lambda ev, v: len(_iterable(ev, v, "len") if type(v) is not range else v)),
    _Function("list", _collect(list)),
    _Function("max", _minmax(max)),
    _Function("min", _minmax(min)),
    _Function("range", _range),
    _Function("round", _round),
    _Function("set", _collect(set)),
    _Function("sorted", _sorted),
    _Function("str", _str),
    _Function("sum", _sum),
    _Function("tuple", _collect(tuple)),
    _Function("chr", lambda ev, i: chr(i)),
    _Function("ord", lambda ev, c: ord(c)),
  )
}
MATH_MODULE = object()  # the `math` module as the grader sees it: only the names below
MATH_CONSTANTS = {n: getattr(math, n) for n in ("pi", "e", "tau", "inf", "nan")}


def _math(fn: Callable) -> Callable:
  return lambda ev, *a, **kw: fn(*a, **kw)  # float functions and gcd: cost bounded by their inputs


MATH_FUNCTIONS = {
  n: _Function(f"math.{n}", _math(getattr(math, n)))
  for n in ("sqrt", "isclose", "isfinite", "isinf", "isnan", "fabs", "floor", "ceil", "trunc", "exp", "log")
  + ("log2", "log10", "sin", "cos", "tan", "atan", "atan2", "hypot", "gcd", "copysign")
}
MATH_FUNCTIONS["factorial"] = _Function("math.factorial", _factorial)


def _codec(ev, s, args, kwargs):
  name = (args or [kwargs.get("encoding", "utf-8")])[0]
  if name not in ("utf-8", "utf8", "ascii", "latin-1", "latin1", "utf-16", "utf-32"):  # punycode is quadratic
    raise EvalError(f"encoding {name!r}: the grader evaluates utf-8, ascii, latin-1, utf-16 and utf-32 only")


def _pad(ev, s, args, kwargs):
  ev.need(max([a for a in args if type(a) is int] or [0]), "padding")


def _replace(ev, s, args, kwargs):
  old, new = args[0], args[1]
  n = (len(s) + 1) if not old else s.count(old)
  ev.need(len(s) + n * len(new), "str.replace")


def _join(ev, sep, args, kwargs):
  parts = list(_iterable(ev, args[0], "join"))
  ev.need(sum(items(p, ev.budget.max_items) for p in parts) + len(sep) * len(parts), "str.join")


_STR_METHODS = ("upper", "lower", "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith")
_STR_METHODS += ("endswith", "find", "rfind", "index", "rindex", "count", "isdigit", "isalpha", "isalnum")
_STR_METHODS += ("isspace", "isupper", "islower", "isdecimal", "isnumeric", "title", "capitalize", "swapcase")
_STR_METHODS += ("casefold", "partition", "rpartition")
METHODS: dict[tuple[type, str], Any] = {}
for _t in (str, bytes):
  METHODS.update({(_t, m): True for m in _STR_METHODS if hasattr(_t, m)})
  METHODS.update({(_t, "replace"): _replace, (_t, "join"): _join})
  METHODS.update({(_t, m): _pad for m in ("center", "ljust", "rjust", "zfill")})
METHODS.update({(str, "encode"): _codec, (bytes, "decode"): _codec, (bytes, "hex"): True})
METHODS.update({(t, m): True for t in (list, tuple) for m in ("count", "index")})
METHODS.update({(dict, m): True for m in ("keys", "values", "items", "get")})
METHODS.update({(t, m): True for t in (set, frozenset) for m in ("issubset", "issuperset", "isdisjoint")})
METHODS.update({(t, m): True for t in (set, frozenset) for m in ("union", "intersection", "difference")})


def _src(node: ast.AST) -> str:
  try:
    return ast.unparse(node)[:80]
  except (AttributeError, TypeError, ValueError):  # a Slot has no source
    return type(node).__name__
