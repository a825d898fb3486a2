"""Fair admission of HTTP requests into the engine: a batch's prompts take turns with everyone else's.

The engine admits what it is given first-come first-served (a FIFO into its decode slots), so a
500-prompt batch submitted at once puts every later request behind all 500 (the probe: an 8-token
request went from 0.11 s to 40.2 s). Here each HTTP request is a *call*; the server keeps at most
`window` prompts inside the engine (its slots plus a little headroom, so a slot freed between decode
steps is refilled at once) and, whenever one finishes, submits the next prompt of the next call in
round-robin order. A small request arriving behind a full batch waits for about `window - max_slots + 1`
prompts to finish, not for the batch. The engine's own scheduling is untouched.

Everything here runs on the server's event loop (the engine's scheduler thread only schedules
callbacks onto it), so no lock is needed. Request ids are reserved per call while it is in flight: a
second request reusing one is refused (409) before anything is queued or a stream is opened.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import TypeVar

from k2jax import httpservice
from k2jax.engine.base import Engine, GenerateRequest, GenerateResult, InvalidRequest

T = TypeVar("T")


class Call:
  """One HTTP request's prompts: `lives[i]` is prompt i's engine handle once submitted."""

  def __init__(self, requests: list[GenerateRequest]):
    self.requests = requests
    self.index = {r.rid: i for i, r in enumerate(requests)}
    self.lives: list = [None] * len(requests)
    self.results: list[GenerateResult | None] = [None] * len(requests)  # ended without the engine
    self.errors: list[Exception | None] = [None] * len(requests)
    self.pending = collections.deque(range(len(requests)))
    self.in_engine: set[int] = set()
    self.changed = asyncio.Event()

  def finished(self, i: int) -> bool:
    live = self.lives[i]
    return self.results[i] is not None or self.errors[i] is not None or (live is not None and live.done.is_set())

  @property
  def done(self) -> bool:
    return not self.pending and not self.in_engine  # what left the engine has finished


def scored_only(request: GenerateRequest) -> bool:
  """Whether `request` ends in its prefill and runs the engine's scored program: prompt logprobs asked for
  (`logprob_start_len` >= 0) and at most one new token (lm-eval's loglikelihood: echo, max_tokens 1)."""
  return request.logprob_start_len >= 0 and request.sampling.max_new_tokens <= 1


class FairQueue:
  """`window`: prompts kept in the engine; `per_call`: of those, at most this many of one call (fewer than
  the engine's slots, so a newcomer finds a free slot without waiting for a batch's lockstep wave).

  `scored_batch` (0: none): room for `scored_only` prompts, one prefill's worth (the engine's slots). Such
  a prompt holds its slot for one prefill, never a decode wave, and the engine runs it in a program of
  scored rows only, so a slot left free for a newcomer stays free until that prefill ends anyway. With the
  plain limits a batch of max_slots scored prompts reached the engine as per_call rows, then the rest
  (bench/eval.py, 8 slots, 2 requests of 8 in flight: programs of 7, 2 and 1 rows, 5.7 a run instead of
  4). With it a call may hold max(per_call, scored_batch) scored prompts, scored prompts fill the engine
  up to window + scored_batch - 1, and a plain prompt counts only the scored ones beyond scored_batch
  against `window`: it always finds room behind at most two scored prefills, and is never starved by them.
  """

  def __init__(self, engine: Engine, window: int, per_call: int, scored_batch: int = 0):
    self.engine, self.window, self.per_call, self.scored_batch = engine, window, per_call, scored_batch
    self._calls: collections.deque[Call] = collections.deque()  # calls with prompts not yet submitted
    self._rids: dict[str, Call] = {}
    self._in_engine = 0
    self._scored_in_engine = 0  # of _in_engine, the scored_only prompts
    self._loop: asyncio.AbstractEventLoop | None = None

  def submit(self, requests: list[GenerateRequest]) -> Call:
    """Queues a call (event loop only); raises HttpError 409 when one of its rids is in flight."""
    self._loop = asyncio.get_running_loop()
    taken = [r.rid for r in requests if r.rid in self._rids]
    if taken:
      raise httpservice.HttpError(409, f"request id {taken[0]!r} is already in flight", "rid")
    call = Call(requests)
    for r in requests:
      self._rids[r.rid] = call
    self._calls.append(call)
    self._pump()
    return call

  def abort(self, rids: list[str]) -> None:
    """Aborts these requests: queued ones end now (finish_reason abort), running ones at the next step."""
    running = []
    for rid in rids:
      call = self._rids.get(rid)
      if call is None:
        continue
      i = call.index[rid]
      if i in call.pending:
        call.pending.remove(i)
        call.results[i] = _aborted(call.requests[i], "Aborted by request")
      elif call.lives[i] is not None:
        running.append(rid)
      self._update(call)
    if running:
      self.engine.abort(running)

  def abort_all(self) -> None:
    self.abort([call.requests[i].rid for call in list(self._calls) for i in call.pending])
    self.engine.abort_all()

  def cancel(self, call: Call) -> None:
    """The client went away (or the server is stopping): nothing of `call` may keep decoding."""
    self.abort([r.rid for i, r in enumerate(call.requests) if not call.finished(i)])

  def num_running(self) -> int:
    """Prompts of HTTP requests in flight (queued here or in the engine)."""
    return len(self._rids)

  def result(self, call: Call, i: int) -> GenerateResult:
    """Prompt i's result (call done); raises the engine's error for a prompt it failed or refused."""
    if call.errors[i] is not None:
      raise call.errors[i]
    if call.results[i] is not None:
      return call.results[i]
    return self.engine.wait(call.lives[i])

  # ---- internals ------------------------------------------------------------------------------------
  def _notify(self, call: Call) -> None:  # the engine's scheduler thread
    loop = self._loop
    if loop is not None and not loop.is_closed():
      loop.call_soon_threadsafe(self._update, call)

  def _update(self, call: Call) -> None:
    freed = [i for i in call.in_engine if call.lives[i].done.is_set()]
    for i in freed:
      self._leave(call, i)
    if call.done:
      for r in call.requests:
        if self._rids.get(r.rid) is call:
          del self._rids[r.rid]
      if call in self._calls:
        self._calls.remove(call)
    call.changed.set()
    if freed:
      self._pump()

  def _pump(self) -> None:
    """Round-robin: one prompt from each call with prompts left (and under `per_call` in the engine),
    until the engine holds `window` (`_has_room`: scored-only prompts have their own room). The prompts
    picked go to the engine together (`submit_many` where the engine has it), so it can admit them in one
    step: one prefill program, not one per prompt."""
    picked: list[tuple[Call, int]] = []
    skipped = 0  # calls passed over in a row because they are at their limits: all of them -> stop
    most = self.window + self.scored_batch  # the most `_has_room` lets in (plain behind full scored room)
    while self._in_engine < most and self._calls and skipped < len(self._calls):
      call = self._calls.popleft()
      if not call.pending:
        continue
      if not self._has_room(call, scored_only(call.requests[call.pending[0]])):
        self._calls.append(call)
        skipped += 1
        continue
      skipped = 0
      i = call.pending.popleft()
      call.in_engine.add(i)  # counted now; taken back below if the engine refuses it
      self._in_engine += 1
      self._scored_in_engine += scored_only(call.requests[i])
      picked.append((call, i))
      if call.pending:
        self._calls.append(call)
    if not picked:
      return
    requests = [call.requests[i] for call, i in picked]
    callbacks = [lambda c=call: self._notify(c) for call, _ in picked]
    submit_many = getattr(self.engine, "submit_many", None)
    if submit_many is not None:
      lives = submit_many(requests, callbacks)
    else:
      lives = []
      for request, callback in zip(requests, callbacks):
        try:
          lives.append(self.engine.submit(request, callback))
        except (InvalidRequest, RuntimeError) as e:
          lives.append(e)
    for (call, i), live in zip(picked, lives):
      if isinstance(live, Exception):  # a rid in flight outside HTTP, or the engine closed
        self._leave(call, i)
        call.errors[i] = live
        self._loop.call_soon(self._update, call)
      else:
        call.lives[i] = live

  def _has_room(self, call: Call, scored: bool) -> bool:
    """Whether `call`'s next prompt (a scored_only one or not) may go to the engine now."""
    if not self.scored_batch:
      return len(call.in_engine) < self.per_call and self._in_engine < self.window
    if scored:
      per_call = max(self.per_call, self.scored_batch)
      return len(call.in_engine) < per_call and self._in_engine < self.window + self.scored_batch - 1
    counted = self._in_engine - self._scored_in_engine + max(0, self._scored_in_engine - self.scored_batch)
    return len(call.in_engine) < self.per_call and counted < self.window

  def _leave(self, call: Call, i: int) -> None:
    call.in_engine.discard(i)
    self._in_engine -= 1
    self._scored_in_engine -= scored_only(call.requests[i])


class LoopShare:
  """Bounds the event loop's time spent on heavy bodies (parsing and tokenizing megabytes of JSON, which
  holds the GIL: a thread would not help) to `share` of the loop: heavy sections run one at a time, and
  after one of d seconds the next starts d * (1 - share) / share later. Small requests never wait here,
  so a client streaming maximal bodies slows them by at most one section per await, not by a queue."""

  def __init__(self, heavy_bytes: int = 256 << 10, share: float = 0.5):
    self.heavy_bytes, self.share = heavy_bytes, share
    self._lock = asyncio.Lock()
    self._next = 0.0

  async def run(self, size: int, fn: Callable[[], T]) -> T:
    if size < self.heavy_bytes:
      return fn()
    async with self._lock:
      loop = asyncio.get_running_loop()
      await asyncio.sleep(max(0.0, self._next - loop.time()))
      t0 = loop.time()
      try:
        return fn()
      finally:
        self._next = loop.time() + (loop.time() - t0) * (1 - self.share) / self.share


def _aborted(req: GenerateRequest, message: str) -> GenerateResult:
  """What the engine answers for a request aborted before it was prefilled."""
  return GenerateResult(req.rid, (), (), (), "abort", len(req.input_ids), abort_message=message)
