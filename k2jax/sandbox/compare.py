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
"""

from __future__ import annotations

import decimal
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


__all__ = ["COMPARE_MODES", "compare_output", "values_equal"]
