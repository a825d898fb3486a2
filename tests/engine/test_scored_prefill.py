"""Prompt scoring batched: requests that ask for prompt logprobs (logprob_start_len >= 0) admitted in one
step run as one scored prefill program, and get the logprobs, top logprobs and tokens they get one at a
time, equal to the full forward pass; plain requests admitted beside them run their own program."""

import numpy as np
import pytest

from k2jax.engine import GenerateRequest, InvalidRequest, SamplingParams

from .conftest import MAX_LEN

GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)


def _prompt(n, seed):
  return tuple(int(t) for t in np.random.RandomState(seed).randint(0, 3800, n))


def _requests(tag):
  """Mixed lengths (buckets 16 and 32), start positions, scoring only (max_new_tokens 0) and a plain one."""
  return [
    GenerateRequest(f"{tag}-a", _prompt(5, 91), GREEDY, logprob_start_len=0),
    GenerateRequest(f"{tag}-b", _prompt(27, 92), GREEDY, logprob_start_len=4),
    GenerateRequest(f"{tag}-c", _prompt(12, 93), SamplingParams(max_new_tokens=0), logprob_start_len=1),
    GenerateRequest(f"{tag}-plain", _prompt(9, 94), GREEDY),
  ]


def test_scored_prompts_admitted_together_prefill_in_one_program(local, monkeypatch):
  eng = local.engine
  calls = []
  scored, plain = eng._runner.prefill_scored, eng._runner.prefill

  def counting_scored(slots, prompts, sampling, **kw):
    calls.append(("scored", len(slots)))
    return scored(slots, prompts, sampling, **kw)

  def counting_plain(slot, tokens, start, sampling):
    calls.append(("plain", len(np.atleast_1d(slot))))
    return plain(slot, tokens, start, sampling)

  monkeypatch.setattr(eng._runner, "prefill_scored", counting_scored)
  monkeypatch.setattr(eng._runner, "prefill", counting_plain)
  eng.flush_cache()
  one_at_a_time = [eng.generate(r) for r in _requests("alone")]
  assert calls == [("scored", 1)] * 3 + [("plain", 1)]

  eng.flush_cache()
  calls.clear()
  eng.pause()  # all 4 wait, so the next step admits them together
  handles = [eng.submit(r) for r in _requests("together")]
  eng.resume()
  together = [eng.wait(h, timeout=300) for h in handles]
  assert calls == [("scored", 3), ("plain", 1)]  # the scored ones in one program, the plain one in its own

  for req, b, a in zip(_requests("ref"), together, one_at_a_time):
    assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason, b.rid
    np.testing.assert_allclose(b.output_logprobs, a.output_logprobs, atol=1e-5, rtol=0)
    if req.logprob_start_len < 0:
      assert b.input_logprobs == () == a.input_logprobs
      continue
    ids, start = list(req.input_ids), req.logprob_start_len
    ref = np.asarray(local.forward_logprobs(ids), np.float64)
    want = [ref[p - 1, ids[p]] for p in range(max(start, 1), len(ids))]
    for res in (a, b):
      assert len(res.input_logprobs) == len(ids) - start == len(res.input_top_logprobs)
      assert (res.input_logprobs[0] is None) == (start == 0)
      np.testing.assert_allclose([lp for lp in res.input_logprobs if lp is not None], want, atol=1e-5, rtol=0)
      # Each position's top logprobs: the forward's top k at the position before, most likely first.
      for p, top in zip(range(start, len(ids)), res.input_top_logprobs):
        if p == 0:
          assert top == ()
          continue
        k = len(top)
        assert k == eng.config.num_top_logprobs and [t for t, _ in top] == list(np.argsort(-ref[p - 1])[:k])
        np.testing.assert_allclose([lp for _, lp in top], np.sort(ref[p - 1])[::-1][:k], atol=1e-5, rtol=0)
    assert [t for t, _ in b.input_top_logprobs[-1]] == [t for t, _ in a.input_top_logprobs[-1]]
    if req.sampling.max_new_tokens:  # the greedy token after the prompt is the forward's argmax there
      assert b.output_ids[0] == int(np.argmax(ref[-1]))


def test_one_top_logprob_runs_the_cheaper_program(local):
  """`input_top_logprobs_num` <= 1 (lm-eval's `logprobs: 1`): the scored program with top-1 at the prompt
  positions; the same token logprobs, and the top entry is the forward's argmax. A batch where any request
  wants all of them runs the full one."""
  eng = local.engine
  ids = list(_prompt(20, 95))
  ref = np.asarray(local.forward_logprobs(ids), np.float64)
  full = eng.generate(GenerateRequest("top-all", tuple(ids), SamplingParams(max_new_tokens=0), logprob_start_len=0))
  one = eng.generate(
    GenerateRequest(
      "top-1", tuple(ids), SamplingParams(max_new_tokens=0), logprob_start_len=0, input_top_logprobs_num=1
    )
  )
  assert one.input_logprobs == full.input_logprobs
  assert [len(t) for t in one.input_top_logprobs] == [0] + [1] * (len(ids) - 1)
  assert [len(t) for t in full.input_top_logprobs] == [0] + [eng.config.num_top_logprobs] * (len(ids) - 1)
  for p, top in enumerate(one.input_top_logprobs[1:], 1):
    assert top[0][0] == int(np.argmax(ref[p - 1])) == full.input_top_logprobs[p][0][0]
    np.testing.assert_allclose(top[0][1], ref[p - 1].max(), atol=1e-5, rtol=0)
  with pytest.raises(InvalidRequest, match="input_top_logprobs_num"):
    GenerateRequest("bad", (1, 2), logprob_start_len=0, input_top_logprobs_num=-2)


def test_scored_rows_decode_on_as_plain_ones(local):
  """A scored prefill writes its rows' cache entries itself (it reads no cache row): decoding after it gives
  the tokens and logprobs decoding after a plain prefill gives, in slots a longer prompt dirtied before."""
  eng = local.engine
  eng.flush_cache()
  long = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
  handles = eng.submit_many([GenerateRequest(f"dirty-{i}", _prompt(90, 100 + i), long) for i in range(4)])
  [eng.wait(h, timeout=300) for h in handles]
  eng.flush_cache()
  sampling = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
  prompts = [_prompt(n, 110 + n) for n in (3, 17, 30)]
  scored = [
    eng.wait(h, timeout=300)
    for h in eng.submit_many(
      [GenerateRequest(f"s-{i}", p, sampling, logprob_start_len=0) for i, p in enumerate(prompts)]
    )
  ]
  eng.flush_cache()
  plain = [eng.generate(GenerateRequest(f"p-{i}", p, sampling)) for i, p in enumerate(prompts)]
  for s, p in zip(scored, plain):
    assert s.output_ids == p.output_ids and len(s.output_ids) == 5
    np.testing.assert_allclose(s.output_logprobs, p.output_logprobs, atol=1e-5, rtol=0)


def test_submit_many_admits_together_and_refuses_one_alone(local, monkeypatch):
  """Requests queued by one `submit_many` are admitted in one step (one scored program for all of them);
  one the engine refuses comes back as its error, in its place, and the others still run."""
  eng = local.engine
  calls = []
  scored = eng._runner.prefill_scored

  def counting(slots, prompts, sampling, **kw):
    calls.append(len(slots))
    return scored(slots, prompts, sampling, **kw)

  monkeypatch.setattr(eng._runner, "prefill_scored", counting)
  eng.flush_cache()
  score = SamplingParams(max_new_tokens=0)
  reqs = [GenerateRequest(f"many-{i}", _prompt(10 + i, 120 + i), score, logprob_start_len=1) for i in range(3)]
  reqs.insert(1, GenerateRequest("many-bad", (1, eng.cfg.vocab_size), score, logprob_start_len=0))
  handles = eng.submit_many(reqs)
  assert isinstance(handles[1], InvalidRequest) and handles[1].field == "input_ids"
  results = [eng.wait(h, timeout=300) for h in handles if not isinstance(h, Exception)]
  assert calls == [3] and [len(r.input_logprobs) for r in results] == [9, 10, 11]


def test_default_prefill_budget_holds_every_slot_at_full_length(local):
  """`max_prefill_tokens` 0: rows * T up to 8192 (vLLM's and SGLang's default), so every slot's prompt of
  any length the engine takes is prefilled (and scored) in one program here."""
  runner = local.engine._runner
  assert runner.max_prefill_tokens == 4 * MAX_LEN
  assert runner.prefill_fits(4, MAX_LEN) and (4, MAX_LEN) in runner.prefill_buckets()


@pytest.mark.slow
def test_precompile_scored_compiles_every_bucket_and_writes_nothing():
  """`precompile(scored=True)`: the one-top-logprob scored program of every bucket compiled up front (no
  scoring request waits behind a compile), and the cache still all zeros."""
  import jax

  from flax import nnx

  from k2jax.engine.runner import ModelRunner, sampling_arrays
  from k2jax.model import K2Model, presets

  model = K2Model(presets.get("tiny", max_position_embeddings=32), rngs=nnx.Rngs(0))
  runner = ModelRunner(model, num_slots=2, max_len=32, num_top=4)
  runner.precompile(plain=False, scored=True)
  fn = runner._prefill_scored[1]
  assert runner.prefill_buckets() == [(1, 16), (1, 32), (2, 16), (2, 32)] and fn._cache_size() == 4
  assert all(not np.asarray(a).any() for a in jax.tree.leaves(runner.cache))
  greedy = sampling_arrays([0.0] * 2, [1.0] * 2, [0] * 2, [0] * 2, [0] * 2)
  for n in (5, 20):
    runner.prefill_scored([0, 1], [list(_prompt(n, 1)), list(_prompt(n - 2, 2))], greedy, prompt_top=1)
  assert fn._cache_size() == 4 and runner._prefill._cache_size() == 0
