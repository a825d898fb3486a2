"""The math grader's worker process: math-verify in a main thread, where its signal-based timeouts work.

Run as a script (`python math_worker.py`, never imported as part of k2jax, so it starts in half a second with
only math-verify loaded) by `k2jax.rl.rewards.math`. Protocol: one JSON request per line on stdin,
`{"pred": <LaTeX>, "gold": <LaTeX>, "timeout": <seconds>}`, one JSON reply per line on stdout,
`{"ok": bool, "timed_out": bool, "pred": <parsed, as text>, "gold": <parsed, as text>}`. math-verify's own
timeouts (`signal.alarm`, per parse and per comparison) bound the time Python code can take; the parent's
deadline bounds the rest (a C call that signals cannot interrupt), killing this process.
"""

import json
import logging
import sys


class _Timeouts(logging.Handler):
  """Counts math-verify's "Timeout during ..." warnings: how a timed-out parse or comparison shows itself."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.count = 0

  def emit(self, record):
    if "Timeout" in record.getMessage():
      self.count += 1


def _text(parsed) -> str:
  return ", ".join(str(p) for p in parsed[:1])[:200]  # the sympy form (first extraction), for the reason


def main() -> None:
  timeouts = _Timeouts()
  log = logging.getLogger("math_verify")
  log.addHandler(timeouts)
  log.propagate = False  # the warnings are counted, not printed
  from math_verify import parse, verify

  for line in sys.stdin:
    request = json.loads(line)
    limit = max(1, int(request["timeout"]))
    before = timeouts.count
    gold = parse(f"${request['gold']}$", parsing_timeout=limit)
    pred = parse(f"\\boxed{{{request['pred']}}}", parsing_timeout=limit)
    ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=limit)
    reply = {"ok": ok, "timed_out": timeouts.count > before, "pred": _text(pred), "gold": _text(gold)}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
