"""The math grader's worker process: math-verify in a main thread, where its signal-based timeouts work.

Run as a script (`python math_worker.py`, never imported as part of k2jax, so it starts in half a second with
only math-verify loaded) by `k2jax.grading.math`. Protocol: once math-verify is imported, one line
`{"ready": true}`; then one JSON request per line on stdin, `{"pred": <LaTeX>, "gold": <LaTeX>, "timeout":
<seconds>}`, and one JSON reply per line on stdout:

  {"ok": bool, "timed_out": bool, "pred": <parsed, as text>, "gold": <parsed, as text>,
   "gold_math": <the reference parsed into a mathematical object, not only kept as its string>,
   "error": "" | "<step>: <exception>"}

Every step that sees the answer (parsing it, comparing) runs under a guard: an exception there (sympy
refusing to print a 6,000-digit integer, a recursion limit, memory) is the answer's, reported in `error` and
graded wrong by the parent, never this process's death; printing a parsed form for the reason cannot fail. The reference's own parse
failing is reported as `gold: ...` (bad task data). Printed forms are cut to `_TEXT_CHARS`. math-verify's own
timeouts (`signal.alarm`, per parse and per comparison) bound the time Python code can take; the parent's
deadline bounds the rest (a C call that signals cannot interrupt), killing this process.
"""

import json
import logging
import sys

_TEXT_CHARS = 200  # of a parsed form, in a reply (the reason a verdict prints)
_ERROR_CHARS = 300


class _Timeouts(logging.Handler):
  """Counts math-verify's "Timeout during ..." warnings: how a timed-out parse or comparison shows itself."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.count = 0

  def emit(self, record):
    if "Timeout" in record.getMessage():
      self.count += 1


def _text(parsed) -> str:
  """The sympy form of the first extraction, for the reason (only printed: a form that cannot be printed, like
  an integer past Python's int-to-string digit limit, is named by its type)."""
  try:
    return ", ".join(str(p)[: _TEXT_CHARS + 1] for p in parsed[:1])[:_TEXT_CHARS]
  except Exception as e:  # noqa: BLE001  printing is for the reason only; it must not fail a grade
    return f"<a {type(parsed[0]).__name__} that does not print: {type(e).__name__}>"


def _guarded(step: str, errors: list, fn, default):
  try:
    return fn()
  except Exception as e:  # noqa: BLE001  whatever the answer makes math-verify or sympy raise is the answer's
    errors.append(f"{step}: {type(e).__name__}: {str(e)[:_ERROR_CHARS]}")
    return default


def grade(request: dict, parse, verify) -> dict:
  limit = max(1, int(request["timeout"]))
  errors: list[str] = []
  gold = _guarded("gold", errors, lambda: parse(f"${request['gold']}$", parsing_timeout=limit), [])
  gold_math = any(not isinstance(g, str) for g in gold)
  if errors:  # the reference's own failure: reported as such, the answer never graded against it
    return {"ok": False, "timed_out": False, "pred": "", "gold": "", "gold_math": False, "error": errors[0]}
  pred = _guarded("answer", errors, lambda: parse(f"\\boxed{{{request['pred']}}}", parsing_timeout=limit), [])
  ok = bool(gold) and bool(pred) and not errors
  ok = ok and bool(_guarded("compare", errors, lambda: verify(gold, pred, timeout_seconds=limit), False))
  return {
    "ok": ok,
    "pred": _text(pred),
    "gold": _text(gold),
    "gold_math": gold_math,
    "error": errors[0][:_ERROR_CHARS] if errors else "",
  }


def main() -> None:
  timeouts = _Timeouts()
  log = logging.getLogger("math_verify")
  log.addHandler(timeouts)
  log.propagate = False  # the warnings are counted, not printed
  from math_verify import parse, verify

  sys.stdout.write(json.dumps({"ready": True}) + "\n")
  sys.stdout.flush()
  for line in sys.stdin:
    before = timeouts.count
    reply = grade(json.loads(line), parse, verify)
    reply["timed_out"] = timeouts.count > before
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
