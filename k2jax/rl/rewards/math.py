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
per process, started on first use) whose main thread runs math-verify with its timeouts on; the caller waits
at most `_deadline(timeout)` for the reply and kills a worker that overruns it (a C call a signal cannot
stop). So a grade never hangs a rollout and works from any thread; a timed-out grade is 0.0 with the reason.
A worker that cannot start or dies raises `RuntimeError` (an infrastructure error for the reward contract,
never a verdict).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import version

from k2jax.rl.rewards.base import Completion, Prompt, RewardResult

GRADER_VERSION = f"math-verify {version('math-verify')}; k2jax letter-list rule 1"
TIMEOUT_S = 3  # math-verify's own limit per parse and per comparison (seconds, whole)
_MAX_LEN = 1000  # longer answers are refused before parsing (no MATH answer comes close)
_POOL_SIZE = max(1, min(4, os.cpu_count() or 1))
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_worker.py")


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


def equivalent(candidate: str, reference: str, timeout: int = TIMEOUT_S) -> tuple[bool, str]:
  """(candidate's answer equals the reference, why): math-verify's verdict (the reference is its gold)."""
  return _equivalent(candidate.strip(), reference.strip(), int(timeout))


def same_answer(a: str, b: str) -> bool:
  """Whether two extracted answers are one answer (maj@k's classes): each equals the other as a reference."""
  return a.strip() == b.strip() or (equivalent(a, b)[0] and equivalent(b, a)[0])


def _equivalent(candidate: str, reference: str, timeout: int) -> tuple[bool, str]:
  key = (candidate, reference, timeout)
  hit = _CACHE.get(key)
  if hit is None:
    hit = _grade(candidate, reference, timeout)
    if not hit[2]:  # a timeout may be the machine's load, not the answer: asked again next time
      with _CACHE_LOCK:
        if len(_CACHE) >= _CACHE_SIZE:
          _CACHE.pop(next(iter(_CACHE)))  # the oldest entry
        _CACHE[key] = hit
  return hit[0], hit[1]


_CACHE: dict[tuple[str, str, int], tuple[bool, str, bool]] = {}
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 8192


def _grade(candidate: str, reference: str, timeout: int) -> tuple[bool, str, bool]:
  """(verdict, why, timed out)."""
  if not candidate:
    return False, "empty answer", False
  if len(candidate) > _MAX_LEN or len(reference) > _MAX_LEN:
    return False, f"answer or reference longer than {_MAX_LEN} characters", False
  letters = _letter_list(reference, in_text=True)
  if letters is not None:
    got = _letter_list(candidate, in_text=False)
    ok = got == letters
    return ok, f"choice letters {sorted(got or ())} {'==' if ok else '!='} {sorted(letters)}", False
  reply = _POOL.ask({"pred": candidate, "gold": reference, "timeout": timeout}, _deadline(timeout))
  if reply is None:
    return False, f"grader timed out ({_deadline(timeout):.0f} s, worker killed)", True
  if reply["timed_out"] and not reply["ok"]:
    return False, f"grader timed out (math-verify's {timeout} s limit) on {candidate!r} vs {reference!r}", True
  if not reply["pred"]:
    return False, f"could not parse the answer {candidate!r}", False
  if not reply["gold"]:
    return False, f"could not parse the reference {reference!r}", False
  return reply["ok"], f"{reply['pred']} {'==' if reply['ok'] else '!='} {reply['gold']} (math-verify)", False


def _deadline(timeout: int) -> float:
  # Two parses and up to four comparisons (math-verify pairs each side's sympy and string forms), plus start-up.
  return 6.0 * timeout + 10.0


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


class _Worker:
  def __init__(self):
    self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close(), with the process
    try:
      self.proc = subprocess.Popen(
        [sys.executable, "-P", "-u", _WORKER],  # -P: not its folder (math.py) on sys.path
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=self.stderr,
        close_fds=True,
      )
    except OSError as e:
      self.stderr.close()
      raise RuntimeError(f"math grader: could not start its worker ({sys.executable} {_WORKER}): {e}") from e
    self.buffer = b""

  def ask(self, request: dict, deadline: float) -> dict | None:
    """The reply, or None when `deadline` seconds pass first. RuntimeError when the worker died."""
    try:
      self.proc.stdin.write((json.dumps(request) + "\n").encode())
      self.proc.stdin.flush()
    except (BrokenPipeError, OSError):
      raise RuntimeError(f"math grader: its worker exited: {self.died()}") from None
    end = time.monotonic() + deadline
    fd = self.proc.stdout.fileno()
    while b"\n" not in self.buffer:
      left = end - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        return None
      chunk = os.read(fd, 65536)
      if not chunk:
        raise RuntimeError(f"math grader: its worker exited: {self.died()}")
      self.buffer += chunk
    line, _, self.buffer = self.buffer.partition(b"\n")
    return json.loads(line)

  def died(self) -> str:
    code = self.proc.wait()
    self.stderr.seek(0)
    tail = self.stderr.read()[-2000:].decode(errors="replace").strip()
    return f"exit status {code}" + (f": {tail}" if tail else "")

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()
    for f in (self.proc.stdin, self.proc.stdout, self.stderr):
      try:
        f.close()
      except OSError:  # a pipe whose other end is gone
        pass


class _Pool:
  """Up to `_POOL_SIZE` workers shared by the process's threads; each request holds one worker."""

  def __init__(self):
    self.cond = threading.Condition()
    self.idle: list[_Worker] = []
    self.count = 0

  def ask(self, request: dict, deadline: float) -> dict | None:
    worker = self._take()
    try:
      reply = worker.ask(request, deadline)
    except BaseException:
      self._drop(worker)
      raise
    if reply is None:  # overran: it may be inside a C call; a fresh one takes its place on demand
      self._drop(worker)
      return None
    with self.cond:
      self.idle.append(worker)
      self.cond.notify()
    return reply

  def _take(self) -> _Worker:
    with self.cond:
      while not self.idle and self.count >= _POOL_SIZE:
        self.cond.wait()
      if self.idle:
        return self.idle.pop()
      self.count += 1
    try:
      return _Worker()
    except BaseException:
      with self.cond:
        self.count -= 1
        self.cond.notify()
      raise

  def _drop(self, worker: _Worker) -> None:
    worker.close()
    with self.cond:
      self.count -= 1
      self.cond.notify()

  def close(self) -> None:
    with self.cond:
      idle, self.idle = self.idle, []
      self.count -= len(idle)
    for w in idle:
      w.close()

  def forget(self) -> None:
    """In a forked child: the parent's workers are the parent's; close our copies of their pipes only."""
    for w in self.idle:
      for f in (w.proc.stdin, w.proc.stdout, w.stderr):
        try:
          f.close()
        except OSError:
          pass
    self.cond = threading.Condition()
    self.idle, self.count = [], 0


_POOL = _Pool()
atexit.register(_POOL.close)
os.register_at_fork(after_in_child=_POOL.forget)
