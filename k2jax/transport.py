"""JSON over HTTP with timeouts, bounded retries, jittered backoff and kept-alive connections, shared by the
engine and environment clients.

Built on the standard library (`http.client`): `requests` is only a test extra of k2jax and the calls here
are plain JSON POST/GET, so a third-party client would add a runtime dependency for no gain. Every error
message names the URL. Calls are blocking and thread-safe: each thread keeps one kept-alive connection per
host (`_Connections`), so the threaded rollout manager's hundreds of threads do not each pay a TCP handshake
per request, nor leave a TIME_WAIT socket behind per request. A kept-alive connection the server closed
while idle is found (readable at EOF) and replaced before use. Retry sleeps are jittered (`RetryPolicy.jitter`): threads that failed together (a server restart)
would otherwise retry together, in step, at every backoff. Redirects are not followed (no service here
sends one): a 3xx is a `RequestRejected` naming its Location.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import select
import socket
import threading
import time
import urllib.parse
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
  """Attempts = 1 + max_retries. Before retry k (0-based) the ceiling is d = min(initial * multiplier**k, max)
  and the sleep is drawn uniformly from [d * (1 - jitter), d]: jitter 1 is "full jitter" (AWS Architecture
  Blog, "Exponential Backoff And Jitter", 2015: the least total work for clients contending at once)."""

  max_retries: int = 3
  backoff_initial_s: float = 0.5
  backoff_max_s: float = 8.0
  backoff_multiplier: float = 2.0
  retry_invalid_responses: bool = True  # e.g. sporadic logprob-length bugs (reference §2.6)
  jitter: float = 1.0  # the fraction of each ceiling drawn at random (0: every client sleeps the same)

  def __post_init__(self):
    if self.max_retries < 0 or self.backoff_initial_s < 0 or self.backoff_multiplier < 1:
      raise ValueError(f"invalid RetryPolicy {self}")
    if not 0.0 <= self.jitter <= 1.0:
      raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")

  def delay_s(self, retry_index: int) -> float:
    """The ceiling of the sleep before retry `retry_index` (0-based)."""
    return min(self.backoff_initial_s * self.backoff_multiplier**retry_index, self.backoff_max_s)

  def sleep_s(self, retry_index: int, u: float) -> float:
    """The sleep before retry `retry_index` for a uniform draw `u` in [0, 1)."""
    return self.delay_s(retry_index) * (1.0 - self.jitter * u)


_RNG = random.Random()  # seeded from os.urandom: each process (and thread, by draw order) sleeps differently


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
      time.sleep(retry.sleep_s(attempt - 1, _RNG.random()))
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
  parts = urllib.parse.urlsplit(url)
  if parts.scheme not in ("http", "https") or not parts.hostname:
    raise RequestRejected(f"{url}: not an http(s) URL")
  path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
  all_headers = {"Content-Type": "application/json", "Host": parts.netloc, **headers}
  try:
    status, reason, location, body = _CONNECTIONS.request(
      parts, "GET" if data is None else "POST", path, data, all_headers, timeout_s
    )
  except (http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError, OSError) as e:
    raise _Transient() from e
  if 300 <= status < 400:
    raise RequestRejected(f"{url}: HTTP {status} {reason}: redirect to {location!r} not followed")
  if status >= 500 or status == 429:
    raise _Transient() from ServiceError(f"{url}: HTTP {status}: {body[:300]!r}")
  if status >= 400:
    raise RequestRejected(f"{url}: HTTP {status}: {body[:300]!r}")
  return body


class _Connections(threading.local):
  """Each thread's kept-alive connections, one per (scheme, host, port)."""

  def __init__(self):
    self.open: dict[tuple[str, str], http.client.HTTPConnection] = {}

  def request(self, parts, method, path, data, headers, timeout_s) -> tuple[int, str, str | None, bytes]:
    key = (parts.scheme, parts.netloc)
    conn = self.open.pop(key, None)
    if conn is not None and (conn.sock is None or select.select([conn.sock], [], [], 0)[0]):
      conn.close()  # readable while idle: the server closed it (EOF), as urllib3's is_connection_dropped checks
      conn = None
    if conn is None:
      cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
      conn = cls(parts.hostname, parts.port, timeout=timeout_s)
    try:
      if conn.sock is not None:
        conn.sock.settimeout(timeout_s)
      conn.request(method, path, body=data, headers=headers)
      resp = conn.getresponse()
      body = resp.read()
    except BaseException:
      conn.close()
      raise
    if resp.will_close:
      conn.close()
    else:
      self.open[key] = conn
    return resp.status, resp.reason, resp.getheader("Location"), body


_CONNECTIONS = _Connections()
