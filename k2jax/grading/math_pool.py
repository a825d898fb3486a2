"""The math grader's worker processes (`math_worker.py`): a small pool per process, started on first use.

A worker says ready once math-verify is imported, then answers one JSON line per request. The pool tells the
failures apart: a worker that cannot start, or breaks the protocol (a line that is not JSON, lacks a field or
runs past `MAX_LINE`), is the grader's failure (`RuntimeError`, an infrastructure verdict upstream); one that
dies on a request is replaced and asked once more, and when that one dies too the request is what kills them,
so the reply grades the answer wrong. A request past its deadline kills its worker (a C call a signal
cannot stop) and returns None.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

POOL_SIZE = max(1, min(4, os.cpu_count() or 1))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_worker.py")
START_S = 120.0  # a worker's start (importing math-verify and sympy: ~1 s idle, far more on a loaded host)
MAX_LINE = 1 << 16  # bytes of one reply line; the worker cuts what it prints far below this
REPLY_KEYS = frozenset({"ok", "timed_out", "pred", "gold", "gold_math", "error"})


class _DiedOnRequest(Exception):
  """The worker started (it said ready) and then exited while grading a request."""


class _Worker:
  def __init__(self):
    self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close(), with the process
    try:
      self.proc = subprocess.Popen(
        [sys.executable, "-P", "-u", WORKER],  # -P: not its folder (math.py) on sys.path
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=self.stderr,
        close_fds=True,
      )
    except OSError as e:
      self.stderr.close()
      raise RuntimeError(f"math grader: could not start its worker ({sys.executable} {WORKER}): {e}") from e
    self.buffer = b""
    self.ready = False

  def ask(self, request: dict, deadline: float) -> dict | None:
    """The reply, or None when `deadline` seconds pass first. RuntimeError when the worker cannot start or
    breaks the protocol (infrastructure); `_DiedOnRequest` when it started and then died on this request."""
    if not self.ready:
      line = self._line(START_S)
      if line is None:
        raise RuntimeError(f"math grader: its worker did not start within {START_S:.0f} s")
      if self._decode(line) != {"ready": True}:
        raise RuntimeError(f"math grader: its worker did not say ready, it wrote {line[:200]!r}")
      self.ready = True
    try:
      self.proc.stdin.write((json.dumps(request) + "\n").encode())
      self.proc.stdin.flush()
    except (BrokenPipeError, OSError):
      raise _DiedOnRequest(self.died()) from None
    line = self._line(deadline)
    if line is None:
      return None
    reply = self._decode(line)
    if not (isinstance(reply, dict) and REPLY_KEYS <= reply.keys()):
      raise RuntimeError(f"math grader: its worker's reply lacks {sorted(REPLY_KEYS)}: {line[:200]!r}")
    return reply

  def _line(self, seconds: float) -> bytes | None:
    """One line from the worker, or None when `seconds` pass first."""
    end = time.monotonic() + seconds
    fd = self.proc.stdout.fileno()
    while b"\n" not in self.buffer:
      if len(self.buffer) > MAX_LINE:
        raise RuntimeError(f"math grader: its worker wrote a line over {MAX_LINE} bytes: {self.buffer[:200]!r}")
      left = end - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        return None
      chunk = os.read(fd, 65536)
      if not chunk:
        if self.ready:
          raise _DiedOnRequest(self.died())
        raise RuntimeError(f"math grader: its worker exited before it was ready: {self.died()}")
      self.buffer += chunk
    line, _, self.buffer = self.buffer.partition(b"\n")
    if len(line) > MAX_LINE:
      raise RuntimeError(f"math grader: its worker wrote a line over {MAX_LINE} bytes: {line[:200]!r}")
    return line

  @staticmethod
  def _decode(line: bytes):
    try:
      return json.loads(line)
    except ValueError:  # a broken protocol is the grader's failure, never the task data's (json raises ValueError)
      raise RuntimeError(f"math grader: its worker wrote a line that is not JSON: {line[:200]!r}") from None

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
  """Up to `POOL_SIZE` workers shared by the process's threads; each request holds one worker."""

  def __init__(self):
    self.cond = threading.Condition()
    self.idle: list[_Worker] = []
    self.count = 0

  def ask(self, request: dict, deadline: float) -> dict | None:
    """The reply, or None past `deadline`. A worker that dies on a request is replaced and asked once more;
    when the second one dies too, the request is what kills them (a parse past the memory the machine has,
    an interpreter crash in a C extension): the reply says so and the answer is graded wrong."""
    deaths = []
    while len(deaths) < 2:
      try:
        return self._ask_one(request, deadline)
      except _DiedOnRequest as e:
        deaths.append(str(e))
    error = f"answer: the grader's worker died on it twice ({deaths[-1][:200]})"
    return {"ok": False, "timed_out": False, "pred": "", "gold": "", "gold_math": True, "error": error}

  def _ask_one(self, request: dict, deadline: float) -> dict | None:
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
      while not self.idle and self.count >= POOL_SIZE:
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


POOL = _Pool()
atexit.register(POOL.close)
os.register_at_fork(after_in_child=POOL.forget)
