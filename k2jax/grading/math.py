"""The one math grader of RL and evaluation: the last \\boxed{} answer against the reference, by HF math-verify.

math-verify (the grader of lighteval, open-r1 and verl's math reward) parses both sides' LaTeX into sympy
(sets, intervals, tuples, matrices, equations, units, `\\$`, `%`, degrees, `\\text{}` words) and compares them
numerically and symbolically. Measured on a table of MATH-500-shaped pairs (tests/rl/test_math_grader.py,
docs/results.md): the regex-to-sympy converter this replaced was wrong on 22 of 67 (8 false positives: it erased
every `\\text{...}`, so `\\boxed{\\text{}}` matched any text answer), math-verify 0.9.0 on none.

One rule of ours stays, where math-verify is measurably wrong: a reference that is a list of choice letters in
`\\text{}` (MATH's "enter the letters, separated by commas") compares as a set of letters, so `A, C` and
`C, A` match `\\text{A, C}` (math-verify: false for both; the case is in the test table).

Where it runs: math-verify bounds its time with `signal.alarm`, which works only in a main thread, and RL
rewards run in threads and processes. Each grade goes to a worker process (`math_worker.py`, a small pool
per process, `math_pool.py`, started on first use) whose main thread runs math-verify with its timeouts on; the caller waits
at most `_deadline(timeout)` for the reply and kills a worker that overruns it (a C call a signal cannot
stop). So a grade never hangs a rollout and works from any thread; a timed-out grade is 0.0 with the reason
and `info["timed_out"]`, and a `GradingBudget` bounds the seconds one RL batch spends grading.

Nothing an answer holds may crash or hang the grader: the worker guards each step that sees the answer (an
exception there, like sympy refusing to print `\\binom{20000}{10000}`'s 6,000 digits, grades the answer
wrong), and a worker that dies on a request is replaced and asked once more (dying twice, the answer is
graded wrong). What stays an error: a worker that cannot start or breaks the protocol raises `RuntimeError`
(an infrastructure error for the reward contract, never a verdict), and a reference math-verify cannot read
as mathematics raises `ValueError` (the task's data is wrong; it would score every sample 0).
"""

from __future__ import annotations

import math
import re
import threading
import time
from importlib.metadata import version
from typing import NamedTuple

from k2jax.grading import math_pool
from k2jax.grading.base import Completion, Prompt, RewardResult

GRADER_VERSION = (
  f"math-verify {version('math-verify')}; sympy {version('sympy')}; k2jax letter-list rule 1, boxed extraction 2"
)
TIMEOUT_S = 3  # math-verify's own limit per parse and per comparison (seconds, whole)
_MAX_LEN = 1000  # longer answers are refused before parsing (no MATH answer comes close)


class GradingBudget:
  """Seconds of math grading one RL batch may spend, summed over its grades (threads grade in parallel).

  A grade gets at most what is left (its math-verify limit and deadline shrink to fit); once none is left, an
  answer is not graded and scores 0 as a timeout. So a policy that learns to write slow expressions costs
  each batch at most `seconds` (plus the grades already running: `reward_workers` times one deadline), not
  one timeout per completion. `start()` opens a new batch; `seconds=0` bounds nothing.
  """

  def __init__(self, seconds: float):
    if seconds < 0:
      raise ValueError(f"GradingBudget: seconds must be >= 0 (0 = unbounded), got {seconds}")
    self.seconds = float(seconds)
    self._lock = threading.Lock()
    self.spent = 0.0

  def start(self) -> None:
    with self._lock:
      self.spent = 0.0

  def left(self) -> float:
    with self._lock:
      return math.inf if not self.seconds else self.seconds - self.spent

  def spend(self, seconds: float) -> None:
    with self._lock:
      self.spent += seconds


def math_reward(prompt: Prompt, completion: Completion, budget: GradingBudget | None = None) -> RewardResult:
  """1.0 if the last \\boxed{} answer equals `prompt.data['answer']`, else 0.0 with the reason.
  `info["timed_out"]` marks a grade that ran out of time (math-verify's limit, the deadline or `budget`);
  a reference math-verify cannot read as mathematics raises ValueError (the task's data is wrong)."""
  if "answer" not in prompt.data:
    raise KeyError(f"math_reward: prompt {prompt.prompt_id} has no data['answer']")
  answer = extract_boxed(completion.text)
  if answer is None:
    return RewardResult(0.0, "no \\boxed{} answer")
  try:
    grade = _equivalent(answer.strip(), str(prompt.data["answer"]).strip(), TIMEOUT_S, budget)
  except ValueError as e:
    raise ValueError(f"math_reward: prompt {prompt.prompt_id} (task {prompt.task!r}): {e}") from None
  return RewardResult(float(grade.ok), grade.why, {"extracted": answer, "timed_out": grade.timed_out})


_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def extract_boxed(text: str) -> str | None:
  """Content of the last outermost \\boxed{...} or \\fbox{...}, braces balanced (`\\boxed 5` without braces:
  its first word); None when absent or unbalanced. A box inside another is part of the outer one's content."""
  found, pos = None, 0
  while (m := _BOX.search(text, pos)) is not None:
    i = m.end()
    while i < len(text) and text[i] in " \t":
      i += 1
    if i < len(text) and text[i] == "{":
      end = _closing_brace(text, i)
      found = None if end is None else text[i + 1 : end].strip()
      pos = len(text) if end is None else end + 1
    else:  # \boxed 5. Check ... : the word after it, never a brace further on
      word = re.match(r"\S+", text[i:]) if i > m.end() else None
      found = word.group(0).rstrip("$.,") or None if word else None
      pos = i + (word.end() if word else 0)
  return found


def _closing_brace(text: str, i: int) -> int | None:
  depth = 0
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return j
  return None


def equivalent(
  candidate: str, reference: str, timeout: int = TIMEOUT_S, budget: GradingBudget | None = None
) -> tuple[bool, str]:
  """(candidate's answer equals the reference, why): math-verify's verdict (the reference is its gold).
  ValueError when math-verify cannot read the reference as mathematics (bad task data)."""
  grade = _equivalent(candidate.strip(), reference.strip(), int(timeout), budget)
  return grade.ok, grade.why


def same_answer(a: str, b: str) -> bool:
  """Whether two extracted answers are one answer (maj@k's classes): each equals the other as a reference
  (an answer math-verify cannot read as a reference is only itself)."""
  if a.strip() == b.strip():
    return True
  try:
    return equivalent(a, b)[0] and equivalent(b, a)[0]
  except ValueError:
    return False


class _Grade(NamedTuple):
  ok: bool
  why: str
  timed_out: bool = False
  bad_reference: str = ""  # why the reference is not mathematics math-verify reads ('' = it is)


def _equivalent(candidate: str, reference: str, timeout: int, budget: GradingBudget | None = None) -> _Grade:
  key = (candidate, reference, timeout)
  hit = _CACHE.get(key)
  if hit is None:
    hit = _grade(candidate, reference, timeout, budget)
    if not hit.timed_out:  # a timeout may be the machine's load, not the answer: asked again next time
      with _CACHE_LOCK:
        if len(_CACHE) >= _CACHE_SIZE:
          _CACHE.pop(next(iter(_CACHE)))  # the oldest entry
        _CACHE[key] = hit
  if hit.bad_reference:
    raise ValueError(hit.bad_reference)
  return hit


_CACHE: dict[tuple[str, str, int], _Grade] = {}
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 8192


def _grade(candidate: str, reference: str, timeout: int, budget: GradingBudget | None) -> _Grade:
  if not reference:
    return _Grade(False, "", bad_reference="the reference answer is empty")
  if len(reference) > _MAX_LEN:
    return _Grade(False, "", bad_reference=f"the reference answer is longer than {_MAX_LEN} characters")
  if not candidate:
    return _Grade(False, "empty answer")
  if len(candidate) > _MAX_LEN:
    return _Grade(False, f"answer longer than {_MAX_LEN} characters")
  letters = _letter_list(reference, in_text=True)
  if letters is not None:
    got = _letter_list(candidate, in_text=False)
    ok = got == letters
    return _Grade(ok, f"choice letters {sorted(got or ())} {'==' if ok else '!='} {sorted(letters)}")
  deadline = _deadline(timeout)
  left = budget.left() if budget is not None else math.inf
  if left <= 0:
    return _Grade(False, f"not graded: the batch's math grading budget ({budget.seconds:g} s) is spent", True)
  if left < deadline:  # the grade fits what is left of the budget
    timeout = max(1, min(timeout, int(left // 6)))
    deadline = left
  t0 = time.monotonic()
  try:
    reply = math_pool.POOL.ask({"pred": candidate, "gold": reference, "timeout": timeout}, deadline)
  finally:
    if budget is not None:
      budget.spend(time.monotonic() - t0)
  if reply is None:
    return _Grade(False, f"grader timed out ({deadline:.0f} s, worker killed)", True)
  if reply["error"].startswith("gold"):
    return _Grade(False, "", bad_reference=f"math-verify fails on the reference {reference!r}: {reply['error']}")
  if reply["timed_out"] and not reply["ok"]:
    return _Grade(False, f"grader timed out (math-verify's {timeout} s limit) on {candidate!r} vs {reference!r}", True)
  if not reply["gold_math"]:
    return _Grade(False, "", bad_reference=f"math-verify cannot read the reference {reference!r} as mathematics")
  if reply["error"]:  # the answer made math-verify or sympy raise: a wrong answer, not a grader failure
    return _Grade(False, f"the grader fails on the answer {candidate[:100]!r}, graded wrong ({reply['error']})")
  if not reply["pred"]:
    return _Grade(False, f"could not parse the answer {candidate!r}")
  return _Grade(reply["ok"], f"{reply['pred']} {'==' if reply['ok'] else '!='} {reply['gold']} (math-verify)")


def _deadline(timeout: int) -> float:
  # Two parses and up to four comparisons (math-verify pairs each side's sympy and string forms), plus slack.
  return 6.0 * timeout + 2.0


_LETTERS = re.compile(r"\(?[A-Z]\)?(?:\s*,\s*\(?[A-Z]\)?)*")
_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")


def _letter_list(s: str, in_text: bool) -> frozenset[str] | None:
  """The letters of `(A), (C)`-style answers as a set; with `in_text`, only when written inside \\text{}."""
  s = s.strip().strip("$").strip()
  unwrapped = _WRAP.sub(r"\1", s)
  if in_text and unwrapped == s:
    return None
  unwrapped = unwrapped.strip() if in_text else unwrapped.strip().upper()  # a reply may write (c) for (C)
  if not _LETTERS.fullmatch(unwrapped):
    return None
  return frozenset(re.findall(r"[A-Z]", unwrapped))
