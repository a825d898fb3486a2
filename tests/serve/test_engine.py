"""Engine numerics and scheduling: KV-cached decoding equals the full forward, batching and prefix reuse
change nothing, aborts return partial output, stop conditions."""

import threading
import time

import numpy as np
import pytest

from k2jax.serve import Request, SamplingOptions

GREEDY = SamplingOptions(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def _prompt(n, seed):
  return tuple(int(t) for t in np.random.RandomState(seed).randint(0, 3800, n))


def test_greedy_decode_equals_full_forward_argmax_and_logprobs(served):
  prompt = _prompt(7, 0)
  c = served.engine.generate(Request("greedy", prompt, GREEDY))
  assert len(c.output_ids) == 12 and c.finish == {"type": "length", "length": 12}
  lp_TS = np.asarray(served.forward_logprobs(list(prompt) + c.output_ids))
  for i, token in enumerate(c.output_ids):
    row = lp_TS[len(prompt) - 1 + i]
    assert token == int(np.argmax(row)), f"token {i}"
    assert abs(c.logprobs[i] - row[token]) <= 1e-4
    assert c.top_logprobs[i][0][0] == token


def test_sampled_logprobs_equal_forward_log_softmax(served):
  prompt = _prompt(9, 1)
  c = served.engine.generate(
    Request("sampled", prompt, SamplingOptions(max_new_tokens=10, temperature=1.0, seed=7, ignore_eos=True))
  )
  lp_TS = np.asarray(served.forward_logprobs(list(prompt) + c.output_ids))
  want = [lp_TS[len(prompt) - 1 + i, t] for i, t in enumerate(c.output_ids)]
  np.testing.assert_allclose(c.logprobs, want, atol=1e-4)
  # Same seed, same tokens; another seed gives another sample.
  again = served.engine.generate(
    Request("sampled2", prompt, SamplingOptions(max_new_tokens=10, temperature=1.0, seed=7, ignore_eos=True))
  )
  other = served.engine.generate(
    Request("sampled3", prompt, SamplingOptions(max_new_tokens=10, temperature=1.0, seed=8, ignore_eos=True))
  )
  assert again.output_ids == c.output_ids and other.output_ids != c.output_ids


def test_continuous_batching_equals_one_at_a_time(served):
  eng = served.engine
  # 7 requests > 4 slots: some wait and join while others decode; lengths and budgets all differ.
  reqs = [
    Request(
      f"cb{i}",
      _prompt(3 + 2 * i, 10 + i),
      SamplingOptions(
        max_new_tokens=4 + 3 * i,
        temperature=0.0 if i % 2 else 0.8,
        top_k=50 if i == 2 else -1,
        top_p=0.9 if i == 4 else 1.0,
        seed=100 + i,
        ignore_eos=True,
      ),
    )
    for i in range(7)
  ]
  eng.flush_cache()
  handles = [eng.submit(r) for r in reqs]
  batched = [eng.wait(h, timeout=120) for h in handles]
  alone = []
  for r in reqs:
    eng.flush_cache()
    alone.append(eng.generate(Request(r.rid + "-alone", r.input_ids, r.sampling)))
  for b, a in zip(batched, alone):
    assert b.output_ids == a.output_ids
    assert len(b.output_ids) == b.finish["length"]
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4)


def test_prefix_reuse_gives_identical_outputs(served):
  eng = served.engine
  eng.flush_cache()
  turn1 = _prompt(10, 20)
  first = eng.generate(Request("t1", turn1, GREEDY))
  assert first.cached_tokens == 0
  turn2 = turn1 + tuple(first.output_ids) + _prompt(5, 21)  # the agent resends the history
  reused = eng.generate(Request("t2", turn2, GREEDY))
  # Every token whose keys the first request wrote (its prompt and all but its last output) is reused.
  assert reused.cached_tokens == len(turn1) + len(first.output_ids) - 1
  eng.flush_cache()
  fresh = eng.generate(Request("t2-fresh", turn2, GREEDY))
  assert fresh.cached_tokens == 0
  assert reused.output_ids == fresh.output_ids
  np.testing.assert_allclose(reused.logprobs, fresh.logprobs, atol=1e-4)


def test_abort_returns_partial_output(served):
  eng = served.engine
  prompt = _prompt(5, 30)
  budget = SamplingOptions(max_new_tokens=120, temperature=0.0, ignore_eos=True)
  running = eng.submit(Request("long", prompt, budget))
  while not running.out:  # started decoding
    time.sleep(0.005)
  eng.abort("long")
  c = eng.wait(running, timeout=60)
  assert c.finish["type"] == "abort" and 0 < len(c.output_ids) < 120
  assert len(c.logprobs) == len(c.output_ids)
  full = eng.generate(
    Request("long-full", prompt, SamplingOptions(max_new_tokens=len(c.output_ids), temperature=0.0, ignore_eos=True))
  )
  assert full.output_ids == c.output_ids  # the partial output is a real prefix of the answer
  assert eng.abort("no-such-rid") == 0


def test_abort_all_includes_waiting_requests(served):
  eng = served.engine
  budget = SamplingOptions(max_new_tokens=100, temperature=0.0, ignore_eos=True)
  handles = [eng.submit(Request(f"many{i}", _prompt(4, 40 + i), budget)) for i in range(6)]
  while not handles[0].out:
    time.sleep(0.005)
  assert eng.abort(abort_all=True) == 6
  done = [eng.wait(h, timeout=60) for h in handles]
  assert all(c.finish["type"] == "abort" for c in done)
  assert any(len(c.output_ids) == 0 for c in done)  # 6 requests, 4 slots: some never started


def test_stop_token_ids_and_eos(served):
  eng = served.engine
  prompt = _prompt(6, 50)
  ref = eng.generate(Request("ref", prompt, GREEDY)).output_ids
  k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
  c = eng.generate(
    Request("stopid", prompt, SamplingOptions(max_new_tokens=12, temperature=0.0, stop_token_ids=(ref[k],)))
  )
  assert c.output_ids == ref[: k + 1]
  assert c.finish == {"type": "stop", "matched": ref[k]}


def test_max_new_tokens_zero_and_concurrent_rid(served):
  eng = served.engine
  c = eng.generate(Request("zero", _prompt(3, 60), SamplingOptions(max_new_tokens=0)))
  assert c.output_ids == [] and c.finish["type"] == "length"
  h = eng.submit(Request("dup", _prompt(3, 61), SamplingOptions(max_new_tokens=60, temperature=0.0)))
  with pytest.raises(ValueError, match="rid"):
    eng.submit(Request("dup", _prompt(3, 61), SamplingOptions(max_new_tokens=4)))
  eng.abort("dup")
  eng.wait(h, timeout=60)


def test_a_failing_request_fails_alone(served, monkeypatch):
  """A request whose prefill raises (here: a poisoned prompt) fails with a 500 abort; the requests running
  and queued beside it finish normally."""
  engine = served.engine
  real = engine._runner.prefill
  poison = 3799

  def prefill(slot, tokens, start, sampling):
    if poison in tokens:
      raise FloatingPointError("poisoned prompt")
    return real(slot, tokens, start, sampling)

  monkeypatch.setattr(engine._runner, "prefill", prefill)
  ref = engine.generate(Request("ref", _prompt(5, 3), GREEDY)).output_ids
  good = [engine.submit(Request(f"good{i}", _prompt(5, 3), GREEDY)) for i in range(3)]
  bad = engine.submit(Request("bad", (1, 2, poison), GREEDY))
  late = engine.submit(Request("late", _prompt(5, 3), GREEDY))
  failed = engine.wait(bad, timeout=120)
  assert failed.finish["type"] == "abort" and failed.finish["status_code"] == 500
  assert "poisoned prompt" in failed.finish["message"]
  for live in good + [late]:
    c = engine.wait(live, timeout=120)
    assert c.finish == {"type": "length", "length": 12} and c.output_ids == ref
