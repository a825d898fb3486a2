"""JSON over HTTP with timeouts, bounded retries and exponential backoff, shared by engine and judge clients.

Built on the standard library (`urllib.request`): `requests` is only a test extra of k2jax and the calls
here are plain JSON POST/GET, so a third-party client would add a runtime dependency for no gain.
Every error message names the URL. Calls are blocking and thread-safe (one connection per call), which
is what the threaded rollout manager needs.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class ServiceError(RuntimeError):
  """A remote call failed for good (after retries where they apply)."""


class ServiceUnreachable(ServiceError):
  """Connection refused, reset, dropped, or timed out on every attempt."""


class InvalidResponse(ServiceError):
  """The service answered, but with malformed or inconsistent content."""


class RequestRejected(ServiceError):
  """The service answered with a 4xx status: retrying the same request cannot help."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
  """Attempts = 1 + max_retries; sleep before retry k (0-based) = min(initial * multiplier**k, max)."""

  max_retries: int = 3
  backoff_initial_s: float = 0.5
  backoff_max_s: float = 8.0
  backoff_multiplier: float = 2.0
  retry_invalid_responses: bool = True  # e.g. sporadic logprob-length bugs (reference §2.6)

  def __post_init__(self):
    if self.max_retries < 0 or self.backoff_initial_s < 0 or self.backoff_multiplier < 1:
      raise ValueError(f"invalid RetryPolicy {self}")

  def delay_s(self, retry_index: int) -> float:
    return min(self.backoff_initial_s * self.backoff_multiplier**retry_index, self.backoff_max_s)


def call_json(
  url: str,
  payload: Any | None,
  *,
  timeout_s: float,
  retry: RetryPolicy,
  validate: Callable[[Any], T] = lambda x: x,
  headers: dict[str, str] | None = None,
  before_retry: Callable[[], None] | None = None,
  parse_json: bool = True,
) -> T:
  """POSTs `payload` as JSON (GET when None), parses the JSON answer and returns `validate(answer)`.

  `validate` raises ValueError/TypeError/KeyError on bad content; with parse_json=False it gets the raw
  bytes (for endpoints answering plain text). `before_retry` runs before each retry
  (e.g. abort the timed-out request so the server does not keep generating it).
  """
  last: Exception | None = None
  for attempt in range(retry.max_retries + 1):
    if attempt:
      if before_retry is not None:
        before_retry()
      time.sleep(retry.delay_s(attempt - 1))
    try:
      body = _send(url, payload, timeout_s, headers or {})
    except _Transient as e:
      last = e.__cause__ or e
      continue
    try:
      return validate(json.loads(body) if parse_json else body)
    except (ValueError, TypeError, KeyError, IndexError) as e:
      last = InvalidResponse(f"{url}: invalid response: {e}; body starts {body[:200]!r}")
      if not retry.retry_invalid_responses:
        raise last from e
  attempts = retry.max_retries + 1
  if isinstance(last, InvalidResponse):
    raise InvalidResponse(f"{last} (after {attempts} attempts)")
  raise ServiceUnreachable(
    f"{url}: no valid answer after {attempts} attempts (timeout {timeout_s}s per attempt); last error: {last!r}"
  ) from last


class _Transient(Exception):
  """Connection-level failure or 5xx/429: worth retrying."""


def _send(url: str, payload: Any | None, timeout_s: float, headers: dict[str, str]) -> bytes:
  data = None if payload is None else json.dumps(payload).encode()
  req = urllib.request.Request(
    url, data=data, method="GET" if data is None else "POST", headers={"Content-Type": "application/json", **headers}
  )
  try:
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
      return resp.read()
  except urllib.error.HTTPError as e:
    detail = e.read()[:300]
    if e.code >= 500 or e.code == 429:
      raise _Transient() from ServiceError(f"{url}: HTTP {e.code}: {detail!r}")
    raise RequestRejected(f"{url}: HTTP {e.code}: {detail!r}") from None
  except (
    urllib.error.URLError,
    http.client.HTTPException,
    ConnectionError,
    socket.timeout,
    TimeoutError,
    OSError,
  ) as e:
    raise _Transient() from e
