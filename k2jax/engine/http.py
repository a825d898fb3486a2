"""SGLang-compatible HTTP engine client (SGLang, sglang-jax, or the embedded k2jax server).

Speaks the `/generate` contract of reference §2.1 token-in/token-out and validates every answer: lengths of
`output_ids`, `completion_tokens` and `output_token_logprobs` agree, logprob ids equal `output_ids`, finish
reasons are known. Two shapes real servers send are recovered, and counted in `metrics()`:
- "Abort before prefill" (SGLang and sglang-jax, a request aborted while still queued): no `output_ids`,
  `prompt_tokens` 0, finish `abort` -> an empty aborted result, which partial rollout resubmits;
- sglang-jax past 50 generated tokens puts the first 50 logprob entries in front of the list again
  (reference §2.6): repaired to the last n entries only when the leading block equals the next 50
  entries exactly; any other length mismatch is rejected (and retried as a malformed reply);
- sglang-jax's `output_ids` come from its detokenizer, which drops a token whose text is an incomplete UTF-8
  sequence (detokenizer_manager.py, incremental decoding): fewer ids than `completion_tokens`. When the
  logprob entries (straight from the scheduler) hold `completion_tokens` ids of which `output_ids` is a
  subsequence, those ids are the sample ("output_ids_restored").
Weight versions come only from the server (`meta_info.weight_version`; "default" = its launch weights =
version 0); a reply without one gives `UNKNOWN_VERSION` tokens, never the client's own counter.
`capabilities()` runs the handshake of `handshake.py` once and caches it.

Concurrency: blocking calls, one HTTP connection per call, safe from many threads; the rollout manager
runs one thread per in-flight request. `abort` from another thread makes the blocked `generate` return
its partial output.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from typing import Any, Callable, Sequence

from k2jax.engine.base import (
  FINISH_TYPES,
  UNKNOWN_VERSION,
  Engine,
  EngineCapabilities,
  GenerateRequest,
  GenerateResult,
)
from k2jax.engine.handshake import probe_capabilities
from k2jax.transport import RequestRejected, RetryPolicy, ServiceError, call_json

DUPLICATED_LOGPROBS = 50  # sglang-jax repeats this many leading logprob entries past this many tokens


@dataclasses.dataclass(frozen=True)
class HttpEngineConfig:
  """Options of the HTTP backend only."""

  url: str  # e.g. http://127.0.0.1:30000 (no trailing path)
  generate_timeout_s: float = 600.0  # one /generate may decode a long answer
  control_timeout_s: float = 30.0  # abort, health, info, flush
  update_timeout_s: float = 600.0  # /update_weights_from_disk loads tensors
  retry: RetryPolicy = RetryPolicy()
  api_key: str | None = None  # sent as a Bearer token (SGLang --api-key)

  def __post_init__(self):
    if not self.url.startswith(("http://", "https://")):
      raise ValueError(f"HttpEngineConfig.url must start with http:// or https://, got {self.url!r}")


class HttpEngine(Engine):
  """`Engine` over the SGLang HTTP API."""

  def __init__(self, config: HttpEngineConfig):
    self.config = config
    self._base = config.url.rstrip("/")
    self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    self._lock = threading.Lock()
    self._counters: collections.Counter[str] = collections.Counter()
    self._capabilities: EngineCapabilities | None = None
    self._probe_lock = threading.Lock()  # the probe talks to the server: not under the counters' lock

  def capabilities(self) -> EngineCapabilities:
    """The server's identity and capabilities (probed on the first call, then cached)."""
    with self._probe_lock:
      if self._capabilities is None:
        c = self.config
        self._capabilities = probe_capabilities(self._base, self._headers, c.control_timeout_s, c.retry)
      return self._capabilities

  def metrics(self) -> dict[str, int]:
    with self._lock:
      return dict(self._counters)

  def _count(self, name: str, n: int = 1) -> None:
    with self._lock:
      self._counters[name] += n

  def generate(self, request: GenerateRequest) -> GenerateResult:
    return call_json(
      f"{self._base}/generate",
      _generate_payload(request),
      timeout_s=self.config.generate_timeout_s,
      retry=self.config.retry,
      headers=self._headers,
      validate=lambda body: parse_generate_response(body, request, self._count),
      before_retry=lambda: self._abort_quietly(request.rid),
    )

  def abort(self, rids: Sequence[str]) -> None:
    for rid in rids:
      self._control("abort_request", {"rid": rid, "abort_all": False}, parse_json=False)

  def update_weights(self, model_path: str, weight_version: int) -> None:
    url = f"{self._base}/update_weights_from_disk"
    self.capabilities().require(
      f"loading {model_path} as weight version {weight_version} (restart the server on an export instead)",
      self._base,
      weight_update=True,
    )
    payload = {
      "model_path": model_path,
      "weight_version": str(weight_version),
      "flush_cache": True,
      "abort_all_requests": False,
    }

    def check(body: Any) -> None:
      if not isinstance(body, dict) or "success" not in body:
        raise ValueError(f"expected an object with 'success', got {body!r}")
      if body["success"] is not True:
        raise RequestRejected(f"{url}: weight update from {model_path} failed: {body.get('message')!r}")

    call_json(
      url,
      payload,
      timeout_s=self.config.update_timeout_s,
      retry=self.config.retry,
      headers=self._headers,
      validate=check,
    )

  def health(self) -> bool:
    """True when `/health` answers 200 (SGLang runs a one-token generation when idle)."""
    try:
      self._control("health", None, parse_json=False)
      return True
    except ServiceError:
      return False

  def wait_until_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not self.health():
      if time.monotonic() > deadline:
        raise ServiceError(f"{self._base}/health: engine not healthy after {timeout_s}s")
      time.sleep(poll_s)

  def model_info(self) -> dict:
    info = self._control("get_model_info", None)
    if not isinstance(info, dict) or "model_path" not in info:
      raise ServiceError(f"{self._base}/get_model_info: expected an object with model_path, got {info!r}")
    return info

  def flush_cache(self) -> None:
    self._control("flush_cache", {}, parse_json=False)

  def _control(self, route: str, payload: Any, parse_json: bool = True) -> Any:
    return call_json(
      f"{self._base}/{route}",
      payload,
      timeout_s=self.config.control_timeout_s,
      retry=self.config.retry,
      headers=self._headers,
      parse_json=parse_json,
    )

  def _abort_quietly(self, rid: str) -> None:
    try:
      self.abort([rid])
    except ServiceError:
      pass  # the retry that follows reports the real failure


def _generate_payload(request: GenerateRequest) -> dict:
  s = request.sampling
  sampling = {
    "max_new_tokens": s.max_new_tokens,
    "temperature": s.temperature,
    "top_p": s.top_p,
    "top_k": s.top_k,
    "stop_token_ids": list(s.stop_token_ids),
  }
  if s.seed is not None:
    sampling["sampling_seed"] = s.seed
  return {
    "input_ids": list(request.input_ids),
    "sampling_params": sampling,
    "return_logprob": True,
    "rid": request.rid,
    "stream": False,
  }


def parse_generate_response(
  body: Any, request: GenerateRequest, count: Callable[[str], None] = lambda name: None
) -> GenerateResult:
  """Checks a non-streaming `/generate` answer against reference §2.1; raises ValueError naming the field.

  `count(name)` is told about recovered shapes ("abort_before_prefill", "logprobs_dup_repaired"),
  rejected duplications ("logprobs_dup_rejected") and replies without a weight version.
  """
  rid = request.rid
  if not isinstance(body, dict):
    raise ValueError(f"rid {rid}: expected a JSON object, got {type(body).__name__}")
  meta = body.get("meta_info")
  if not isinstance(meta, dict):
    raise ValueError(f"rid {rid}: meta_info must be an object, got {meta!r:.100}")
  finish = meta.get("finish_reason")
  if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
    raise ValueError(f"rid {rid}: finish_reason must be {{type: stop|length|abort}}, got {finish!r}")
  if _aborted_before_prefill(body, meta, finish, request):
    count("abort_before_prefill")
    message = str(finish.get("message", "aborted before prefill"))
    return GenerateResult(rid, (), (), (), "abort", prompt_tokens=0, text=body.get("text"), abort_message=message)
  output_ids = body.get("output_ids")
  if not isinstance(output_ids, list) or not all(_is_int(t) for t in output_ids):
    raise ValueError(f"rid {rid}: output_ids must be a list of ints, got {output_ids!r:.100}")
  output_ids = _restore_dropped_ids(output_ids, meta, count)
  n = len(output_ids)
  for key, want in (("completion_tokens", n), ("prompt_tokens", len(request.input_ids))):
    if not _is_int(meta.get(key)) or meta[key] != want:
      raise ValueError(f"rid {rid}: meta_info.{key}={meta.get(key)!r}, expected {want}")
  logprobs = _parse_logprobs(meta.get("output_token_logprobs"), output_ids, rid, count)
  if n > request.sampling.max_new_tokens:
    raise ValueError(f"rid {rid}: {n} tokens exceed max_new_tokens={request.sampling.max_new_tokens}")
  version = _parse_version(meta.get("weight_version"), rid)
  if version == UNKNOWN_VERSION:
    count("replies_without_weight_version")
  text = body.get("text")
  if text is not None and not isinstance(text, str):
    raise ValueError(f"rid {rid}: text must be a string, got {type(text).__name__}")
  return GenerateResult(
    rid=rid,
    output_ids=tuple(output_ids),
    output_logprobs=logprobs,
    weight_versions=(version,) * n,
    finish_reason=finish["type"],
    prompt_tokens=meta["prompt_tokens"],
    text=text,
    matched_stop=finish.get("matched") if isinstance(finish.get("matched"), (int, str)) else None,
    abort_message=str(finish.get("message")) if finish["type"] == "abort" else None,
    cached_tokens=meta["cached_tokens"] if _is_int(meta.get("cached_tokens")) else 0,
  )


def _aborted_before_prefill(body: dict, meta: dict, finish: dict, request: GenerateRequest) -> bool:
  """SGLang's reply to a request aborted while queued: nothing generated, nothing even prefilled."""
  return (
    finish["type"] == "abort"
    and body.get("output_ids") in (None, [])
    and meta.get("completion_tokens", 0) == 0
    and meta.get("prompt_tokens", 0) in (0, len(request.input_ids))
    and meta.get("output_token_logprobs") in (None, [])
    and body.get("text") in (None, "")
  )


def _restore_dropped_ids(output_ids: list, meta: dict, count: Callable[[str], None]) -> list:
  """The sampled ids from the logprob entries when the detokenizer dropped some of them (module docstring)."""
  n, entries = meta.get("completion_tokens"), meta.get("output_token_logprobs")
  if not (_is_int(n) and len(output_ids) < n and isinstance(entries, list)):
    return output_ids
  if len(entries) not in (n, n + DUPLICATED_LOGPROBS):  # past 50 tokens the tail n entries are the right ones
    return output_ids
  ids = [e[1] if isinstance(e, (list, tuple)) and len(e) >= 2 and _is_int(e[1]) else None for e in entries[-n:]]
  it = iter(ids)
  if None in ids or not all(t in it for t in output_ids):  # not a subsequence: some other fault
    return output_ids
  count("output_ids_restored")
  return ids


def _parse_logprobs(entries: Any, output_ids: list, rid: str, count: Callable[[str], None]) -> tuple[float, ...]:
  n, d = len(output_ids), DUPLICATED_LOGPROBS
  if isinstance(entries, list) and n > d and len(entries) == n + d:
    # sglang-jax: the first d entries again in front of the n right ones (reference §2.6).
    if entries[:d] != entries[d : 2 * d]:
      count("logprobs_dup_rejected")
      raise ValueError(f"rid {rid}: {len(entries)} logprob entries for {n} tokens and the leading {d} are no repeat")
    count("logprobs_dup_repaired")
    entries = entries[d:]
  if not isinstance(entries, list) or len(entries) != n:
    got = len(entries) if isinstance(entries, list) else type(entries).__name__
    raise ValueError(f"rid {rid}: output_token_logprobs has {got} entries for {n} output_ids")
  logprobs = []
  for i, (entry, token) in enumerate(zip(entries, output_ids)):
    # Each entry is [logprob, token_id, text-or-null] (reference §2.1).
    if not isinstance(entry, (list, tuple)) or len(entry) < 2:
      raise ValueError(f"rid {rid}: output_token_logprobs[{i}] must be [logprob, token_id, text], got {entry!r}")
    lp, tid = entry[0], entry[1]
    if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-4:
      raise ValueError(f"rid {rid}: output_token_logprobs[{i}][0]={lp!r} is not a finite logprob <= 0")
    if tid != token:
      raise ValueError(f"rid {rid}: output_token_logprobs[{i}] token {tid!r} != output_ids[{i}]={token}")
    logprobs.append(float(min(lp, 0.0)))
  return tuple(logprobs)


def _parse_version(raw: Any, rid: str) -> int:
  """SGLang reports weight_version as a string ("default" before any update); we push integers >= 1."""
  if raw is None:
    return UNKNOWN_VERSION
  if raw == "default":
    return 0
  if _is_int(raw) and raw >= 0:
    return raw
  if isinstance(raw, str) and raw.isdigit():
    return int(raw)
  raise ValueError(f"rid {rid}: meta_info.weight_version={raw!r} is not a version this client pushed")


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)
