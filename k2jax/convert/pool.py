"""The thread pipeline of checkpoint import and export: jobs on a bounded pool, results in order.

The reader (`reader._run`: pread, tiled transposes, FP8 dequantization, casts), the writer
(`st_stream`: transposes, casts, block-FP8 quantization per slab) and the RL weight push (the same
writer) hand their per-block work to `Workers`: `threads` threads run the jobs while the submitting
thread consumes finished results strictly in submission order, so what is assembled or written is
bitwise the same for any thread count. numpy's copies and ufuncs, `os.preadv`, XLA calls and zlib all
release the GIL, so the threads use the host's cores and the reads of the next blocks are in flight while
the current ones are transformed.

Memory is bounded by bytes, not jobs: a job holds its `nbytes` from submission until its result has
been consumed, and a submission that would take the jobs in flight past `budget_bytes` first waits
for (and consumes) the oldest ones; a single job larger than the budget runs alone. `InFlight` records
the most bytes ever in flight so tests can check the bound.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Self

from k2jax.model.config import ConfigError


def default_threads() -> int:
  """The cores this process may run on (its CPU affinity, which a container or `taskset` narrows)."""
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except AttributeError:  # no sched_getaffinity (macOS)
    return max(1, os.cpu_count() or 1)


# Threads per core when `threads` is 0. A job thread spends much of its time off the cores it is counted on:
# blocked on an XLA:CPU call running on XLA's own threads, on a read, or on the GIL. With one thread per core
# the cores were idle 20-30% of a `small` FP8 import or export (2 cores); with two, the import's share of its
# bound rose from 0.795 to 0.833 and the FP8 export's from 0.79 to 0.82 (docs/results.md). Memory does not grow with
# it: the in-flight bytes are bounded by the budget, not the thread count.
THREADS_PER_CORE = 2


def resolve_threads(threads: int, field: str = "threads") -> int:
  """`threads` itself, or THREADS_PER_CORE x `default_threads()` for 0; a ConfigError naming `field` otherwise."""
  if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
    raise ConfigError(f"{field}: expected an int >= 0 (0: two per core of this host), got {threads!r}")
  return threads or THREADS_PER_CORE * default_threads()


@dataclasses.dataclass
class InFlight:
  """Bytes of jobs submitted and not yet consumed, the most ever at once, and the last run's knobs."""

  name: str
  bytes: int = 0
  peak_bytes: int = 0
  jobs: int = 0
  peak_jobs: int = 0
  largest_job: int = 0
  budget_bytes: int = 0
  threads: int = 0
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def reset(self) -> None:
    with self.lock:
      self.bytes = self.peak_bytes = self.jobs = self.peak_jobs = 0
      self.largest_job = self.budget_bytes = self.threads = 0

  def add(self, n: int, jobs: int) -> None:
    """`jobs` jobs of `n` bytes in all entered (positive) or left (negative) the pipeline."""
    with self.lock:
      self.bytes += n
      self.jobs += jobs
      self.peak_bytes = max(self.peak_bytes, self.bytes)
      self.peak_jobs = max(self.peak_jobs, self.jobs)
      self.largest_job = max(self.largest_job, n)


READ = InFlight("read")  # the HF reader's blocks (leaf bytes)
WRITE = InFlight("write")  # the HF writer's prepared row blocks and FP8 slabs


class Workers:
  """`threads` threads running submitted jobs; `done(result)` of each runs on the submitting thread in
  submission order (inside `submit` or `drain`). At most `budget_bytes` of jobs are in flight (a
  larger single job runs alone) and at most 2 x threads jobs (enough to keep every thread busy while
  the oldest result is consumed). A job's exception is raised by the `submit`/`drain` that consumes it,
  and the jobs not yet started are cancelled. Use as a context manager."""

  def __init__(self, threads: int, budget_bytes: int, stats: InFlight, name: str = "k2jax-io"):
    if budget_bytes <= 0:
      raise ConfigError(f"{stats.name} in-flight budget must be positive, got {budget_bytes}")
    self.threads = resolve_threads(threads)
    self.budget_bytes = budget_bytes
    self._stats = stats
    self._pending: collections.deque[tuple[int, Future, Callable]] = collections.deque()
    self._in_flight = 0
    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=name)
    with stats.lock:
      stats.budget_bytes, stats.threads = budget_bytes, self.threads

  def submit(self, nbytes: int, fn: Callable, done: Callable) -> None:
    """Runs `fn()` on a thread once `nbytes` fits the budget; `done(fn())` later, in order."""
    while self._pending and (self._in_flight + nbytes > self.budget_bytes or len(self._pending) >= 2 * self.threads):
      self._consume()
    self._in_flight += nbytes
    self._stats.add(nbytes, 1)
    self._pending.append((nbytes, self._pool.submit(fn), done))

  def drain(self) -> None:
    """Consumes every job submitted so far."""
    while self._pending:
      self._consume()

  def _consume(self) -> None:
    nbytes, fut, done = self._pending.popleft()
    try:
      result = fut.result()
    finally:
      self._in_flight -= nbytes
      self._stats.add(-nbytes, -1)
    done(result)

  def close(self, cancel: bool = False) -> None:
    if cancel:
      for nbytes, fut, _ in self._pending:
        fut.cancel()
        self._stats.add(-nbytes, -1)
      self._pending.clear()
      self._in_flight = 0
    self._pool.shutdown(wait=True, cancel_futures=cancel)

  def __enter__(self) -> Self:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    self.close(cancel=exc_type is not None)
