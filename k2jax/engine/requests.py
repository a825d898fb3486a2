"""A request's life inside `InferenceEngine`: its record, the sampling inputs of a step, its stop conditions,
the result it publishes, and the checks it must pass before it is queued.

The engine's scheduler owns the slots and the device; everything here is per request and host-only: a
`Live` collects the tokens sampled for it (with their logprobs, top logprobs and the weight version that
produced each), `finish_reason` decides when it stops, and `Live.snapshot` is what callers see, partial
while it runs (`progress`) and final once done (`Live.result`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from typing import Callable, Sequence

from k2jax.engine.base import GenerateRequest, GenerateResult, InvalidRequest, SamplingParams
from k2jax.engine.sampling import Sampled, SamplingArrays, sampling_arrays

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Live:
  """One request in the engine: waiting, in a slot, or done."""

  request: GenerateRequest
  seed: int
  t0: float
  fed: list[int] = dataclasses.field(default_factory=list)  # tokens whose keys are in the slot's row
  out: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  tops: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
  cached: int = 0
  input_logprobs: tuple[float | None, ...] = ()  # from request.logprob_start_len on (the prefill's scores)
  input_tops: tuple[tuple[tuple[int, float], ...], ...] = ()
  abort_message: str | None = None
  error: str | None = None  # the engine failed: `wait` raises instead of returning
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  result: GenerateResult | None = None  # the final result, once done
  on_update: Callable[[], None] | None = None  # called (scheduler thread) after each token and at the end

  def notify(self) -> None:
    if self.on_update is not None:
      try:
        self.on_update()
      except Exception:  # a listener's failure is its own (e.g. its event loop closed)
        log.exception("listener of %s failed", self.request.rid)

  def append(self, out: Sampled, i: int, weight_version: int) -> int:
    """Appends row i of a step's sampled output (token first: `complete_tokens` reads the others' lengths)."""
    token = int(out.tokens[i])
    self.out.append(token)
    self.logprobs.append(float(out.logprobs[i]))
    self.versions.append(weight_version)
    k = len(out.top_ids[i])
    self.tops.append(tuple((int(out.top_ids[i][j]), float(out.top_logprobs[i][j])) for j in range(k)))
    return token

  def complete_tokens(self) -> int:
    """Tokens with every field appended (a step in progress, or one that failed midway, may lag)."""
    return min(len(self.out), len(self.logprobs), len(self.versions), len(self.tops))

  def drop_partial(self) -> None:
    """Forgets a token whose fields were only partly appended (a step that failed midway)."""
    n = self.complete_tokens()
    del self.out[n:], self.logprobs[n:], self.versions[n:], self.tops[n:]

  def snapshot(self, now: float, reason: str | None = None, matched: int | str | None = None) -> GenerateResult:
    """The request as callers see it: finished with `reason`, or (None) the tokens so far."""
    n, req = self.complete_tokens(), self.request
    return GenerateResult(
      rid=req.rid,
      output_ids=tuple(self.out[:n]),
      output_logprobs=tuple(self.logprobs[:n]),
      weight_versions=tuple(self.versions[:n]),
      finish_reason=reason,
      prompt_tokens=len(req.input_ids),
      matched_stop=matched,
      abort_message=self.abort_message if reason == "abort" else None,
      top_logprobs=tuple(self.tops[:n]),
      cached_tokens=self.cached,
      latency_s=now - self.t0,
      input_logprobs=self.input_logprobs,
      input_top_logprobs=self.input_tops,
    )


def sampling_of(lives: Sequence[Live | None]) -> SamplingArrays:
  """The sampling inputs of one step, a row per live (None: a free slot, greedy on padding)."""
  # Keyed by the sampled token's position in prompt + output, so a resumed request continues exactly.
  params = [
    (v.request.sampling, v.seed, len(v.request.input_ids) + len(v.out)) if v is not None else (SamplingParams(), 0, 0)
    for v in lives
  ]
  return sampling_arrays(
    [p[0].temperature for p in params],
    [p[0].top_p for p in params],
    [p[0].top_k for p in params],
    [p[1] for p in params],
    [p[2] for p in params],
  )


def apply_scores(lives: Sequence[Live], scores) -> None:
  """Sets each live's prompt logprobs (from its logprob_start_len on; position 0's is None, it has no
  context) and top logprobs (position p's: row p - 1 of the program's, () for position 0) from the
  per-row (token_lp [n - 1], top_ids [n, k], top_lp [n, k]) that `ModelRunner.prefill_scored` returns."""
  for live, (token_lp, top_ids, top_lp) in zip(lives, scores):
    start = live.request.logprob_start_len
    lps = [None] + token_lp.tolist()
    if top_ids.shape[1] == 1:  # likelihood scoring's one top logprob: no per-position zip
      tops = [()] + [((i, v),) for i, v in zip(top_ids[:-1, 0].tolist(), top_lp[:-1, 0].tolist())]
    else:
      ids, lp = top_ids[:-1].tolist(), top_lp[:-1].tolist()
      tops = [()] + [tuple(zip(i, v)) for i, v in zip(ids, lp)]
    live.input_logprobs, live.input_tops = tuple(lps[start:]), tuple(tops[start:])


def finish_reason(
  live: Live, token: int, eos_token_ids: Sequence[int], detokenize: Callable[[list[int]], str] | None
) -> tuple[str, int | str | None] | None:
  """(reason, matched stop) once `token` (just appended) ends the request, else None."""
  s = live.request.sampling
  if token in s.stop_token_ids or (not s.ignore_eos and token in eos_token_ids):
    return "stop", token
  if s.stop and detokenize is not None:
    text = detokenize(live.out)
    for stop in s.stop:
      if stop in text:
        return "stop", stop
  if len(live.out) >= s.max_new_tokens:
    return "length", None
  return None


def check_request(request: GenerateRequest, max_len: int, vocab: int, can_detokenize: bool) -> None:
  """Raises InvalidRequest naming the field when an engine of `max_len` tokens per sequence and `vocab`
  tokens cannot run `request`."""
  ids, s = request.input_ids, request.sampling
  bad = [t for t in ids if not 0 <= t < vocab]
  if bad:
    raise InvalidRequest("input_ids", f"token ids {bad[:5]} outside [0, {vocab})")
  if len(ids) >= max_len:
    raise InvalidRequest(
      "input_ids",
      f"prompt of {len(ids)} tokens is too long: the maximum sequence length is {max_len} tokens (prompt + new tokens)",
    )
  if len(ids) + s.max_new_tokens > max_len:
    raise InvalidRequest(
      "sampling_params.max_new_tokens",
      f"{len(ids)} prompt tokens + max_new_tokens {s.max_new_tokens} exceed the maximum sequence length {max_len}",
    )
  if not (math.isfinite(s.temperature) and s.temperature >= 0):
    raise InvalidRequest("sampling_params.temperature", f"must be a finite number >= 0, got {s.temperature}")
  if not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
    raise InvalidRequest("sampling_params.top_p", f"must be in (0, 1], got {s.top_p}")
  if s.top_k > vocab:  # <= 0 means no limit; beyond the vocab the sampler's top-k would overflow
    raise InvalidRequest("sampling_params.top_k", f"must be <= the vocab size {vocab} (or -1), got {s.top_k}")
  bad_stop = [t for t in s.stop_token_ids if not 0 <= t < vocab]
  if bad_stop:
    raise InvalidRequest("sampling_params.stop_token_ids", f"token ids {bad_stop[:5]} outside [0, {vocab})")
  if s.stop and not can_detokenize:
    raise InvalidRequest("sampling_params.stop", "stop strings need a tokenizer; this server has none")
