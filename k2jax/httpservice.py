"""One HTTP stack for k2jax's services (the inference server, environment services): FastAPI on uvicorn,
what SGLang itself serves with.

What every service gets from here, so that no route re-implements it:
  - request bodies read with a size limit (413) and a read timeout (408: a half-sent body holds a
    coroutine, never a thread, and only for `read_timeout_s`), parsed as JSON with clear 400s (bad JSON,
    NaN/Infinity, nesting too deep), then validated by a pydantic model whose errors name the field (400);
  - one error envelope, SGLang's and OpenAI's: `{"error": {"message", "type", "param", "code"}}`;
  - Bearer-token auth (`api_key`, SGLang's `--api-key`: one key or several) as a dependency for routes;
  - connections that cannot starve the process of file descriptors (`ConnectionGuard`): a header
    timeout, an idle keep-alive timeout and a connection limit below the fd limit;
  - a real listen backlog, and a server that runs on a background thread (tests, the embedded engine)
    or in the foreground (`launch/serve.py`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hmac
import json
import logging
import resource
import socket
import threading
from typing import Any, TypeVar

import fastapi
import pydantic
import uvicorn
from fastapi import responses
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

M = TypeVar("M", bound=pydantic.BaseModel)


@dataclasses.dataclass(frozen=True)
class HttpLimits:
  max_body_bytes: int = 16 << 20  # a 64k-token prompt as JSON ids is ~0.5 MB; 16 MB leaves room for batches
  read_timeout_s: float = 30.0  # the whole body must arrive within this
  backlog: int = 2048  # listen backlog: hundreds of rollout threads connect at once
  # Bearer token(s) a client must send (`Authorization: Bearer <key>`) on the routes that require one; a
  # tuple gives each client its own key (the server tells clients apart by key). None: no key.
  api_key: str | tuple[str, ...] | None = None
  header_timeout_s: float = 10.0  # a request's headers must arrive within this of its first byte
  keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this (uvicorn's default)
  # Open connections at most; None: the fd soft limit less max(128, 1/8) for files, sockets and XLA.
  # Never above that: a server out of fds answers nobody (the probe: 20,200 idle connections, empty replies).
  max_connections: int | None = None

  def __post_init__(self):
    keys = self.api_keys()
    if any(not isinstance(k, str) or not k for k in keys):
      raise ValueError("api_key: an empty key would turn authentication off; give a non-empty key, or none at all")
    if len(set(keys)) != len(keys):
      raise ValueError("api_key: the same key is given twice; each client's key must be distinct")

  def api_keys(self) -> tuple[str, ...]:
    return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())

  def connection_limit(self) -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = soft - max(128, soft // 8) if soft != resource.RLIM_INFINITY else 1 << 20
    return max(1, min(self.max_connections or ceiling, ceiling))


class HttpError(Exception):
  """An error answered with `status` and the standard envelope; `field` names the offending field."""

  def __init__(self, status: int, message: str, field: str | None = None):
    super().__init__(message)
    self.status, self.message, self.field = status, message, field


_TYPES = {
  400: "BadRequestError",
  401: "AuthenticationError",
  403: "PermissionDeniedError",
  404: "NotFoundError",
  409: "ConflictError",
  429: "RateLimitError",
}


def error_body(status: int, message: str, field: str | None = None) -> dict:
  kind = _TYPES.get(status, "ServerError" if status >= 500 else "RequestError")
  return {"error": {"message": message, "type": kind, "param": field, "code": status}}


def error_response(status: int, message: str, field: str | None = None) -> responses.JSONResponse:
  return responses.JSONResponse(error_body(status, message, field), status_code=status)


def make_app(title: str, limits: HttpLimits, *, field_errors: tuple[type[Exception], ...] = ()) -> fastapi.FastAPI:
  """A FastAPI app with k2jax's error handling. Exceptions in `field_errors` carry `.field` and answer 400."""
  app = fastapi.FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
  app.state.limits = limits

  @app.exception_handler(HttpError)
  async def _http_error(request, e: HttpError):
    return error_response(e.status, e.message, e.field)

  for kind in field_errors:

    @app.exception_handler(kind)
    async def _field_error(request, e):
      return error_response(400, str(e), getattr(e, "field", None))

  @app.exception_handler(404)
  async def _not_found(request, e):
    return error_response(404, f"no route {request.method} {request.url.path}")

  @app.exception_handler(405)
  async def _not_allowed(request, e):
    return error_response(405, f"{request.url.path} does not answer {request.method}")

  @app.exception_handler(Exception)
  async def _crash(request, e):  # report, never drop the connection silently
    log.exception("%s failed", request.url.path)
    return error_response(500, f"{type(e).__name__}: {e}")

  return app


async def read_json(request: fastapi.Request) -> Any:
  """The request body as JSON (None when empty), within the app's size, time and depth limits."""
  return parse_json(await read_body(request))


async def read_body(request: fastapi.Request) -> bytes:
  """The raw request body, within the app's size (413) and time (408) limits."""
  limits: HttpLimits = request.app.state.limits
  declared = request.headers.get("content-length")
  if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
    raise HttpError(
      413, f"request body of {declared} bytes exceeds the cap max_body_bytes={limits.max_body_bytes} bytes"
    )

  async def receive() -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > limits.max_body_bytes:
        raise HttpError(413, f"request body exceeds the cap max_body_bytes={limits.max_body_bytes} bytes")
      chunks.append(chunk)
    return b"".join(chunks)

  try:
    return await asyncio.wait_for(receive(), limits.read_timeout_s)
  except TimeoutError:
    raise HttpError(408, f"request body not received within {limits.read_timeout_s} s") from None


def parse_json(raw: bytes) -> Any:
  """A body as JSON (None when empty); 400 naming the body for bad JSON, NaN/Infinity or deep nesting."""
  if not raw.strip():
    return None
  try:
    return json.loads(raw, parse_constant=_reject_constant)
  except RecursionError:  # the C decoder recurses once per level; 100k-deep arrays end here
    raise HttpError(400, "not valid JSON: nested too deeply", "body") from None
  except ValueError as e:
    raise HttpError(400, f"not valid JSON: {e}", "body") from None


class StrictBody(pydantic.BaseModel):
  """Strict JSON bodies: no coercion (`"1"` is not 1, `true` is not 1), no NaN/Infinity, no unknown keys."""

  model_config = pydantic.ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def validate(model: type[M], data: Any, prefix: str = "") -> M:
  """`data` as `model`, or a 400 naming the first offending field (`sampling_params[1].top_p`)."""
  try:
    return model.model_validate(data)
  except pydantic.ValidationError as e:
    err = e.errors()[0]
    field = error_field(prefix, err["loc"])
    given = err.get("input")
    shown = "" if isinstance(given, dict) or err["type"] == "missing" else f", got {str(given)[:80]}"
    raise HttpError(400, f"{field}: {err['msg']}{shown}", field) from None


def error_field(prefix: str, loc: tuple) -> str:
  """The dotted field name of a pydantic error location, without its union-branch tags."""
  field = prefix
  for part in loc:
    if isinstance(part, int):
      field += f"[{part}]"
    elif "[" not in part and part not in ("str", "int", "float", "bool", "list", "dict", "none"):
      field += f".{part}" if field else part
  return field or "body"


def require_api_key(request: fastapi.Request) -> None:
  """Route dependency: `Authorization: Bearer <key>` with one of the app's keys, when it has any. Every key
  is compared in constant time (no early exit), so the reply's timing tells nothing about which is near;
  the matching key's index is left in `request.state.api_key_index` (the client's identity)."""
  keys = request.app.state.limits.api_keys()
  if not keys:
    return
  given = request.headers.get("authorization", "").encode()
  matched = [hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys]
  if not any(matched):
    raise HttpError(401, "missing or wrong API key (send `Authorization: Bearer <key>`)")
  request.state.api_key_index = matched.index(True)


class Service:
  """Runs an ASGI app with uvicorn on host:port (0 = a free port), in the foreground or on a thread."""

  def __init__(self, app: fastapi.FastAPI, *, host: str, port: int, limits: HttpLimits, name: str):
    self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._sock.bind((host, port))
    self._sock.listen(limits.backlog)
    self.guard = ConnectionGuard(limits.connection_limit(), limits.header_timeout_s)
    config = uvicorn.Config(
      app,
      http=functools.partial(_GuardedH11Protocol, guard=self.guard),
      log_level="warning",
      access_log=False,
      backlog=limits.backlog,
      timeout_keep_alive=limits.keep_alive_timeout_s,
      h11_max_incomplete_event_size=64 * 1024,  # headers only; bodies are limited by read_json
    )
    self._server = uvicorn.Server(config)
    self._thread: threading.Thread | None = None
    self._name = name

  @property
  def host(self) -> str:
    return self._sock.getsockname()[0]

  @property
  def port(self) -> int:
    return self._sock.getsockname()[1]

  @property
  def url(self) -> str:
    host = f"[{self.host}]" if ":" in self.host else self.host
    return f"http://{host}:{self.port}"

  def start(self) -> "Service":
    self._thread = threading.Thread(target=self.serve_forever, daemon=True, name=self._name)
    self._thread.start()
    while not self._server.started and self._thread.is_alive():
      self._thread.join(0.01)
    if not self._server.started:
      raise RuntimeError(f"{self._name}: the HTTP server did not start on {self.url}")
    return self

  def serve_forever(self) -> None:
    self._server.run(sockets=[self._sock])

  def close(self) -> None:
    self._server.should_exit = True
    if self._thread is not None:
      self._thread.join(timeout=30)
    self._sock.close()


class ConnectionGuard:
  """Bounds the connections that wait on their client, which cost an fd each and nothing to send.

  uvicorn 0.54 has no header-read timeout (its keep-alive timer starts only after a response, and any
  byte cancels it), and `limit_concurrency` answers 503 to requests but still accepts and holds every
  connection. So: each request's headers must arrive within `header_timeout_s` of the connection (or,
  on a kept-alive one, of the request's first byte); and at `limit` open connections a new one evicts
  the oldest that is waiting for headers, else the oldest idle keep-alive one, else it is closed at
  once. A client that sends its request promptly is never the oldest waiting one, so a flood of
  silent connections cannot keep it out, and the fds in use stay below the process's limit.
  """

  def __init__(self, limit: int, header_timeout_s: float):
    self.limit, self.header_timeout_s = limit, header_timeout_s
    self.open = 0
    self.waiting: collections.OrderedDict[_GuardedH11Protocol, None] = collections.OrderedDict()
    self.idle: collections.OrderedDict[_GuardedH11Protocol, None] = collections.OrderedDict()
    self.evicted = self.timed_out = self.refused = 0  # counters, for tests and the benchmark

  def admit(self, conn: "_GuardedH11Protocol") -> bool:
    self.open += 1
    if self.open > self.limit:
      queue = self.waiting or self.idle
      if not queue:
        self.refused += 1
        return False
      victim, _ = queue.popitem(last=False)
      self.evicted += 1
      victim.drop()
    return True


class _GuardedH11Protocol(H11Protocol):
  """uvicorn's h11 protocol under a `ConnectionGuard`: a connection is waiting (for a request's
  headers, timed), busy (a request in flight, bounded by the app's own timeouts) or idle (kept alive
  between requests, closed by uvicorn's keep-alive timer)."""

  def __init__(self, *args, guard: ConnectionGuard, **kwargs):
    super().__init__(*args, **kwargs)
    self.guard = guard
    self._header_timer: asyncio.TimerHandle | None = None
    self._counted = False

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    self._counted = True
    if not self.guard.admit(self):
      transport.abort()
      return
    self._wait_for_headers()

  def connection_lost(self, exc) -> None:
    self._forget()
    if self._counted:
      self.guard.open -= 1
      self._counted = False
    super().connection_lost(exc)

  def data_received(self, data: bytes) -> None:
    super().data_received(data)
    if self._busy():
      self._forget()
    elif self in self.guard.idle:  # a kept-alive connection began its next request
      self._wait_for_headers()

  def on_response_complete(self) -> None:
    super().on_response_complete()
    if not self.transport.is_closing() and not self._busy():
      self._forget()
      self.guard.idle[self] = None

  def drop(self) -> None:
    """Closes this connection now (evicted, or its headers are late); no request of it is in flight."""
    self._forget()
    if not self.transport.is_closing():
      self.transport.abort()  # no lingering in FIN_WAIT holding the fd

  def _busy(self) -> bool:
    return self.cycle is not None and not self.cycle.response_complete

  def _wait_for_headers(self) -> None:
    self._forget()
    self.guard.waiting[self] = None
    self._header_timer = self.loop.call_later(self.guard.header_timeout_s, self._headers_late)

  def _headers_late(self) -> None:
    self._header_timer = None
    if self in self.guard.waiting:
      self.guard.timed_out += 1
      self.drop()

  def _forget(self) -> None:
    self.guard.waiting.pop(self, None)
    self.guard.idle.pop(self, None)
    if self._header_timer is not None:
      self._header_timer.cancel()
      self._header_timer = None


def _reject_constant(name: str):
  raise ValueError(f"{name} is not a JSON number")
