"""Math answer reward: extract the last \\boxed{...}, compare to the reference numerically and symbolically.

LaTeX is rewritten into sympy syntax by a small converter (fractions, roots, powers, common functions and
constants) instead of `sympy.parsing.latex`, which needs the antlr4 runtime at one pinned version; answers
in RL data are short expressions, which this covers. Equivalence: exact string match after normalisation,
else numeric closeness for constants, else agreement at random points for expressions with variables
(bounded cost, unlike open-ended `simplify`). Tuples/lists compare elementwise.
"""

from __future__ import annotations

import cmath
import random
import re

import sympy
from sympy.parsing.sympy_parser import (
  convert_xor,
  implicit_multiplication_application,
  parse_expr,
  standard_transformations,
)

from k2jax.rl.rewards.base import Completion, Prompt, RewardResult

_TRANSFORMS = standard_transformations + (implicit_multiplication_application, convert_xor)
_LOCALS = {
  "pi": sympy.pi,
  "e": sympy.E,
  "oo": sympy.oo,
  "sqrt": sympy.sqrt,
  "log": sympy.log,
  "ln": sympy.log,
  "sin": sympy.sin,
  "cos": sympy.cos,
  "tan": sympy.tan,
  "exp": sympy.exp,
}
_MAX_LEN = 300
_MAX_EXPONENT = 1000  # refuse 10^(10^10)-style answers before sympy tries to evaluate them


def math_reward(prompt: Prompt, completion: Completion) -> RewardResult:
  """1.0 if the last \\boxed{} answer equals `prompt.data['answer']`, else 0.0 with the reason."""
  if "answer" not in prompt.data:
    raise KeyError(f"math_reward: prompt {prompt.prompt_id} has no data['answer']")
  answer = extract_boxed(completion.text)
  if answer is None:
    return RewardResult(0.0, "no \\boxed{} answer")
  ok, why = equivalent(answer, str(prompt.data["answer"]))
  return RewardResult(float(ok), why, {"extracted": answer})


def extract_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} or \\fbox{...}, braces balanced; None when absent or unbalanced."""
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    return None
  i = text.find("{", start)
  if i < 0:
    m = re.match(r"\\boxed\s+(\S+)", text[start:])  # \boxed 5
    return m.group(1).rstrip("$.") if m else None
  depth = 0
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i + 1 : j].strip()
  return None


def equivalent(candidate: str, reference: str) -> tuple[bool, str]:
  a, b = normalize(candidate), normalize(reference)
  if a == b:
    return True, "exact match"
  try:
    ea, eb = _parse(a), _parse(b)
  except Exception as e:  # sympy raises many types on bad syntax
    return False, f"could not parse {candidate!r} or {reference!r}: {type(e).__name__}"
  if isinstance(ea, tuple) != isinstance(eb, tuple) or (isinstance(ea, tuple) and len(ea) != len(eb)):
    return False, f"{candidate!r} and {reference!r} differ in structure"
  pairs = zip(ea, eb) if isinstance(ea, tuple) else [(ea, eb)]
  for x, y in pairs:
    if not _same_value(x, y):
      return False, f"{candidate!r} != {reference!r}"
  return True, "equivalent"


def normalize(s: str) -> str:
  """LaTeX answer -> sympy-parsable string."""
  s = s.strip().strip("$").strip()
  s = re.sub(r"\\text\{\s*(or|and)\s*\}", ",", s)
  s = re.sub(r"\\(text|mathrm|textbf|mbox)\{[^{}]*\}", "", s)  # units and words
  s = re.sub(r"\\(left|right|displaystyle|,|;|!|quad|qquad)", "", s)
  s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("%", "")
  s = re.sub(r"\\[dt]frac", r"\\frac", s)
  if "=" in s and not re.search(r"[<>]", s):
    s = s.split("=")[-1]  # "x = 5" -> "5"
  s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
  s = re.sub(r"\\sqrt\s*(\d+|[a-z])", r"\\sqrt{\1}", s)
  for _ in range(10):  # innermost first, repeated for nesting
    new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
    new = re.sub(r"\\sqrt\[([^\[\]{}]*)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))", new)
    new = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", new)
    if new == s:
      break
    s = new
  for tex, py in (
    ("\\cdot", "*"),
    ("\\times", "*"),
    ("\\div", "/"),
    ("\\pi", "pi"),
    ("\\infty", "oo"),
    ("\\ln", "log"),
    ("\\log", "log"),
    ("\\sin", "sin"),
    ("\\cos", "cos"),
    ("\\tan", "tan"),
    ("\\exp", "exp"),
    ("{", "("),
    ("}", ")"),
    ("^", "**"),
  ):
    s = s.replace(tex, py)
  if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
    s = s.replace(",", "")  # thousands separators
  return re.sub(r"\s+", "", s).rstrip(".")


def _parse(s: str):
  if len(s) > _MAX_LEN:
    raise ValueError(f"answer longer than {_MAX_LEN} characters")
  inner = s[1:-1] if len(s) > 1 and s[0] + s[-1] in ("()", "[]") and "," in s else s
  if "," in inner:
    return tuple(_parse(part) for part in inner.split(","))
  raw = parse_expr(s, local_dict=_LOCALS, transformations=_TRANSFORMS, evaluate=False)
  for p in raw.atoms(sympy.Pow) | {x for x in sympy.preorder_traversal(raw) if isinstance(x, sympy.Pow)}:
    if p.exp.is_number and abs(float(p.exp)) > _MAX_EXPONENT:
      raise ValueError("exponent too large")
  return parse_expr(s, local_dict=_LOCALS, transformations=_TRANSFORMS)


def _same_value(x, y, tol: float = 1e-6) -> bool:
  diff = x - y
  free = sorted(diff.free_symbols, key=str)
  points = (
    [{}]
    if not free
    else [{v: random.Random(i * 31 + k).uniform(0.5, 2.5) for k, v in enumerate(free)} for i in range(6)]
  )
  for point in points:
    try:
      vx, vy = complex(x.evalf(subs=point)), complex(y.evalf(subs=point))
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
      return False  # not a number at this point (undefined function, division by zero, ...)
    if not (cmath.isfinite(vx) and cmath.isfinite(vy)):
      return False
    if abs(vx - vy) > tol * max(1.0, abs(vy)):
      return False
  return True
