"""Prompt scoring batched: requests that ask for prompt logprobs (logprob_start_len >= 0) admitted in one
step run as one scored prefill program, and get the logprobs, top logprobs and tokens they get one at a
time, equal to the full forward pass; plain requests admitted beside them run their own program."""

import numpy as np
import pytest

from k2jax.engine import GenerateRequest, InvalidRequest, SamplingParams

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
