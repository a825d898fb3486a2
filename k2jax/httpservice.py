"""One HTTP stack for k2jax's services (the inference server, environment services): FastAPI on uvicorn,
what SGLang itself serves with.

What every service gets from here, so that no route re-implements it:
  - request bodies read with a size limit (413) and a read timeout (408: a half-sent body holds a
    coroutine, never a thread, and only for `read_timeout_s`), parsed as JSON with clear 400s (bad JSON,
    NaN/Infinity, nesting too deep), then validated by a pydantic model whose errors name the field (400);
  - one error envelope, SGLang's and OpenAI's: `{"error": {"message", "type", "param", "code"}}`;
  - Bearer-token auth (`api_key`, SGLang's `--api-key`) as a dependency for the routes that change state;
  - a real listen backlog, and a server that runs on a background thread (tests, the embedded engine)
    or in the foreground (`launch/serve.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import socket
import threading
from typing import Any, TypeVar

import fastapi
import pydantic
import uvicorn
from fastapi import responses

log = logging.getLogger(__name__)

M = TypeVar("M", bound=pydantic.BaseModel)


@dataclasses.dataclass(frozen=True)
class HttpLimits:
  max_body_bytes: int = 16 << 20  # a 64k-token prompt as JSON ids is ~0.5 MB; 16 MB leaves room for batches
  read_timeout_s: float = 30.0  # the whole body must arrive within this
  backlog: int = 2048  # listen backlog: hundreds of rollout threads connect at once
  api_key: str | None = None  # Bearer token required on state-changing routes when set


class HttpError(Exception):
  """An error answered with `status` and the standard envelope; `field` names the offending field."""

  def __init__(self, status: int, message: str, field: str | None = None):
    super().__init__(message)
    self.status, self.message, self.field = status, message, field


_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError"}


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
  limits: HttpLimits = request.app.state.limits
  declared = request.headers.get("content-length")
  if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
    raise HttpError(413, f"request body of {declared} bytes exceeds the limit of {limits.max_body_bytes} bytes")

  async def receive() -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > limits.max_body_bytes:
        raise HttpError(413, f"request body exceeds the limit of {limits.max_body_bytes} bytes")
      chunks.append(chunk)
    return b"".join(chunks)

  try:
    raw = await asyncio.wait_for(receive(), limits.read_timeout_s)
  except TimeoutError:
    raise HttpError(408, f"request body not received within {limits.read_timeout_s} s") from None
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
  """Dependency for state-changing routes: `Authorization: Bearer <api_key>` when the app has a key."""
  key = request.app.state.limits.api_key
  if not key:
    return
  given = request.headers.get("authorization", "")
  if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
    raise HttpError(401, "missing or wrong API key (send `Authorization: Bearer <key>`)")


class Service:
  """Runs an ASGI app with uvicorn on host:port (0 = a free port), in the foreground or on a thread."""

  def __init__(self, app: fastapi.FastAPI, *, host: str, port: int, limits: HttpLimits, name: str):
    self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._sock.bind((host, port))
    self._sock.listen(limits.backlog)
    config = uvicorn.Config(
      app,
      log_level="warning",
      access_log=False,
      backlog=limits.backlog,
      timeout_keep_alive=max(5, int(limits.read_timeout_s)),
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


def _reject_constant(name: str):
  raise ValueError(f"{name} is not a JSON number")
