"""The harness the sandbox runs for `code.run_tests`, and the decoding of what it reports (plain data only).

Inside, the harness loads the solution, runs each test's steps and writes one JSON line per test to the
report pipe: the values of its "eval" steps, tagged so tuples, sets, dicts and bytes survive. Here,
`parse_report` keeps the first well-formed line per test and decodes it back to exact plain types; a
line the harness did not write (the program's own) decides nothing: it is skipped, or its values are
compared like any other. Ints of more than 4300 digits are refused (decimal -> int is quadratic).
"""

from __future__ import annotations

import json
from typing import Any

from k2jax.sandbox.expr import MAX_STR_DIGITS

HARNESS = r'''
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
_TAGS = {"tuple": tuple, "set": set, "frozenset": frozenset}
_MAX_DEPTH = 66


def parse_report(report: str, n_tests: int) -> dict[int, tuple[str, Any]]:
  """test index -> ("values", [decoded]) | ("error", text); the first well-formed line per test counts."""
  out: dict[int, tuple[str, Any]] = {}
  for line in report.splitlines():
    try:
      obj = json.loads(line, parse_int=_parse_int)
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


def _parse_int(text: str) -> int:
  if len(text) > MAX_STR_DIGITS:  # decimal -> int is quadratic in the digits
    raise ValueError(f"an int of {len(text)} digits crossed the boundary (cap {MAX_STR_DIGITS})")
  return int(text)
