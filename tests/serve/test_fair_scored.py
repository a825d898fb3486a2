"""FairQueue's limits for scored-only prompts (prompt logprobs, at most one new token: lm-eval's
loglikelihood): a batch of them reaches the engine whole, up to `scored_per_call`, while plain prompts keep
`window` and `per_call` (no model, no HTTP: the scripted engine of test_fair)."""

import asyncio

from k2jax.engine.base import GenerateRequest, SamplingParams
from k2jax.serve.fair import FairQueue, scored_only
from tests.serve.test_fair import _Engine, _settle


def _scored(prefix, n):
  return [GenerateRequest(f"{prefix}{i}", (1, 2, 3), SamplingParams(max_new_tokens=1), 0) for i in range(n)]


def _plain(prefix, n):
  return [GenerateRequest(f"{prefix}{i}", (1, 2), SamplingParams(max_new_tokens=1)) for i in range(n)]


def test_scored_only_is_prompt_logprobs_and_at_most_one_token():
  assert scored_only(_scored("a", 1)[0])
  assert not scored_only(_plain("a", 1)[0])  # no prompt logprobs
  long = GenerateRequest("b", (1, 2), SamplingParams(max_new_tokens=2), 0)
  assert not scored_only(long)  # decodes after its prefill


def test_a_scored_batch_reaches_the_engine_whole_and_plain_prompts_keep_their_limits():
  async def run():
    engine = _Engine()
    fair = FairQueue(engine, window=9, per_call=7, scored_batch=8)
    a = fair.submit(_scored("a", 12))
    assert engine.order == [f"a{i}" for i in range(8)]  # a whole prefill's worth, not per_call 7
    b = fair.submit(_scored("b", 12))
    assert engine.order[8:] == [f"b{i}" for i in range(8)]  # and the next batch behind it: 9 + 8 - 1 = 16
    plain = fair.submit(_plain("p", 12))
    # scored ones beyond 8 count against the window: 8 of them + 1 plain fill it
    assert engine.order[16:] == ["p0"]
    for i in range(8):
      engine.finish(f"a{i}")
      await _settle()
    # each one that left made room for one more; round-robin gave the plain call its turns among them
    assert len(engine.running()) == 16 and {"a8", "p1"} <= set(engine.order[17:])
    while not (a.done and b.done and plain.done):
      running = engine.running()
      assert sum(r.startswith("p") for r in running) <= 7  # per_call for plain prompts
      assert len(running) <= 16
      for rid in running:
        engine.finish(rid)
      await _settle()
    assert fair.num_running() == 0
    assert engine.order.index("p11") < len(engine.order)  # the plain call was never starved

  asyncio.run(run())


def test_default_limits_are_the_plain_ones_for_scored_prompts():
  async def run():
    engine = _Engine()
    fair = FairQueue(engine, window=5, per_call=3)
    fair.submit(_scored("a", 10))
    assert engine.order == ["a0", "a1", "a2"]

  asyncio.run(run())
