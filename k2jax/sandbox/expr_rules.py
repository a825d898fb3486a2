"""What the grader may compute (`expr.Evaluator`'s tables): operators, builtins, `math`, methods of plain types.

Every rule that can build a value larger than a constant factor of its inputs checks the result's size
before computing it (`Meter.need`, `items`), and conversions that are quadratic past a size (int <->
decimal str) refuse past it. `%` applies to numbers only: on a str it would format a program-chosen spec.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from collections.abc import Callable
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


class Meter:
  """The size checks against one `Budget` that the rules call (`expr.Evaluator` is one: the rules see only
  this part of it, so this module never imports the evaluator)."""

  def __init__(self, budget: Budget):
    self.budget = budget

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


def _add(ev: Meter, a, b):
  if type(a) in (int, float, bool) and type(b) in (int, float, bool):
    return a + b
  if type(a) is type(b) and type(a) in (str, bytes, list, tuple):
    ev.need(items(a, ev.budget.max_items) + items(b, ev.budget.max_items), "+")
    return a + b
  raise EvalError(f"+ between {type(a).__name__} and {type(b).__name__}")


def _mul(ev: Meter, a, b):
  if type(a) in (int, float, bool) and type(b) in (int, float, bool):
    if type(a) is int and type(b) is int and a.bit_length() + b.bit_length() > MAX_INT_BITS:
      raise LimitError(f"an int product of about {a.bit_length() + b.bit_length()} bits (grader cap {MAX_INT_BITS})")
    return a * b
  seq, n = (a, b) if type(b) in (int, bool) else (b, a)
  if type(seq) in (str, bytes, list, tuple) and type(n) in (int, bool):
    ev.need(items(seq, ev.budget.max_items) * max(n, 0), "sequence * int")
    return seq * n
  raise EvalError(f"* between {type(a).__name__} and {type(b).__name__}")


def _pow(ev: Meter, a, b):
  _numbers("**", a, b)
  if type(a) is int and type(b) is int and b > 0 and abs(a) > 1 and a.bit_length() * b > MAX_INT_BITS:
    raise LimitError(f"an int power of about {a.bit_length() * b} bits (grader cap {MAX_INT_BITS})")
  try:
    return a**b
  except OverflowError as e:
    raise EvalError(f"** overflows: {e}") from e


def _lshift(ev: Meter, a, b):
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

  def __call__(self, ev: Meter, args: list, kwargs: dict) -> Any:
    try:
      return self.fn(ev, *args, **kwargs)
    except EvalError:
      raise
    except (TypeError, ValueError, ArithmeticError, KeyError, IndexError) as e:
      raise EvalError(f"{self.name}(): {type(e).__name__}: {e}"[:200]) from e


def _iterable(ev: Meter, v, what: str):
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
