"""Environments as HTTP services, so heavy environments run in their own processes or machines and
scale separately from the trainer and the engine (K2 §3.3.4).

Routes (JSON bodies; errors answer 4xx/5xx with `{"error": {"message", "param"}}` naming the field):
  POST /reset {"task": {...}}                   -> {"episode_id", "observation"}
  POST /step  {"episode_id", "action": {...}}   -> {"observation", "reward", "done", "info"}
  POST /close {"episode_id"}                    -> {"closed": bool}
  GET  /health                                  -> {"env", "episodes"}
One process serves many episodes (one `Environment` instance each, steps of one episode serialised),
all sharing one `Guard` (rate limits and the concurrency cap are per process). Episodes idle for
`episode_ttl_s` are dropped. Built on the standard library's ThreadingHTTPServer like k2jax.serve.

  python -m k2jax.agentic.envs --env=sim_tools --port=8080 [--egress_allow=host:port,...]
prints `READY <port>` once serving (the pool reads it). With no --egress_allow the process has no
outbound network at all (`install_egress_hook`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from typing import Any, Callable

from k2jax import jsonhttp
from k2jax.agentic.guards import Guard, GuardConfig
from k2jax.agentic.envs.base import Environment

log = logging.getLogger(__name__)


def env_factories() -> dict[str, Callable[[Guard], Environment]]:
  """Environments a service can host, by name (imported lazily: the code env pulls the sandbox)."""
  from k2jax.agentic.envs.code import CodeEnv
  from k2jax.agentic.envs.simulated import SimToolsEnv

  return {"sim_tools": lambda g: SimToolsEnv(g), "code": lambda g: CodeEnv(g)}


class _Server(ThreadingHTTPServer):
  daemon_threads = True
  request_queue_size = 1024  # listen backlog: hundreds of rollout threads connect at once (default 5)


class BadRequest(ValueError):
  def __init__(self, field: str, problem: str):
    super().__init__(f"{field}: {problem}")
    self.field = field


class EnvService:
  """Hosts episodes of one environment kind over HTTP."""

  def __init__(
    self, env: str, *, host: str = "127.0.0.1", port: int = 0, guard: Guard | None = None, episode_ttl_s: float = 600.0
  ):
    factories = env_factories()
    if env not in factories:
      raise ValueError(f"unknown environment {env!r}; known: {sorted(factories)}")
    self.env_name, self._make = env, factories[env]
    self.guard = guard or Guard(GuardConfig())
    self.episode_ttl_s = episode_ttl_s
    self._episodes: dict[str, tuple[Environment, threading.Lock, list[float]]] = {}
    self._lock = threading.Lock()
    self._httpd = _Server((host, port), _handler(self))

  @property
  def port(self) -> int:
    return self._httpd.server_address[1]

  @property
  def url(self) -> str:
    return f"http://{self._httpd.server_address[0]}:{self.port}"

  def start(self) -> "EnvService":
    threading.Thread(target=self._httpd.serve_forever, daemon=True, name="env-http").start()
    return self

  def serve_forever(self) -> None:
    self._httpd.serve_forever()

  def close(self) -> None:
    self._httpd.shutdown()
    self._httpd.server_close()

  def route(self, method: str, path: str, body: Any) -> Any:
    if path == "health":
      with self._lock:
        return {"env": self.env_name, "episodes": len(self._episodes)}
    if method != "POST" or path not in ("reset", "step", "close"):
      raise BadRequest("path", f"no route {method} /{path}")
    if not isinstance(body, dict):
      raise BadRequest("body", "must be a JSON object")
    return getattr(self, f"_{path}")(body)

  def _reset(self, body: dict) -> dict:
    self._expire()
    env = self._make(self.guard)
    try:
      obs = env.reset(body.get("task"))
    except (ValueError, KeyError, TypeError) as e:
      raise BadRequest("task", str(e)) from None
    episode_id = uuid.uuid4().hex
    with self._lock:
      self._episodes[episode_id] = (env, threading.Lock(), [time.monotonic()])
    return {"episode_id": episode_id, "observation": obs}

  def _step(self, body: dict) -> dict:
    env, lock, seen = self._get(body)
    action = body.get("action")
    if not isinstance(action, dict):
      raise BadRequest("action", "must be an assistant message object")
    with lock:
      seen[0] = time.monotonic()
      result = env.step(action)
    if result.done:
      self._drop(body["episode_id"])
    return result.to_json()

  def _close(self, body: dict) -> dict:
    return {"closed": self._drop(body.get("episode_id"))}

  def _get(self, body: dict):
    with self._lock:
      entry = self._episodes.get(body.get("episode_id"))
    if entry is None:
      raise BadRequest("episode_id", f"unknown or finished episode {body.get('episode_id')!r}")
    return entry

  def _drop(self, episode_id: Any) -> bool:
    with self._lock:
      entry = self._episodes.pop(episode_id, None)
    if entry is not None:
      entry[0].close()
    return entry is not None

  def _expire(self) -> None:
    now = time.monotonic()
    with self._lock:
      old = [k for k, (_, _, seen) in self._episodes.items() if now - seen[0] > self.episode_ttl_s]
    for k in old:
      self._drop(k)


def _handler(service: EnvService):
  def route(method, path, body):
    return 200, service.route(method, path, body)

  return jsonhttp.make_handler(
    route, bad_request=BadRequest, log=log, bad_request_body=lambda e: {"error": {"message": str(e), "param": e.field}}
  )
