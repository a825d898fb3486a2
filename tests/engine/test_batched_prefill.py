"""Batched prefill: the requests admitted in one scheduling step run as one prefill program, and give the
tokens and logprobs they get when admitted one at a time (mixed lengths, a prefix hit, per-row sampling)."""

import numpy as np

from k2jax.engine import GenerateRequest, SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def _prompt(n, seed):
  return tuple(int(t) for t in np.random.RandomState(seed).randint(0, 3800, n))


def _requests(history):
  """4 requests (the shared engine's 4 slots): new-token counts 3, 20 and 9 (length buckets 16 and 32),
  one sampled, one that finishes at its first token, and one resending `history` (a prefix hit)."""
  sampled = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=40, seed=5, ignore_eos=True)
  return [
    GenerateRequest("bp-short", _prompt(3, 81), GREEDY),
    GenerateRequest("bp-long", _prompt(20, 82), sampled),
    GenerateRequest("bp-one", _prompt(9, 83), SamplingParams(max_new_tokens=1, temperature=0.0)),
    GenerateRequest("bp-hit", history + _prompt(5, 84), GREEDY),
  ]


def _seed_prefix(eng):
  """A fresh prefix cache holding one finished sequence; returns its tokens (prompt + output)."""
  eng.flush_cache()
  prompt = _prompt(6, 80)
  first = eng.generate(GenerateRequest("bp-seed", prompt, GREEDY))
  return prompt + tuple(first.output_ids)


def test_requests_admitted_together_prefill_in_one_program_like_one_at_a_time(local, monkeypatch):
  eng = local.engine
  rows_per_call = []
  real = eng._runner.prefill

  def counting(slot, tokens, start, sampling):
    rows_per_call.append(len(np.atleast_1d(slot)))
    return real(slot, tokens, start, sampling)

  monkeypatch.setattr(eng._runner, "prefill", counting)
  history = _seed_prefix(eng)
  one_at_a_time = [eng.generate(r) for r in _requests(history)]
  assert rows_per_call == [1] * 5  # the seed and the 4 requests

  history = _seed_prefix(eng)
  rows_per_call.clear()
  eng.pause()  # all 4 wait, so the next step admits them together
  handles = [eng.submit(r) for r in _requests(history)]
  eng.resume()
  together = [eng.wait(h, timeout=120) for h in handles]
  assert rows_per_call == [4]  # one prefill program for the step's 4 admissions

  for b, a in zip(together, one_at_a_time):
    assert b.output_ids == a.output_ids, b.rid
    assert b.finish_reason == a.finish_reason and b.cached_tokens == a.cached_tokens
    np.testing.assert_allclose(b.output_logprobs, a.output_logprobs, atol=1e-5, rtol=0)
  assert together[3].cached_tokens == len(history) - 1 > 0  # the prefix hit reused the cached row
  assert len(together[2].output_ids) == 1 and len(together[1].output_ids) == 6
