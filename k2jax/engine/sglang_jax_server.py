"""sglang-jax's engine behind k2jax's SGLang-API server: a rollout fleet on TPU that takes weight updates.

sglang-jax's own HTTP server has no weight-update route and reports no weight version (reference §2.6),
so `launch/rl.py` refuses it for RL with weight sync. `launch/serve.py --backend=sglang_jax` serves
sglang-jax's engine instead through k2jax's server (`k2jax.serve.Server`, the same routes and answers as
the k2jax backend): `SglangJaxServing` gives the server the engine surface it drives
(`submit`/`progress`/`wait`/`abort`/`update_weights`/...) over `SglangJaxEngine`
(`k2jax/engine/sglang_jax.py`), sglang-jax's engine in the server's process. On top:
- `/update_weights_from_disk` swaps the weights on device, as the colocated engine does: a whole HF
  directory or k2jax workdir, or a weight-sync delta (`k2jax.rl.weight_sync`: an index of the changed
  tensors, no config.json) overlaid on the served weights; only the sglang-jax parameters made from the
  touched k2jax leaves are replaced, nothing recompiles, and the prefix cache is flushed;
- every reply carries `meta_info.weight_version`: the update waits for in-flight requests and holds new
  ones back, so each reply was produced by one version, named on every token.
Host memory holds one copy of the served weights (numpy, k2jax layout): the delta overlays onto it (the
served copy lives on device in sglang-jax's own layout, with absorbed-MLA folds on TPU).

Streaming (`stream: true`) answers with one chunk when the request finishes: sglang-jax is driven with
whole (non-streamed) requests. Top logprobs are not reported (`num_top_logprobs` 0: asking is refused).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from k2jax import api
from k2jax.convert import overlay
from k2jax.convert.hf import _get
from k2jax.convert.layout import entries
from k2jax.engine.base import EngineCapabilities, GenerateRequest, GenerateResult, InvalidRequest
from k2jax.engine.inference import EngineConfig
from k2jax.engine.sglang_jax import SglangJaxConfig, SglangJaxEngine, write_model_dir
from k2jax.model import K2Model

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Live:
  request: GenerateRequest
  t0: float
  on_update: Callable[[], None] | None = None
  started: bool = False  # handed to sglang-jax (its abort then waits until sglang-jax knows the rid)
  aborted: bool = False
  error: str | None = None
  result: GenerateResult | None = None
  done: threading.Event = dataclasses.field(default_factory=threading.Event)


class SglangJaxServing:
  """The engine surface `k2jax.serve.Server` drives, over sglang-jax's engine in this process."""

  backend = "sglang-jax"

  def __init__(self, model: K2Model, config: SglangJaxConfig, *, model_dir: str, eos_token_ids: Sequence[int] = ()):
    """Starts sglang-jax from `model`'s architecture (config.json + tokenizer written to `model_dir`) and
    serves `model`'s weights as version 0."""
    config = dataclasses.replace(config, context_length=min(config.context_length, model.cfg.max_position_embeddings))
    self.cfg, self.sgl_config = model.cfg, config
    self.config = EngineConfig(
      max_slots=config.max_running_requests, max_seq_len=config.context_length, num_top_logprobs=0
    )
    self.eos_token_ids = tuple(eos_token_ids)
    state = nnx.to_pure_dict(nnx.state(model))
    self._state = jax.device_get(state)  # what a delta push overlays onto
    t0 = time.monotonic()
    self._engine = SglangJaxEngine(model.cfg, write_model_dir(model.cfg, model_dir), config)
    self._engine.update_weights_from_params(state, 0)
    log.info("sglang-jax engine up with the served weights in %.1f s", time.monotonic() - t0)
    self.weight_version = 0
    self._cv = threading.Condition()
    self._by_rid: dict[str, _Live] = {}
    self._closed = False
    self._update_lock = threading.Lock()
    # One thread per request in flight (sglang-jax's `generate` blocks); queued beyond sglang-jax's running
    # batch, they wait in its scheduler, where an abort finds them.
    self._pool = concurrent.futures.ThreadPoolExecutor(
      max_workers=max(64, 8 * config.max_running_requests), thread_name_prefix="sglang-jax-request"
    )

  # ---- requests --------------------------------------------------------------------------------------
  def check(self, request: GenerateRequest) -> None:
    """Raises InvalidRequest naming the field when sglang-jax cannot run `request` (nothing is queued)."""
    ids, s, max_len, vocab = request.input_ids, request.sampling, self.config.max_seq_len, self.cfg.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise InvalidRequest("input_ids", f"token ids {bad[:5]} outside [0, {vocab})")
    if len(ids) + s.max_new_tokens > max_len:
      raise InvalidRequest(
        "sampling_params.max_new_tokens",
        f"{len(ids)} prompt tokens + max_new_tokens {s.max_new_tokens} exceed sglang-jax's context length "
        f"{max_len} (launch/serve.py --max_seq_len)",
      )
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
      raise InvalidRequest("sampling_params.temperature", f"must be a finite number >= 0, got {s.temperature}")
    if not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
      raise InvalidRequest("sampling_params.top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k > vocab:
      raise InvalidRequest("sampling_params.top_k", f"must be <= the vocab size {vocab} (or -1), got {s.top_k}")
    bad_stop = [t for t in s.stop_token_ids if not 0 <= t < vocab]
    if bad_stop:
      raise InvalidRequest("sampling_params.stop_token_ids", f"token ids {bad_stop[:5]} outside [0, {vocab})")

  def submit(self, request: GenerateRequest, on_update: Callable[[], None] | None = None) -> _Live:
    """Queues `request`; `on_update` is called (from a worker thread) when it finishes."""
    self.check(request)
    live = _Live(self._with_eos(request), time.monotonic(), on_update)
    with self._cv:
      if self._closed:
        raise RuntimeError("engine is closed")
      if request.rid in self._by_rid:
        raise InvalidRequest("rid", f"request {request.rid!r} is already in flight")
      self._by_rid[request.rid] = live
    if request.sampling.max_new_tokens == 0:
      self._finish(live, self._empty(live, "length"))
    else:
      self._pool.submit(self._run, live)
    return live

  def wait(self, live: _Live, timeout: float | None = None) -> GenerateResult:
    if not live.done.wait(timeout):
      raise TimeoutError(f"request {live.request.rid!r} not finished after {timeout}s")
    if live.error is not None:
      raise RuntimeError(f"sglang-jax failed on request {live.request.rid!r}: {live.error}")
    return live.result

  def progress(self, live: _Live) -> GenerateResult:
    """The final result once done; before that an empty snapshot (whole requests: no tokens in between)."""
    if live.done.is_set() and live.result is not None:
      return live.result
    return dataclasses.replace(self._empty(live, "abort"), finish_reason=None, abort_message=None)

  def generate(self, request: GenerateRequest) -> GenerateResult:
    return self.wait(self.submit(request))

  def abort(self, rids: Sequence[str]) -> int:
    """Non-blocking; returns how many of `rids` were in flight."""
    with self._cv:
      targets = [self._by_rid[rid] for rid in rids if rid in self._by_rid]
      for live in targets:
        live.aborted = True
    started = [live.request.rid for live in targets if live.started]
    if started:
      self._engine.abort(started, pending=self._pending)
    return len(targets)

  def abort_all(self) -> int:
    with self._cv:
      rids = list(self._by_rid)
    return self.abort(rids)

  def num_running(self) -> int:
    with self._cv:
      return len(self._by_rid)

  def _pending(self, rid: str) -> bool:
    with self._cv:
      live = self._by_rid.get(rid)
      return live is not None and live.started and not live.done.is_set()

  def _run(self, live: _Live) -> None:
    with self._cv:
      if live.aborted:
        result = self._empty(live, "abort")
      else:
        live.started, result = True, None
    if result is None:
      try:
        result = dataclasses.replace(self._engine.generate(live.request), latency_s=time.monotonic() - live.t0)
      except Exception as e:  # the request's own failure (the server answers 500 for it)
        log.exception("sglang-jax failed on %s", live.request.rid)
        live.error = f"{type(e).__name__}: {e}"
    self._finish(live, result)

  def _finish(self, live: _Live, result: GenerateResult | None) -> None:
    live.result = result
    with self._cv:
      self._by_rid.pop(live.request.rid, None)
    live.done.set()
    if live.on_update is not None:
      try:
        live.on_update()
      except Exception:  # a listener's failure is its own (e.g. its event loop closed)
        log.exception("listener of %s failed", live.request.rid)

  def _empty(self, live: _Live, reason: str) -> GenerateResult:
    req = live.request
    message = "Aborted before it reached sglang-jax" if reason == "abort" else None
    return GenerateResult(req.rid, (), (), (), reason, len(req.input_ids), abort_message=message)

  def _with_eos(self, request: GenerateRequest) -> GenerateRequest:
    """The server's stop tokens (the config's eos, K2's [EOS] and <|im_end|>) on every request, as the k2jax
    backend stops on them."""
    s = request.sampling
    if s.ignore_eos or not self.eos_token_ids:
      return request
    stops = tuple(dict.fromkeys(s.stop_token_ids + self.eos_token_ids))
    return dataclasses.replace(request, sampling=dataclasses.replace(s, stop_token_ids=stops))

  # ---- weights ---------------------------------------------------------------------------------------
  def update_weights(self, model_path: str, weight_version: int | None = None, *, flush_cache: bool = True) -> int:
    """Serves the weights in `model_path` from the next request on; returns the new weight version.

    `model_path`: a weight-sync delta (its tensors replace those of the served weights) or a whole HF
    directory or k2jax workdir of the same architecture. Waits for in-flight requests; a failed load
    raises and changes nothing.
    """
    with self._update_lock:
      if overlay.is_partial_hf_dir(model_path):
        new = overlay.overlay_hf_tensors(self.cfg, self._state, model_path)
        only = {e.path for e in entries(self.cfg) if _get(new, e.path) is not _get(self._state, e.path)}
      else:
        model = api.load(model_path, param_dtype=self.cfg.param_dtype, compute_dtype=self.cfg.compute_dtype)
        if model.cfg.replace(extra=()) != self.cfg.replace(extra=()):
          raise ValueError("its config.json describes a different architecture than the served model")
        new, only = jax.device_get(nnx.to_pure_dict(nnx.state(model))), None
      version = self.weight_version + 1 if weight_version is None else int(weight_version)
      self._engine.update_weights_from_params(new, version, only=only, flush_cache=flush_cache)
      self._state, self.weight_version = new, version
      return version

  def flush_cache(self) -> None:
    self._engine.flush_cache()

  # ---- info ------------------------------------------------------------------------------------------
  def capabilities(self) -> EngineCapabilities:
    return dataclasses.replace(self._engine.capabilities(), weight_update=("disk",))

  def metrics(self) -> dict[str, int]:
    return self._engine.metrics()

  def close(self) -> None:
    with self._cv:
      self._closed = True
    self.abort_all()
    self._engine.close()
    self._pool.shutdown(wait=False, cancel_futures=True)
    with self._cv:
      never_started = [live for live in self._by_rid.values() if not live.started]
    for live in never_started:  # their worker was cancelled: answer them here
      self._finish(live, self._empty(live, "abort"))
