"""Fair admission of HTTP requests into the engine: clients take turns, and within a client its requests do.

The engine admits what it is given first-come first-served (a FIFO into its decode slots), so a
500-prompt batch submitted at once puts every later request behind all 500 (the probe: an 8-token
request went from 0.11 s to 40.2 s), and turns per HTTP request let whoever sends the most requests own
the engine (64 concurrent 1000-token requests pushed another client's 4-token request from 0.035 s to
82.8 s). Here each HTTP request is a *call* of a *client* (the API key it authenticated with, else its
peer address: `server.client_id`). The server keeps at most `window` prompts inside the engine (its
slots plus a little headroom, so a slot freed between decode steps is refilled at once) and, whenever
one finishes, submits the next prompt in round-robin order: over clients first, then over that client's
calls. One client's prompts hold at most `per_client` of the engine's slots (fewer than all of them), so
another client's request finds a free slot at once, whatever the first sends; a client may have at most
`max_calls_per_client` calls in flight (429 beyond). The engine's own scheduling is untouched.

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


class Client:
  """One client's calls in flight (`calls`), those with prompts not yet submitted (`waiting`, in turn
  order) and its prompts in the engine (`in_engine`)."""

  def __init__(self, name: str):
    self.name = name
    self.calls: set[Call] = set()
    self.waiting: collections.deque[Call] = collections.deque()
    self.in_engine = 0
    self.scored_in_engine = 0


class Call:
  """One HTTP request's prompts: `lives[i]` is prompt i's engine handle once submitted."""

  def __init__(self, requests: list[GenerateRequest], client: Client):
    self.requests = requests
    self.client = client
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
  """`window`: prompts kept in the engine; `per_call` and `per_client`: of those, at most this many of one
  call and of one client (fewer than the engine's slots, so a newcomer finds a free slot without waiting
  for a batch's lockstep wave or for another client's requests to end); `max_calls_per_client`: calls
  (HTTP requests) one client may have in flight, 429 beyond (None: no cap).

  `scored_batch` (0: none): room for `scored_only` prompts, one prefill's worth (the engine's slots). Such
  a prompt holds its slot for one prefill, never a decode wave, and the engine runs it in a program of
  scored rows only, so a slot left free for a newcomer stays free until that prefill ends anyway. With the
  plain limits a batch of max_slots scored prompts reached the engine as per_call rows, then the rest
  (bench/eval.py, 8 slots, 2 requests of 8 in flight: programs of 7, 2 and 1 rows, 5.7 a run instead of
  4). With it a call may hold max(per_call, scored_batch) scored prompts, scored prompts fill the engine
  up to window + scored_batch - 1 (whoever sends them: they take turns, but `per_client` counts only plain
  prompts), and a plain prompt counts only the scored ones beyond scored_batch against `window`: it always
  finds room behind at most two scored prefills, and is never starved by them.
  """

  def __init__(
    self,
    engine: Engine,
    window: int,
    per_call: int,
    scored_batch: int = 0,
    per_client: int | None = None,
    max_calls_per_client: int | None = None,
  ):
    self.engine, self.window, self.per_call, self.scored_batch = engine, window, per_call, scored_batch
    self.per_client = per_call if per_client is None else per_client
    self.max_calls_per_client = max_calls_per_client
    self._clients: dict[str, Client] = {}  # clients with calls in flight
    self._turns: collections.deque[Client] = collections.deque()  # clients with prompts not yet submitted
    self._rids: dict[str, Call] = {}
    self._in_engine = 0
    self._scored_in_engine = 0  # of _in_engine, the scored_only prompts
    self._loop: asyncio.AbstractEventLoop | None = None

  def submit(self, requests: list[GenerateRequest], client: str = "") -> Call:
    """Queues a call of `client` (event loop only); raises HttpError 409 when one of its rids is in flight,
    429 when the client has `max_calls_per_client` calls in flight."""
    self._loop = asyncio.get_running_loop()
    taken = [r.rid for r in requests if r.rid in self._rids]
    if taken:
      raise httpservice.HttpError(409, f"request id {taken[0]!r} is already in flight", "rid")
    owner = self._clients.get(client)
    cap = self.max_calls_per_client
    if owner is not None and cap is not None and len(owner.calls) >= cap:
      raise httpservice.HttpError(
        429,
        f"this client already has {len(owner.calls)} requests in flight, the cap max_requests_per_client={cap} "
        "(launch/serve.py --max_requests_per_client); retry when one ends",
      )
    if owner is None:
      owner = self._clients[client] = Client(client)
    call = Call(requests, owner)
    owner.calls.add(call)
    for r in requests:
      self._rids[r.rid] = call
    if call.pending:
      if not owner.waiting:
        self._turns.append(owner)  # a client with nothing waiting joins the turns at the back
      owner.waiting.append(call)
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
    queued = [call for client in self._clients.values() for call in client.waiting]
    self.abort([call.requests[i].rid for call in queued for i in call.pending])
    self.engine.abort_all()

  def cancel(self, call: Call) -> None:
    """The client went away (or the server is stopping): nothing of `call` may keep decoding."""
    self.abort([r.rid for i, r in enumerate(call.requests) if not call.finished(i)])

  def num_running(self) -> int:
    """Prompts of HTTP requests in flight (queued here or in the engine)."""
    return len(self._rids)

  def client_load(self, client: str) -> tuple[int, int]:
    """`client`'s (calls in flight, prompts in the engine)."""
    owner = self._clients.get(client)
    return (len(owner.calls), owner.in_engine) if owner is not None else (0, 0)

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
    client = call.client
    if not call.pending and call in client.waiting:
      client.waiting.remove(call)
    if not client.waiting and client in self._turns:
      self._turns.remove(client)
    if call.done and call in client.calls:
      for r in call.requests:
        if self._rids.get(r.rid) is call:
          del self._rids[r.rid]
      client.calls.discard(call)
      if not client.calls and self._clients.get(client.name) is client:
        del self._clients[client.name]
    call.changed.set()
    if freed:
      self._pump()

  def _pump(self) -> None:
    """Round-robin: one prompt from each client with prompts left (and room: `_has_room`), that client's
    calls taking turns too, until the engine holds `window` (scored-only prompts have their own room). The
    prompts picked go to the engine together (`submit_many` where the engine has it), so it can admit them
    in one step: one prefill program, not one per prompt."""
    picked: list[tuple[Call, int]] = []
    skipped = 0  # clients passed over in a row because they are at their limits: all of them -> stop
    most = self.window + self.scored_batch  # the most `_has_room` lets in (plain behind full scored room)
    while self._in_engine < most and self._turns and skipped < len(self._turns):
      client = self._turns.popleft()
      call = self._next_call(client)
      if call is None:
        if client.waiting:
          self._turns.append(client)
          skipped += 1
        continue
      skipped = 0
      i = call.pending.popleft()
      if not call.pending:
        client.waiting.remove(call)
      call.in_engine.add(i)  # counted now; taken back below if the engine refuses it
      self._in_engine += 1
      client.in_engine += 1
      scored = scored_only(call.requests[i])
      self._scored_in_engine += scored
      client.scored_in_engine += scored
      picked.append((call, i))
      if client.waiting:
        self._turns.append(client)
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

  def _next_call(self, client: Client) -> Call | None:
    """`client`'s next call in turn whose next prompt may go to the engine now (its turn passes on)."""
    for _ in range(len(client.waiting)):
      call = client.waiting[0]
      client.waiting.rotate(-1)
      if call.pending and self._has_room(call, scored_only(call.requests[call.pending[0]])):
        return call
    return None

  def _has_room(self, call: Call, scored: bool) -> bool:
    """Whether `call`'s next prompt (a scored_only one or not) may go to the engine now."""
    client = call.client
    if not self.scored_batch:
      mine = len(call.in_engine) < self.per_call and client.in_engine < self.per_client
      return mine and self._in_engine < self.window
    if scored:  # no client cap: plain prompts never wait behind more than scored_batch of these (below)
      per_call = max(self.per_call, self.scored_batch)
      return len(call.in_engine) < per_call and self._in_engine < self.window + self.scored_batch - 1
    counted = self._in_engine - self._scored_in_engine + max(0, self._scored_in_engine - self.scored_batch)
    client_plain = client.in_engine - client.scored_in_engine
    return len(call.in_engine) < self.per_call and client_plain < self.per_client and counted < self.window

  def _leave(self, call: Call, i: int) -> None:
    call.in_engine.discard(i)
    self._in_engine -= 1
    call.client.in_engine -= 1
    scored = scored_only(call.requests[i])
    self._scored_in_engine -= scored
    call.client.scored_in_engine -= scored


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
