"""A pool of environment service processes on this machine, with per-environment timeouts and restarts.

`EnvPool(config).episode()` returns an `Environment` bound to the least-loaded worker. A reset or step
that fails (timeout, dropped connection, 5xx) restarts that worker process and ends the episode with
reward 0 and `info["env_error"]`; the rollout keeps going. On a cluster the same role is played by
Kubernetes (deploy/k8s: a Deployment of env services behind a Service, autoscaled); point
`RemoteEnvironment` at the Service URL instead of using this pool.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Mapping

from k2jax.agentic.envs.base import Environment, StepResult
from k2jax.agentic.envs.client import RemoteEnvConfig, RemoteEnvironment
from k2jax.transport import ServiceError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EnvPoolConfig:
  env: str = "sim_tools"
  num_workers: int = 2
  reset_timeout_s: float = 60.0
  step_timeout_s: float = 60.0
  startup_timeout_s: float = 60.0
  max_restarts: int = 20  # per pool; beyond this a failure is raised, not hidden
  egress_allow: tuple[str, ...] = ()


class _Worker:
  def __init__(self, config: EnvPoolConfig, index: int):
    self.config, self.index, self.active = config, index, 0
    self.proc: subprocess.Popen | None = None
    self.url = ""

  def start(self) -> None:
    self.spawn()
    self.wait_ready()

  def spawn(self) -> None:
    cmd = [
      sys.executable,
      "-m",
      "k2jax.agentic.envs",
      f"--env={self.config.env}",
      "--port=0",
      f"--egress_allow={','.join(self.config.egress_allow)}",
      "--exit_on_stdin_eof",  # its stdin is our pipe: it exits when this process dies, however it dies
    ]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    # Everything the worker puts in temp dirs (sandbox runs, SWE workspaces) lives under one dir of its
    # own, deleted by stop(): a killed worker leaves nothing behind. Searchable by the sandbox uid.
    self.tmp = tempfile.mkdtemp(prefix="k2jax-envworker-")
    os.chmod(self.tmp, 0o711)
    env["TMPDIR"] = self.tmp
    self.proc = subprocess.Popen(
      cmd,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      text=True,
      start_new_session=True,
      env=env,
    )

  def wait_ready(self) -> None:
    deadline = time.monotonic() + self.config.startup_timeout_s
    line = ""
    while True:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
        line = f"(no READY line after {self.config.startup_timeout_s}s)"
        break
      line = self.proc.stdout.readline()
      if line.startswith("READY ") or not line:
        break
    if not line.startswith("READY "):
      self.stop()
      raise ServiceError(f"env worker {self.index} ({' '.join(self.proc.args)}) did not start: last line {line!r}")
    self.url = f"http://127.0.0.1:{int(line.split()[1])}"

  def stop(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      self.proc.wait()
    if self.proc is not None:
      for pipe in (self.proc.stdin, self.proc.stdout):
        pipe.close()
    if getattr(self, "tmp", None):
      shutil.rmtree(self.tmp, ignore_errors=True)


class EnvPool:
  def __init__(self, config: EnvPoolConfig):
    if config.num_workers < 1:
      raise ValueError(f"EnvPoolConfig.num_workers must be >= 1, got {config.num_workers}")
    self.config = config
    self._lock = threading.Lock()
    self._workers = [_Worker(config, i) for i in range(config.num_workers)]
    for w in self._workers:  # start all, then wait: start-up (imports) runs in parallel
      w.spawn()
    for w in self._workers:
      w.wait_ready()
    self.restarts = 0

  def episode(self) -> "PooledEnvironment":
    with self._lock:
      worker = min(self._workers, key=lambda w: w.active)
      worker.active += 1
    return PooledEnvironment(self, worker)

  def worker_pids(self) -> list[int]:
    return [w.proc.pid for w in self._workers]

  def restart(self, worker: _Worker, generation_url: str) -> None:
    """Restarts `worker` unless another episode already did (its URL changed since)."""
    with self._lock:
      if worker.url != generation_url:
        return
      if self.restarts >= self.config.max_restarts:
        raise ServiceError(f"env pool: {self.restarts} restarts reached max_restarts; giving up")
      self.restarts += 1
      log.warning("restarting env worker %d (%s)", worker.index, worker.url)
      worker.stop()
      worker.start()

  def release(self, worker: _Worker) -> None:
    with self._lock:
      worker.active -= 1

  def close(self) -> None:
    for w in self._workers:
      w.stop()

  def __enter__(self) -> "EnvPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class PooledEnvironment(Environment):
  """One episode on a pool worker; environment failures end the episode instead of raising."""

  def __init__(self, pool: EnvPool, worker: _Worker):
    self._pool, self._worker = pool, worker
    self._url = worker.url
    self._remote = RemoteEnvironment(
      RemoteEnvConfig(worker.url, pool.config.reset_timeout_s, pool.config.step_timeout_s)
    )
    self._released = False

  def reset(self, task: Mapping[str, Any]) -> dict:
    try:
      return self._remote.reset(task)
    except ServiceError as e:
      if "HTTP 400" in str(e):  # the task itself is bad: not the worker's fault
        raise ValueError(str(e)) from None
      self._fail(e)
      raise

  def step(self, action: Mapping[str, Any]) -> StepResult:
    try:
      result = self._remote.step(action)
    except ServiceError as e:
      self._fail(e)
      return StepResult({"messages": []}, 0.0, True, {"env_error": str(e)[:500]})
    if result.done:
      self.close()
    return result

  def close(self) -> None:
    if not self._released:
      self._remote.close()
      self._released = True
      self._pool.release(self._worker)

  def _fail(self, error: Exception) -> None:
    log.warning("env episode failed on %s: %s", self._url, error)
    self._remote.episode_id = None
    self._pool.restart(self._worker, self._url)
    self.close()
