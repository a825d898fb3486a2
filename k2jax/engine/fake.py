"""An in-process engine with scripted lengths and a per-token latency, for tests and rollout benchmarks.

It models what matters to rollout scheduling: at most `max_running` requests decode at once (others queue),
every running request emits one token per `per_token_latency_s`, `abort` returns the tokens emitted so far,
and a weight update changes the version stamped on tokens emitted after it. Token ids and logprobs are a
pure function of (sampling seed, absolute position), so a resumed sample continues the same sequence.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from typing import Callable, Sequence

from k2jax.engine.base import Engine, GenerateRequest, GenerateResult


@dataclasses.dataclass(frozen=True)
class FakeEngineConfig:
  per_token_latency_s: float = 1e-3
  prefill_latency_s: float = 0.0
  max_running: int = 64
  eos_id: int = 1
  vocab_size: int = 1000


class FakeEngine(Engine):
  """`length_fn(request)` returns how many more tokens (EOS included) the request would decode to stop."""

  def __init__(self, config: FakeEngineConfig, length_fn: Callable[[GenerateRequest], int]):
    self.config = config
    self._length_fn = length_fn
    self._slots = threading.BoundedSemaphore(config.max_running)
    self._lock = threading.Lock()
    self._abort_events: dict[str, threading.Event] = {}
    self._updates: list[tuple[float, int]] = [(float("-inf"), 0)]  # (time, version), sorted
    self.loaded_paths: list[str] = []
    self.busy_slot_s = 0.0  # sum over requests of decode time holding a slot

  def generate(self, request: GenerateRequest) -> GenerateResult:
    event = threading.Event()
    with self._lock:
      if request.rid in self._abort_events:
        raise ValueError(f"FakeEngine: rid {request.rid!r} is already in flight")
      self._abort_events[request.rid] = event
    try:
      return self._run(request, event)
    finally:
      with self._lock:
        del self._abort_events[request.rid]

  def abort(self, rids: Sequence[str]) -> None:
    with self._lock:
      for rid in rids:
        if rid in self._abort_events:
          self._abort_events[rid].set()

  def update_weights(self, model_path: str, weight_version: int) -> None:
    with self._lock:
      if weight_version <= self._updates[-1][1]:
        raise ValueError(f"FakeEngine: weight_version {weight_version} is not above {self._updates[-1][1]}")
      self._updates.append((time.monotonic(), weight_version))
      self.loaded_paths.append(model_path)

  def _run(self, request: GenerateRequest, aborted: threading.Event) -> GenerateResult:
    cfg, s = self.config, request.sampling
    want = max(1, int(self._length_fn(request)))
    n_max, finish = (want, "stop") if want <= s.max_new_tokens else (s.max_new_tokens, "length")
    while not self._slots.acquire(timeout=0.01):  # queue for a decode slot, abortable
      if aborted.is_set():
        return self._result(request, 0, "abort", [])
    try:
      t0 = time.monotonic() + cfg.prefill_latency_s
      duration = cfg.prefill_latency_s + n_max * cfg.per_token_latency_s
      n = n_max
      if aborted.wait(timeout=duration):
        elapsed = time.monotonic() - t0
        n = min(n_max, max(0, int(elapsed / cfg.per_token_latency_s))) if elapsed > 0 else 0
        if n < n_max:  # an abort that lands after the last token finds the request finished, as in a real engine
          finish = "abort"
      times = [t0 + (i + 1) * cfg.per_token_latency_s for i in range(n)]
      with self._lock:
        self.busy_slot_s += min(time.monotonic() - t0 + cfg.prefill_latency_s, duration)
        versions = [self._version_at(t) for t in times]
    finally:
      self._slots.release()
    return self._result(request, n, finish, versions, stop=finish == "stop")

  def _version_at(self, t: float) -> int:
    i = bisect.bisect_right([u[0] for u in self._updates], t) - 1
    return self._updates[i][1]

  def _result(
    self, request: GenerateRequest, n: int, finish: str, versions: list[int], stop: bool = False
  ) -> GenerateResult:
    seed = request.sampling.seed or 0
    start = len(request.input_ids)
    ids = [token_at(seed, start + i, self.config) for i in range(n)]
    if stop and n:
      ids[-1] = self.config.eos_id
    logprobs = tuple(-0.05 - ((seed + start + i) % 7) * 0.1 for i in range(n))
    return GenerateResult(
      rid=request.rid,
      output_ids=tuple(ids),
      output_logprobs=logprobs,
      weight_versions=tuple(versions),
      finish_reason=finish,
      prompt_tokens=len(request.input_ids),
      matched_stop=self.config.eos_id if finish == "stop" else None,
      abort_message="Aborted by request" if finish == "abort" else None,
    )


def token_at(seed: int, position: int, config: FakeEngineConfig) -> int:
  """The fake's token at an absolute position: never EOS, never 0 (kept free for padding)."""
  return 2 + (seed * 7919 + position * 104729) % (config.vocab_size - 2)
