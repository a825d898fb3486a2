"""One JSON-over-HTTP request handler for k2jax's services (inference server, environment services).

Built on the standard library's `http.server` (keep-alive HTTP/1.1, a thread per connection): the services
only need a few JSON routes, and this keeps them free of a web-framework dependency. `route(method, path,
body)` returns `(status, payload)`; a dict/list payload is sent as JSON, a str as text/plain. A
`bad_request` exception becomes a 400 with `bad_request_body(e)`; any other exception becomes a 500 that
names it (logged), so a bug never drops a connection silently.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

Route = Callable[[str, str, Any], tuple[int, Any]]


def make_handler(
  route: Route, *, bad_request: type[Exception], bad_request_body: Callable[[Exception], dict], log: logging.Logger
) -> type:
  """A BaseHTTPRequestHandler class answering GET/POST through `route`."""

  class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client (httpx) expects

    def log_message(self, fmt, *args):
      log.debug("%s " + fmt, self.address_string(), *args)

    def do_GET(self):
      self._handle("GET")

    def do_POST(self):
      self._handle("POST")

    def _handle(self, method: str):
      path = self.path.split("?", 1)[0].strip("/")
      try:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
          body = json.loads(raw) if raw.strip() else None
        except ValueError as e:
          raise bad_request("body", f"not valid JSON: {e}") from e
        status, payload = route(method, path, body)
      except bad_request as e:
        status, payload = 400, bad_request_body(e)
      except Exception as e:  # report, never drop the connection silently
        log.exception("/%s failed", path)
        status, payload = 500, {"error": {"message": f"{type(e).__name__}: {e}", "code": 500}}
      data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
      self.send_response(status)
      self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

  return Handler
