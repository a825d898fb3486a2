"""Several SGLang replicas behind `sglang_router`: generate through the router, control every worker.

The router (SGLang Model Gateway) balances `/generate` over its workers but does not forward
`/update_weights_from_disk` or `/abort_request`, so weight updates and aborts go to each worker directly
(as slime does). An update succeeds only when every worker loaded the new weights.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import collections
import dataclasses

from k2jax.engine.base import Engine, EngineCapabilities, GenerateRequest, GenerateResult
from k2jax.engine.http import HttpEngine


class RoutedEngine(Engine):
  """`generate` via `router`; `abort` and `update_weights` fanned out to all `workers`."""

  def __init__(self, router: HttpEngine, workers: Sequence[HttpEngine]):
    if not workers:
      raise ValueError("RoutedEngine needs at least one worker (rollout.worker_urls)")
    self.router = router
    self.workers = list(workers)
    self._pool = ThreadPoolExecutor(len(self.workers), thread_name_prefix="workers")

  def generate(self, request: GenerateRequest) -> GenerateResult:
    return self.router.generate(request)

  def abort(self, rids: Sequence[str]) -> None:
    self._all(lambda w: w.abort(rids))

  def update_weights(self, model_path: str, weight_version: int) -> None:
    self._all(lambda w: w.update_weights(model_path, weight_version))

  def capabilities(self) -> EngineCapabilities:
    """What every worker supports (the router itself is not asked: it forwards /generate only)."""
    caps = [w.capabilities() for w in self.workers]
    first = caps[0]
    return dataclasses.replace(
      first,
      weight_update=tuple(k for k in first.weight_update if all(k in c.weight_update for c in caps)),
      reports_weight_version=all(c.reports_weight_version for c in caps),
      seeded_sampling=all(c.seeded_sampling for c in caps),
      abort=all(c.abort for c in caps),
    )

  def metrics(self) -> dict[str, int]:
    total = collections.Counter(self.router.metrics())
    for w in self.workers:
      total.update(w.metrics())
    return dict(total)

  def wait_until_healthy(self, timeout_s: float) -> None:
    self._all(lambda w: w.wait_until_healthy(timeout_s))

  def close(self) -> None:
    self._pool.shutdown(wait=True)

  def _all(self, fn) -> None:
    """Runs fn on every worker in parallel; raises the first error after all have finished."""
    futures = [self._pool.submit(fn, w) for w in self.workers]
    errors = [f.exception() for f in futures]
    for e in errors:
      if e is not None:
        raise e
