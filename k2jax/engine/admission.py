"""Admission: the scheduler step that moves waiting requests into free slots and prefills them.

Each step, between two decode steps, `InferenceEngine` (whose state this mixin reads: `_cv`, `_waiting`,
`_slots`, `_prefix`, `_runner`, `_exec`, and its `_emit`/`_release`/`_fail`) fills its free slots from
the queue, a batch at a time: the requests admitted together are prefilled in one program (SGLang's and
vLLM's prefill batch), as many as `ModelRunner.prefill_fits` allows. A request's longest cached prefix is
copied in and only the rest is prefilled. Requests that score their prompt (`logprob_start_len` >= 0) run
the scored program (`scored.py`) whole, batched with each other and never with plain ones. A batch whose
program fails is prefilled again one request at a time, so only the request that made it fail fails.
Scheduler thread only.
"""

from __future__ import annotations

import logging

from k2jax.engine.requests import Live, apply_scores, sampling_of

log = logging.getLogger("k2jax.engine.inference")


class Admission:
  """`InferenceEngine`'s admission and prefill (a mixin: the engine owns every attribute used here)."""

  def _admit(self) -> None:
    """Fills free slots from the queue, a batch at a time: the requests admitted together are prefilled
    in one program (SGLang's and vLLM's prefill batch), as many as `ModelRunner.prefill_fits` allows."""
    while True:
      batch = []  # (slot, live, prefix entry, tokens reused)
      with self._cv:
        free = [i for i, s in enumerate(self._slots) if s is None]
        longest = 0
        while len(batch) < len(free) and self._waiting:
          live = self._waiting[0]
          tokens = live.request.input_ids
          scored = live.request.logprob_start_len >= 0
          # Prompts that score themselves run the scored program (`_prefill_scored`), batched together;
          # never with plain ones, whose program stays the cheaper one.
          if batch and scored != (batch[0][1].request.logprob_start_len >= 0):
            break
          common, entry = self._prefix.lookup(tokens)
          # At least one token must run to produce logits; a scored prompt runs whole: every position's
          # logits come from this pass (no prefix reuse), so none is taken from another request's row.
          reuse = 0 if scored else min(common, len(tokens) - 1)
          if batch and not self._runner.prefill_fits(len(batch) + 1, max(longest, len(tokens) - reuse)):
            break
          longest = max(longest, len(tokens) - reuse)
          self._waiting.popleft()
          self._slots[free[len(batch)]] = live
          batch.append((free[len(batch)], live, entry if reuse > 0 else -1, reuse))
      if not batch:
        return
      if batch[0][1].request.logprob_start_len >= 0:
        self._prefill_scored(batch)
      else:
        self._prefill(batch)

  def _prefill_scored(self, batch: list[tuple[int, Live, int, int]]) -> None:
    """Prefills requests whose prompt logprobs were asked for, in one program; the logprobs come from this
    same forward pass (whole prompts: no prefix reuse, `_admit`)."""
    for _, live, _, _ in batch:
      live.cached, live.fed = 0, list(live.request.input_ids)
    try:
      wanted = [live.request.input_top_logprobs_num for _, live, _, _ in batch]
      out, scores = self._runner.prefill_scored(
        [slot for slot, _, _, _ in batch],
        [live.fed for _, live, _, _ in batch],
        sampling_of([b[1] for b in batch]),
        prompt_top=None if min(wanted) < 0 else max(wanted),
      )
    except Exception as e:
      if len(batch) == 1:
        log.exception("prefill of %s failed", batch[0][1].request.rid)
        with self._cv:
          self._fail(batch[0][1], batch[0][0], f"engine error: {type(e).__name__}: {e}")
        return
      log.warning("scored prefill of %d requests failed (%s: %s); one by one", len(batch), type(e).__name__, e)
      for item in batch:
        self._prefill_scored([item])
      return
    apply_scores([live for _, live, _, _ in batch], scores)
    for i, (slot, live, _, _) in enumerate(batch):
      if live.request.sampling.max_new_tokens == 0:  # scoring only: no token is sampled
        self._release(slot, live, "length")
      else:
        self._emit(slot, live, out, i)

  def _prefill(self, batch: list[tuple[int, Live, int, int]]) -> None:
    for _, live, _, reuse in batch:
      live.cached, live.fed = reuse, list(live.request.input_ids)
    rows = [(slot, entry, reuse, live.fed[reuse:]) for slot, live, entry, reuse in batch]
    try:
      out = self._exec.prefill(rows, sampling_of([live for _, live, _, _ in batch]))
    except Exception as e:
      if len(batch) == 1:  # one request's prefill failed: fail it alone, the others keep running
        log.exception("prefill of %s failed", batch[0][1].request.rid)
        with self._cv:
          self._fail(batch[0][1], batch[0][0], f"engine error: {type(e).__name__}: {e}")
        return
      # Which request made the batch fail is unknown: prefill each alone, so only that one fails.
      log.warning(
        "batched prefill of %d requests failed (%s: %s); prefilling them one by one", len(batch), type(e).__name__, e
      )
      for slot, live, entry, reuse in batch:
        if entry >= 0 and entry not in self._exec.rows:  # evicted by a request of this batch that finished
          entry, reuse = -1, 0
        self._prefill([(slot, live, entry, reuse)])
      return
    for i, (slot, live, _, _) in enumerate(batch):
      self._emit(slot, live, out, i)
