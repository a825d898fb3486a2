"""FairQueue on a scripted engine: round-robin admission, the per-request slot cap, aborts of queued
prompts, and rid reservation (no model, no HTTP)."""

import asyncio
import dataclasses
import threading

import pytest

from k2jax.engine.base import GenerateRequest, GenerateResult, InvalidRequest, SamplingParams
from k2jax.httpservice import HttpError
from k2jax.serve.fair import FairQueue


@dataclasses.dataclass
class _Live:
  request: GenerateRequest
  on_update: object
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  result: GenerateResult | None = None


class _Engine:
  """Admits in order, finishes a request when the test says so."""

  def __init__(self):
    self.order, self.lives = [], {}

  def submit(self, req, on_update):
    if req.rid in self.lives and not self.lives[req.rid].done.is_set():
      raise InvalidRequest("rid", f"request {req.rid!r} is already in flight")
    live = self.lives[req.rid] = _Live(req, on_update)
    self.order.append(req.rid)
    return live

  def finish(self, rid, reason="length"):
    live = self.lives[rid]
    live.result = GenerateResult(rid, (1,), (0.0,), (0,), reason, len(live.request.input_ids))
    live.done.set()
    live.on_update()

  def running(self):
    return [rid for rid, live in self.lives.items() if not live.done.is_set()]

  def abort(self, rids):
    for rid in rids:
      if rid in self.running():
        self.finish(rid, "abort")

  def abort_all(self):
    self.abort(self.running())

  def wait(self, live):
    return live.result


def _reqs(prefix, n):
  return [GenerateRequest(f"{prefix}{i}", (1, 2), SamplingParams(max_new_tokens=1)) for i in range(n)]


async def _settle():
  for _ in range(5):
    await asyncio.sleep(0)


def test_a_newcomer_takes_the_next_turn_and_a_batch_never_holds_every_slot():
  async def run():
    engine = _Engine()
    fair = FairQueue(engine, window=5, per_call=3)
    batch = fair.submit(_reqs("b", 20), "peer:10.0.0.1")
    assert engine.order == ["b0", "b1", "b2"]  # per_call: two slots stay free for others
    small = fair.submit(_reqs("s", 2), "peer:10.0.0.2")
    assert engine.order[3:] == ["s0", "s1"]  # admitted at once, ahead of the batch's rest
    engine.finish("b0")
    engine.finish("s0")
    await _settle()
    late = fair.submit(_reqs("l", 1), "peer:10.0.0.3")
    await _settle()
    assert engine.order[5:] == ["b3", "l0"]  # round-robin: one turn each
    for rid in list(engine.running()):
      engine.finish(rid)
    await _settle()
    while not batch.done:
      for rid in engine.running():
        engine.finish(rid)
      await _settle()
    assert small.done and late.done and fair.num_running() == 0
    assert [fair.result(batch, i).rid for i in range(20)] == [f"b{i}" for i in range(20)]
    assert engine.order.index("b19") > engine.order.index("l0")

  asyncio.run(run())


def test_aborting_queued_prompts_ends_them_without_the_engine_and_frees_their_rids():
  async def run():
    engine = _Engine()
    fair = FairQueue(engine, window=2, per_call=2)
    call = fair.submit(_reqs("a", 6))
    with pytest.raises(HttpError) as e:
      fair.submit(_reqs("a", 1))  # a0 is in flight
    assert e.value.status == 409 and "'a0'" in e.value.message
    fair.cancel(call)
    await _settle()
    assert call.done and fair.num_running() == 0
    results = [fair.result(call, i) for i in range(6)]
    assert all(r.finish_reason == "abort" for r in results)
    assert engine.order == ["a0", "a1"]  # the queued four never reached the engine
    assert fair.submit(_reqs("a", 1)).requests[0].rid == "a0"  # free again

  asyncio.run(run())


def test_a_rid_the_engine_refuses_at_its_turn_is_that_prompts_error():
  async def run():
    engine = _Engine()
    engine.submit(_reqs("x", 1)[0], lambda: None)  # in flight outside the queue
    fair = FairQueue(engine, window=4, per_call=4)
    call = fair.submit(_reqs("x", 2))
    await _settle()
    engine.finish("x1")
    await _settle()
    assert call.done
    with pytest.raises(InvalidRequest, match="already in flight"):
      fair.result(call, 0)
    assert fair.result(call, 1).finish_reason == "length"

  asyncio.run(run())


def _one_prompt_calls(fair, prefix, n, client):
  return [
    fair.submit([GenerateRequest(f"{prefix}{i}", (1, 2), SamplingParams(max_new_tokens=1))], client) for i in range(n)
  ]


def test_a_client_sending_many_requests_cannot_delay_another_clients_request():
  """64 one-prompt requests of one client (the probe's flood) hold at most per_client slots: another
  client's request reaches the engine at once, before a single one of the flood's prompts has finished
  (turns per request put it behind all 64: it waited for 7 of them to end, ~1000 decode steps each)."""

  async def run():
    engine = _Engine()
    fair = FairQueue(engine, window=9, per_call=7, per_client=7)
    flood = _one_prompt_calls(fair, "f", 64, "peer:10.0.0.1")
    assert engine.order == [f"f{i}" for i in range(7)]  # per_client: the flood's 64 requests hold 7 slots
    (innocent,) = _one_prompt_calls(fair, "i", 1, "peer:10.0.0.2")
    assert engine.order[7:] == ["i0"] and not any(c.done for c in flood)  # no flood prompt ended first
    engine.finish("i0")
    await _settle()
    assert innocent.done and fair.client_load("peer:10.0.0.2") == (0, 0)
    assert fair.client_load("peer:10.0.0.1") == (64, 7)
    engine.finish("f0")  # the flood's own next request takes the freed slot
    await _settle()
    assert engine.order[8:] == ["f7"]
    fair.abort_all()
    await _settle()
    assert fair.num_running() == 0 and fair.client_load("peer:10.0.0.1") == (0, 0)

  asyncio.run(run())


def test_clients_take_turns_whatever_each_sends():
  """Two clients with queued requests: each freed slot goes to the next client in turn (a, b, a, b, ...),
  although client a sent its six requests first."""

  async def run():
    engine = _Engine()
    fair = FairQueue(engine, window=3, per_call=2, per_client=2)
    _one_prompt_calls(fair, "a", 6, "key:0")
    _one_prompt_calls(fair, "b", 6, "key:1")
    assert engine.order == ["a0", "a1", "b0"]
    while engine.running():
      engine.finish(engine.running()[0])  # the oldest in the engine ends first
      await _settle()
    assert engine.order[3:] == ["a2", "b1", "a3", "b2", "a4", "b3", "a5", "b4", "b5"]

  asyncio.run(run())


def test_a_clients_requests_in_flight_are_capped_with_429():
  async def run():
    engine = _Engine()
    fair = FairQueue(engine, window=2, per_call=2, max_calls_per_client=3)
    calls = _one_prompt_calls(fair, "a", 3, "peer:10.0.0.1")
    with pytest.raises(HttpError) as e:
      fair.submit(_reqs("a3-", 1), "peer:10.0.0.1")
    assert e.value.status == 429 and "max_requests_per_client=3" in e.value.message
    assert fair.submit(_reqs("b", 1), "peer:10.0.0.2").requests[0].rid == "b0"  # another client is not capped
    engine.finish("a0")
    await _settle()
    assert calls[0].done
    assert fair.submit(_reqs("a3-", 1), "peer:10.0.0.1").requests  # room again
    assert fair.client_load("peer:10.0.0.1")[0] == 3

  asyncio.run(run())
