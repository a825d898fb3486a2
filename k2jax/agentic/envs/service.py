"""Environments as HTTP services, so heavy environments run in their own processes or machines and
scale separately from the trainer and the engine (K2 §3.3.4).

Routes (JSON bodies; errors answer 4xx with `{"error": {"message", "param"}}` naming the field):
  POST /reset {"task": {...}}                   -> {"episode_id", "observation"}
  POST /step  {"episode_id", "action": {...}}   -> {"observation", "reward", "done", "info"}
  POST /close {"episode_id"}                    -> {"closed": bool}
  GET  /health                                  -> {"env", "episodes", "running_steps"}
One process serves many episodes (one `Environment` instance each, steps of one episode serialised),
all sharing one `Guard` (rate limits and the concurrency cap are per process). Limits, each answered
with 429 so the caller backs off: at most `max_episodes` live episodes (idle ones expire after
`episode_ttl_s`) and at most `max_running_steps` steps (each may run a sandbox) at once. FastAPI on
uvicorn like k2jax.serve (`k2jax.httpservice`); steps run on worker threads.

  python -m k2jax.agentic.envs --env=sim_tools --port=8080 [--egress_allow=host:port,...]
prints `READY <port>` once serving (the pool reads it). With no --egress_allow the process has no
outbound network at all (`install_egress_hook`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any, Callable

import fastapi

from k2jax import httpservice
from k2jax.agentic.guards import Guard, GuardConfig
from k2jax.agentic.envs.base import Environment
from k2jax.httpservice import HttpError, HttpLimits

log = logging.getLogger(__name__)


def env_factories() -> dict[str, Callable[[Guard], Environment]]:
  """Environments a service can host, by name (imported lazily: the code env pulls the sandbox)."""
  from k2jax.agentic.envs.code import CodeEnv
  from k2jax.agentic.envs.simulated import SimToolsEnv
  from k2jax.agentic.envs.swe import SweEnv

  return {"sim_tools": lambda g: SimToolsEnv(g), "code": lambda g: CodeEnv(g), "swe": lambda g: SweEnv(g)}


class ResetBody(httpservice.StrictBody):
  task: Any = None


class StepBody(httpservice.StrictBody):
  episode_id: str
  action: dict


class CloseBody(httpservice.StrictBody):
  episode_id: Any = None


class EnvService:
  """Hosts episodes of one environment kind over HTTP."""

  def __init__(
    self,
    env: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    guard: Guard | None = None,
    episode_ttl_s: float = 600.0,
    max_episodes: int = 4096,
    max_running_steps: int = 64,
    limits: HttpLimits = HttpLimits(),
  ):
    factories = env_factories()
    if env not in factories:
      raise ValueError(f"unknown environment {env!r}; known: {sorted(factories)}")
    self.env_name, self._make = env, factories[env]
    self.guard = guard or Guard(GuardConfig())
    self.episode_ttl_s, self.max_episodes, self.max_running_steps = episode_ttl_s, max_episodes, max_running_steps
    self._episodes: dict[str, tuple[Environment, threading.Lock, list[float]]] = {}
    self._lock = threading.Lock()
    self._running = 0
    app = httpservice.make_app(f"k2jax env {env}", limits)
    app.post("/reset")(self._reset)
    app.post("/step")(self._step)
    app.post("/close")(self._close)
    app.get("/health")(self._health)
    self._http = httpservice.Service(app, host=host, port=port, limits=limits, name="env-http")

  @property
  def port(self) -> int:
    return self._http.port

  @property
  def url(self) -> str:
    return self._http.url

  def start(self) -> "EnvService":
    self._http.start()
    return self

  def serve_forever(self) -> None:
    self._http.serve_forever()

  def close(self) -> None:
    self._http.close()
    with self._lock:
      ids = list(self._episodes)
    for k in ids:
      self._drop(k)

  def num_episodes(self) -> int:
    with self._lock:
      return len(self._episodes)

  # ---- routes ------------------------------------------------------------------------------------
  async def _health(self):
    self._expire()
    with self._lock:
      return {"env": self.env_name, "episodes": len(self._episodes), "running_steps": self._running}

  async def _reset(self, request: fastapi.Request):
    body = httpservice.validate(ResetBody, await httpservice.read_json(request))
    self._expire()
    with self._lock:
      if len(self._episodes) >= self.max_episodes:
        raise HttpError(429, f"{len(self._episodes)} live episodes: the cap is {self.max_episodes}; close some")
    env = self._make(self.guard)
    try:
      obs = await asyncio.to_thread(env.reset, body.task)
    except (ValueError, KeyError, TypeError) as e:
      env.close()
      raise HttpError(400, f"task: {e}", "task") from None
    episode_id = uuid.uuid4().hex
    with self._lock:
      self._episodes[episode_id] = (env, threading.Lock(), [time.monotonic()])
    return {"episode_id": episode_id, "observation": obs}

  async def _step(self, request: fastapi.Request):
    body = httpservice.validate(StepBody, await httpservice.read_json(request))
    env, lock, seen = self._get(body.episode_id)
    with self._lock:
      if self._running >= self.max_running_steps:
        raise HttpError(429, f"{self._running} steps running: the cap is {self.max_running_steps}; retry later")
      self._running += 1
    try:
      result = await asyncio.to_thread(self._step_locked, env, lock, seen, body.action)
    finally:
      with self._lock:
        self._running -= 1
    if result.done:
      self._drop(body.episode_id)
    return result.to_json()

  async def _close(self, request: fastapi.Request):
    body = httpservice.validate(CloseBody, await httpservice.read_json(request) or {})
    return {"closed": self._drop(body.episode_id)}

  # ---- episodes ----------------------------------------------------------------------------------
  @staticmethod
  def _step_locked(env: Environment, lock: threading.Lock, seen: list[float], action: dict):
    with lock:
      seen[0] = time.monotonic()
      result = env.step(action)
      seen[0] = time.monotonic()
      return result

  def _get(self, episode_id: str):
    with self._lock:
      entry = self._episodes.get(episode_id)
    if entry is None:
      raise HttpError(400, f"episode_id: unknown, finished or expired episode {episode_id!r}", "episode_id")
    return entry

  def _drop(self, episode_id: Any) -> bool:
    with self._lock:
      entry = self._episodes.pop(episode_id, None) if isinstance(episode_id, str) else None
    if entry is not None:
      entry[0].close()
    return entry is not None

  def _expire(self) -> None:
    now = time.monotonic()
    with self._lock:
      old = [
        k
        for k, (_, lock, seen) in self._episodes.items()
        if now - seen[0] > self.episode_ttl_s and not lock.locked()  # a running step is not idle
      ]
    for k in old:
      self._drop(k)
