"""How a case's output is compared with the expected one (`k2jax.sandbox.verify` runs the cases).

Comparison (`CodeRewardConfig.compare`) of stdin/stdout cases, both sides' "\\r\\n" read as "\\n":
  exact    byte-for-byte equal text
  lines    LiveCodeBench's line rule: the whole text stripped, split on newlines, each line stripped; equal lists
  tokens   LiveCodeBench's `grade_stdio` (lines as above, same count; a line passes when equal, or when both
           split into the same number of tokens that are pairwise equal or both numbers within `float_tol`),
           with Codeforces testlib's absolute-or-relative tolerance |a - b| <= float_tol * max(1, |b|) where
           LiveCodeBench compares Decimals exactly (float_tol=0 gives its rule exactly). The default.
Call results compare as plain data (tuples as lists, LiveCodeBench's rule), floats within `float_tol`
(absolute or relative, EvalPlus's shape). A printed or returned prefix of the right answer fails in every mode.

Live values (graders that compare as their benchmark does, with `==` on the returned objects: EvalPlus). A
function's result crosses the process boundary as a tagged tree (`LIVE_SOURCE`, appended to the program and
run in its own process: `live_program`) and is rebuilt here as an object of the same standard type
(`live_value`): the builtins, `collections`' Counter, OrderedDict, defaultdict (as a plain dict: its factory
takes no part in `==`), deque and namedtuples (rebuilt as a namedtuple of the same name and fields), Decimal,
Fraction, numpy's numeric scalars and arrays. Only those types are ever built, so no `__eq__` the solution
defines can take part in the comparison, and the expected values never enter the solution's process.
"""

from __future__ import annotations

import collections
import decimal
import fractions
import functools
import math
from typing import Any

from k2jax.sandbox import _wire

COMPARE_MODES = ("exact", "lines", "tokens")


def _lines(text: str) -> list[str]:
  return [line.strip() for line in text.replace("\r\n", "\n").strip().split("\n")]


def _number(token: str) -> decimal.Decimal | None:
  try:
    d = decimal.Decimal(token)
  except (decimal.InvalidOperation, ValueError):
    return None
  return d if d.is_finite() else None


def compare_output(got: str, want: str, mode: str, float_tol: float) -> tuple[bool, str]:
  """(passed, why not) for one stdin/stdout case, in `mode` (module docstring)."""
  if mode == "exact":
    ok = got.replace("\r\n", "\n") == want.replace("\r\n", "\n")
    return ok, "" if ok else "output differs"
  g, w = _lines(got), _lines(want)
  if len(g) != len(w):
    return False, f"{len(g)} output lines, {len(w)} expected"
  for k, (a, b) in enumerate(zip(g, w, strict=True)):
    if a == b:
      continue
    if mode == "lines":
      return False, f"line {k + 1} differs"
    ta, tb = a.split(), b.split()
    if len(ta) != len(tb):
      return False, f"line {k + 1}: {len(ta)} tokens, {len(tb)} expected"
    for x, y in zip(ta, tb, strict=True):
      if x == y:
        continue
      dx, dy = _number(x), _number(y)
      if dx is None or dy is None:
        return False, f"line {k + 1}: token {x[:40]!r} != {y[:40]!r}"
      tol = decimal.Decimal(repr(float_tol)) * max(decimal.Decimal(1), abs(dy))
      if abs(dx - dy) > tol:
        return False, f"line {k + 1}: {x[:40]} is not within {float_tol} of {y[:40]}"
  return True, ""


def values_equal(got: Any, want: Any, float_tol: float, depth: int = 0) -> bool:
  """Plain-data equality: tuples as lists, numbers within float_tol (absolute or relative) when one is a float."""
  if depth > _wire.MAX_DEPTH + 4:
    return False
  if isinstance(got, tuple):
    got = list(got)
  if isinstance(want, tuple):
    want = list(want)
  num = (int, float)
  if type(got) in num and type(want) in num and (type(got) is float or type(want) is float):
    if math.isnan(got) or math.isnan(want):
      return math.isnan(got) and math.isnan(want)
    return math.isclose(got, want, rel_tol=float_tol, abs_tol=float_tol)
  if type(got) is list and type(want) is list:
    return len(got) == len(want) and all(values_equal(a, b, float_tol, depth + 1) for a, b in zip(got, want))
  if type(got) is dict and type(want) is dict:
    return got.keys() == want.keys() and all(values_equal(got[k], want[k], float_tol, depth + 1) for k in got)
  if type(got) is bool or type(want) is bool:
    return type(got) is type(want) and got == want
  return type(got) in (*num, str, bytes, set, frozenset, complex, type(None)) and got == want


LIVE_ENTRY = "__k2jax_live_call"  # the function `live_program` adds: the entry's result as a tagged tree
_ENCODE = "__k2jax_live_encode"
LIVE_SOURCE = f"""

def {_ENCODE}(v, depth=0):
    if depth > 64:
        raise ValueError("the result is nested deeper than 64 levels")
    t, enc = type(v), lambda x: {_ENCODE}(x, depth + 1)
    if v is None:
        return ["None", None]
    if t in (bool, int, float, str):
        return [t.__name__, v]
    if t is bytes:
        return ["bytes", v.hex()]
    if t is complex:
        return ["complex", [v.real, v.imag]]
    if t in (list, tuple, set, frozenset):
        return [t.__name__, [enc(x) for x in v]]
    if t is dict:
        return ["dict", [[enc(k), enc(x)] for k, x in v.items()]]
    mod, name = t.__module__, t.__qualname__
    if mod == "collections" and name in ("Counter", "OrderedDict", "defaultdict"):
        return [name, [[enc(k), enc(x)] for k, x in v.items()]]
    if mod == "collections" and name == "deque":
        return ["deque", [enc(x) for x in v]]
    fields = getattr(t, "_fields", None)
    if t.__bases__ == (tuple,) and type(fields) is tuple and all(type(f) is str for f in fields):
        return ["namedtuple", [t.__name__, list(fields), [enc(x) for x in v]]]
    if mod == "decimal" and name == "Decimal":
        return ["Decimal", str(v)]
    if mod == "fractions" and name == "Fraction":
        return ["Fraction", [int(v.numerator), int(v.denominator)]]
    if mod == "numpy" and getattr(getattr(v, "dtype", None), "kind", "") in ("b", "i", "u", "f", "c"):
        if v.dtype.itemsize > 16 or (v.dtype.kind == "f" and v.dtype.itemsize > 8):
            raise TypeError("numpy " + str(v.dtype) + " has no exact Python value")
        if name == "ndarray":
            return ["ndarray", [str(v.dtype), list(v.shape), [enc(x) for x in v.ravel().tolist()]]]
        return ["numpy", [str(v.dtype), enc(v.item())]]
    raise TypeError("a " + mod + "." + name + " is not a value the grader compares")
"""


def live_program(source: str, entry: str) -> str:
  """`source` with `LIVE_ENTRY(*args)`: `entry(*args)`'s result as the tagged tree `live_value` reads."""
  return f"{source}\n{LIVE_SOURCE}\n\ndef {LIVE_ENTRY}(*_a):\n    return {_ENCODE}({entry}(*_a))\n"


_NUMPY_DTYPES = frozenset(
  ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32"]
  + ["float64", "complex64", "complex128"]
)
_MAX_TEXT = 10_000  # characters of a Decimal


def live_value(tree: Any, depth: int = 0) -> Any:
  """The object a `LIVE_SOURCE` tree describes; ValueError on anything it would not have written."""
  if depth > 70:
    raise ValueError("nested too deep")
  if type(tree) is not list or len(tree) != 2 or type(tree[0]) is not str:
    raise ValueError(f"not a live-value tree: {str(tree)[:80]}")
  tag, body = tree
  try:
    return _BUILD[tag](body, depth + 1)
  except KeyError:
    raise ValueError(f"unknown live-value tag {tag[:40]!r}") from None
  except (TypeError, ArithmeticError) as e:  # unhashable keys, a zero denominator, a bad dtype
    raise ValueError(f"a {tag} that cannot be built: {e}") from None


def _scalar(kind):
  def build(body, depth):
    if type(body) is not kind:
      raise ValueError(f"a {kind.__name__} tag holding {type(body).__name__}")
    return body

  return build


def _items(body, depth):
  if type(body) is not list:
    raise ValueError("a container tag holding no list")
  return [live_value(x, depth) for x in body]


def _pairs(body, depth):
  if type(body) is not list or not all(type(p) is list and len(p) == 2 for p in body):
    raise ValueError("a mapping tag holding no list of pairs")
  return [(live_value(k, depth), live_value(v, depth)) for k, v in body]


@functools.lru_cache(maxsize=256)
def _namedtuple(name: str, fields: tuple[str, ...]):
  """One class per (name, fields), so two results of one namedtuple type have the same type here too."""
  return collections.namedtuple(name, fields)


def _build_namedtuple(body, depth):
  if type(body) is not list or len(body) != 3 or type(body[0]) is not str or type(body[1]) is not list:
    raise ValueError("a namedtuple tag without [name, fields, items]")
  name, fields, items = body[0], tuple(body[1]), _items(body[2], depth)
  if not all(type(f) is str for f in fields) or len(items) != len(fields):
    raise ValueError("a namedtuple whose fields and items differ")
  return _namedtuple(name, fields)(*items)


def _build_numpy(body, depth, array=False):
  if type(body) is not list or len(body) != (3 if array else 2) or body[0] not in _NUMPY_DTYPES:
    raise ValueError("a numpy tag without a numeric dtype")
  import numpy as np  # only for results that hold numpy values

  dtype = np.dtype(body[0])
  if not array:
    return dtype.type(live_value(body[1], depth))
  shape = body[1]
  if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape) or len(shape) > 32:
    raise ValueError("an ndarray tag without a shape")
  items = _items(body[2], depth)
  if math.prod(shape) != len(items):
    raise ValueError(f"an ndarray of shape {shape} holding {len(items)} items")
  return np.array(items, dtype=dtype).reshape(shape)


def _build_decimal(body, depth):
  if type(body) is not str or len(body) > _MAX_TEXT:
    raise ValueError("a Decimal tag without its text")
  try:
    return decimal.Decimal(body)
  except decimal.InvalidOperation:
    raise ValueError(f"not a Decimal: {body[:40]!r}") from None


def _build_fraction(body, depth):
  if type(body) is not list or len(body) != 2 or not all(type(x) is int for x in body):
    raise ValueError("a Fraction tag without [numerator, denominator]")
  return fractions.Fraction(body[0], body[1])


def _build_complex(body, depth):
  if type(body) is not list or len(body) != 2 or not all(type(x) in (int, float) for x in body):
    raise ValueError("a complex tag without [real, imag]")
  return complex(body[0], body[1])


def _build_bytes(body, depth):
  if type(body) is not str:
    raise ValueError("a bytes tag without hex")
  return bytes.fromhex(body)


def _build_none(body, depth):
  if body is not None:
    raise ValueError("a None tag holding a value")


_BUILD = {
  "None": _build_none,
  "bool": _scalar(bool),
  "int": _scalar(int),
  "float": lambda body, depth: float(body) if type(body) in (int, float) else _scalar(float)(body, depth),
  "str": _scalar(str),
  "bytes": _build_bytes,
  "complex": _build_complex,
  "list": _items,
  "tuple": lambda body, depth: tuple(_items(body, depth)),
  "set": lambda body, depth: set(_items(body, depth)),
  "frozenset": lambda body, depth: frozenset(_items(body, depth)),
  "dict": lambda body, depth: dict(_pairs(body, depth)),
  "Counter": lambda body, depth: collections.Counter(dict(_pairs(body, depth))),
  "OrderedDict": lambda body, depth: collections.OrderedDict(_pairs(body, depth)),
  "defaultdict": lambda body, depth: dict(_pairs(body, depth)),
  "deque": lambda body, depth: collections.deque(_items(body, depth)),
  "namedtuple": _build_namedtuple,
  "Decimal": _build_decimal,
  "Fraction": _build_fraction,
  "numpy": _build_numpy,
  "ndarray": functools.partial(_build_numpy, array=True),
}


__all__ = ["COMPARE_MODES", "LIVE_ENTRY", "LIVE_SOURCE", "compare_output", "live_program", "live_value", "values_equal"]
