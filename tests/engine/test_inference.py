"""Engine numerics and scheduling: KV-cached decoding equals the full forward, batching and prefix reuse
change nothing, aborts return partial output, stop conditions."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k2jax.engine import EngineConfig, GenerateRequest, InferenceEngine, SamplingParams
from k2jax.engine.runner import ModelRunner, sampling_arrays
from k2jax.model import K2Model, presets

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def _prompt(n, seed):
  return tuple(int(t) for t in np.random.RandomState(seed).randint(0, 3800, n))


def test_greedy_decode_equals_full_forward_argmax_and_logprobs(local):
  prompt = _prompt(7, 0)
  c = local.engine.generate(GenerateRequest("greedy", prompt, GREEDY))
  assert len(c.output_ids) == 12 and c.finish_reason == "length"
  lp_TS = np.asarray(local.forward_logprobs(list(prompt) + list(c.output_ids)))
  for i, token in enumerate(c.output_ids):
    row = lp_TS[len(prompt) - 1 + i]
    assert token == int(np.argmax(row)), f"token {i}"
    assert abs(c.output_logprobs[i] - row[token]) <= 1e-4
    assert c.top_logprobs[i][0][0] == token


def test_sampled_logprobs_equal_forward_log_softmax(local):
  prompt = _prompt(9, 1)
  c = local.engine.generate(
    GenerateRequest("sampled", prompt, SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, ignore_eos=True))
  )
  lp_TS = np.asarray(local.forward_logprobs(list(prompt) + list(c.output_ids)))
  want = [lp_TS[len(prompt) - 1 + i, t] for i, t in enumerate(c.output_ids)]
  np.testing.assert_allclose(c.output_logprobs, want, atol=1e-4)
  # Same seed, same tokens; another seed gives another sample.
  again = local.engine.generate(
    GenerateRequest("sampled2", prompt, SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, ignore_eos=True))
  )
  other = local.engine.generate(
    GenerateRequest("sampled3", prompt, SamplingParams(max_new_tokens=10, temperature=1.0, seed=8, ignore_eos=True))
  )
  assert again.output_ids == c.output_ids and other.output_ids != c.output_ids


def test_continuous_batching_equals_one_at_a_time(local):
  eng = local.engine
  # 7 requests > 4 slots: some wait and join while others decode; lengths and budgets all differ.
  reqs = [
    GenerateRequest(
      f"cb{i}",
      _prompt(3 + 2 * i, 10 + i),
      SamplingParams(
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
    alone.append(eng.generate(GenerateRequest(r.rid + "-alone", r.input_ids, r.sampling)))
  for b, a in zip(batched, alone):
    assert b.output_ids == a.output_ids
    assert b.finish_reason == "length"
    np.testing.assert_allclose(b.output_logprobs, a.output_logprobs, atol=1e-4)


def test_prefix_reuse_gives_identical_outputs(local):
  eng = local.engine
  eng.flush_cache()
  turn1 = _prompt(10, 20)
  first = eng.generate(GenerateRequest("t1", turn1, GREEDY))
  assert first.cached_tokens == 0
  turn2 = turn1 + tuple(first.output_ids) + _prompt(5, 21)  # the agent resends the history
  reused = eng.generate(GenerateRequest("t2", turn2, GREEDY))
  # Every token whose keys the first request wrote (its prompt and all but its last output) is reused.
  assert reused.cached_tokens == len(turn1) + len(first.output_ids) - 1
  eng.flush_cache()
  fresh = eng.generate(GenerateRequest("t2-fresh", turn2, GREEDY))
  assert fresh.cached_tokens == 0
  assert reused.output_ids == fresh.output_ids
  np.testing.assert_allclose(reused.output_logprobs, fresh.output_logprobs, atol=1e-4)


def test_abort_returns_partial_output(local):
  eng = local.engine
  prompt = _prompt(5, 30)
  budget = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
  running = eng.submit(GenerateRequest("long", prompt, budget))
  while not running.out:  # started decoding
    time.sleep(0.005)
  eng.abort(["long"])
  c = eng.wait(running, timeout=60)
  assert c.finish_reason == "abort" and 0 < len(c.output_ids) < 120
  assert len(c.output_logprobs) == len(c.output_ids)
  full = eng.generate(
    GenerateRequest(
      "long-full", prompt, SamplingParams(max_new_tokens=len(c.output_ids), temperature=0.0, ignore_eos=True)
    )
  )
  assert full.output_ids == c.output_ids  # the partial output is a real prefix of the answer
  assert eng.abort(["no-such-rid"]) == 0


def test_abort_all_includes_waiting_requests(local):
  eng = local.engine
  budget = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
  handles = [eng.submit(GenerateRequest(f"many{i}", _prompt(4, 40 + i), budget)) for i in range(6)]
  while not handles[0].out:
    time.sleep(0.005)
  assert eng.abort_all() == 6
  done = [eng.wait(h, timeout=60) for h in handles]
  assert all(c.finish_reason == "abort" for c in done)
  assert any(len(c.output_ids) == 0 for c in done)  # 6 requests, 4 slots: some never started


def test_stop_token_ids_and_eos(local):
  eng = local.engine
  prompt = _prompt(6, 50)
  ref = eng.generate(GenerateRequest("ref", prompt, GREEDY)).output_ids
  k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
  c = eng.generate(
    GenerateRequest("stopid", prompt, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(ref[k],)))
  )
  assert c.output_ids == ref[: k + 1]
  assert c.finish_reason == "stop" and c.matched_stop == ref[k]


def test_max_new_tokens_zero_and_concurrent_rid(local):
  eng = local.engine
  c = eng.generate(GenerateRequest("zero", _prompt(3, 60), SamplingParams(max_new_tokens=0)))
  assert c.output_ids == () and c.finish_reason == "length"
  h = eng.submit(GenerateRequest("dup", _prompt(3, 61), SamplingParams(max_new_tokens=60, temperature=0.0)))
  with pytest.raises(ValueError, match="rid"):
    eng.submit(GenerateRequest("dup", _prompt(3, 61), SamplingParams(max_new_tokens=4)))
  eng.abort(["dup"])
  eng.wait(h, timeout=60)


def test_update_weights_from_params_swaps_device_arrays_and_stamps_versions(local):
  """Colocated handoff: a params pytree is served from the next step on (no file), every token carries
  the version that produced it, a mismatched pytree is refused and changes nothing."""
  eng = local.engine
  prompt = _prompt(5, 70)
  before = eng.generate(GenerateRequest("wp-before", prompt, GREEDY))
  params = nnx.to_pure_dict(nnx.state(local.model))
  zero_head = jax.tree.map(lambda a: a, params)
  zero_head["lm_head"]["w"] = jnp.zeros_like(params["lm_head"]["w"])  # all logits 0: greedy picks token 0
  v0 = eng.weight_version
  assert eng.update_weights_from_params(zero_head, v0 + 1) == v0 + 1
  flat = eng.generate(GenerateRequest("wp-zero", prompt, GREEDY))
  assert flat.output_ids == (0,) * 12 and flat.weight_versions == (v0 + 1,) * 12
  np.testing.assert_allclose(flat.output_logprobs, -np.log(local.model.cfg.vocab_size), atol=1e-5)
  bad = jax.tree.map(lambda a: a, params)
  bad["lm_head"]["w"] = params["lm_head"]["w"][:, :3]
  with pytest.raises(ValueError, match="lm_head"):
    eng.update_weights_from_params(bad, v0 + 5)
  assert eng.weight_version == v0 + 1
  assert eng.update_weights_from_params(params, v0 + 2) == v0 + 2
  after = eng.generate(GenerateRequest("wp-after", prompt, GREEDY))
  assert after.output_ids == before.output_ids and after.weight_versions == (v0 + 2,) * 12


def test_closed_engine_raises_instead_of_returning_a_result():
  model = K2Model(presets.get("tiny", max_position_embeddings=64), rngs=nnx.Rngs(1))
  eng = InferenceEngine(model, EngineConfig(max_slots=1, max_seq_len=64, prefix_cache_entries=0))
  eng.close()
  with pytest.raises(RuntimeError, match="closed"):
    eng.generate(GenerateRequest("late", (1, 2, 3), GREEDY))


def test_a_failing_request_fails_alone(local, monkeypatch):
  """A request whose prefill raises (here: a poisoned prompt) fails (`wait` raises, `progress` shows an
  abort naming the error); the requests running and queued beside it finish normally."""
  engine = local.engine
  real = engine._runner.prefill
  poison = 3799

  def prefill(slot, tokens, start, sampling):
    if poison in tokens:
      raise FloatingPointError("poisoned prompt")
    return real(slot, tokens, start, sampling)

  monkeypatch.setattr(engine._runner, "prefill", prefill)
  ref = engine.generate(GenerateRequest("ref", _prompt(5, 3), GREEDY)).output_ids
  good = [engine.submit(GenerateRequest(f"good{i}", _prompt(5, 3), GREEDY)) for i in range(3)]
  bad = engine.submit(GenerateRequest("bad", (1, 2, poison), GREEDY))
  late = engine.submit(GenerateRequest("late", _prompt(5, 3), GREEDY))
  with pytest.raises(RuntimeError, match="poisoned prompt"):
    engine.wait(bad, timeout=120)
  failed = engine.progress(bad)
  assert failed.finish_reason == "abort" and "poisoned prompt" in failed.abort_message
  for live in good + [late]:
    c = engine.wait(live, timeout=120)
    assert c.finish_reason == "length" and c.output_ids == ref


def test_precompile_compiles_every_bucket_and_writes_nothing(local):
  """After precompile no request compiles (an abort never waits behind a compile) and the cache is empty."""
  runner = ModelRunner(local.model, num_slots=2, max_len=64, num_top=2, min_bucket=16)
  runner.precompile()
  assert runner._prefill._cache_size() == 3 and runner._decode._cache_size() == 1  # buckets 16, 32, 64
  assert all(not np.asarray(a).any() for a in jax.tree.leaves(runner.cache))
  for n in (1, 17, 40, 64):
    runner.prefill(0, list(_prompt(n, n)), 0, sampling_arrays([0.0], [1.0], [0], [0], [n]))
  assert runner._prefill._cache_size() == 3
