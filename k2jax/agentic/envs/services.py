"""The environment services a run talks to, by environment name: a given URL (a Kubernetes Service, a
service started by hand), or, when none is given, a local `EnvPool` started here (service processes on
free ports, stopped by `close()`). `factory(env)` gives the `Environment` factory for episodes of `env`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

from k2jax.agentic.envs.base import Environment
from k2jax.agentic.envs.client import RemoteEnvConfig, RemoteEnvironment
from k2jax.agentic.envs.pool import EnvPool, EnvPoolConfig


@dataclasses.dataclass(frozen=True)
class EnvServicesConfig:
  urls: tuple[tuple[str, str], ...] = ()  # (environment name, service root URL)
  local_workers: int = 1  # service processes started per environment that has no URL
  reset_timeout_s: float = 60.0
  step_timeout_s: float = 60.0
  startup_timeout_s: float = 120.0


def parse_urls(spec: str) -> tuple[tuple[str, str], ...]:
  """ "sim_tools=http://h:8080,code=http://h:8081" -> (("sim_tools", ...), ("code", ...))."""
  out = []
  for item in (x.strip() for x in spec.split(",") if x.strip()):
    name, sep, url = item.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
      raise ValueError(f"environment URL {item!r}: expected name=http://host:port")
    out.append((name.strip(), url.strip()))
  return tuple(out)


class EnvServices:
  def __init__(self, envs: Sequence[str], config: EnvServicesConfig = EnvServicesConfig()):
    from k2jax.agentic.envs.service import env_factories

    known = env_factories()
    urls = dict(config.urls)
    unknown = [e for e in list(envs) + list(urls) if e not in known]
    if unknown:
      raise ValueError(f"unknown environments {unknown}; known: {sorted(known)}")
    self.config = config
    self.pools: dict[str, EnvPool] = {}
    self._factories: dict[str, Callable[[], Environment]] = {}
    try:
      for env in envs:
        if env in urls:
          remote = RemoteEnvConfig(urls[env], config.reset_timeout_s, config.step_timeout_s)
          self._factories[env] = functools.partial(RemoteEnvironment, remote)
        else:
          pool = EnvPool(
            EnvPoolConfig(
              env=env,
              num_workers=config.local_workers,
              reset_timeout_s=config.reset_timeout_s,
              step_timeout_s=config.step_timeout_s,
              startup_timeout_s=config.startup_timeout_s,
            )
          )
          self.pools[env] = pool
          self._factories[env] = pool.episode
    except BaseException:
      self.close()
      raise

  @property
  def factories(self) -> dict[str, Callable[[], Environment]]:
    return dict(self._factories)

  def factory(self, env: str) -> Callable[[], Environment]:
    return self._factories[env]

  def close(self) -> None:
    for pool in self.pools.values():
      pool.close()
    self.pools = {}

  def __enter__(self) -> "EnvServices":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
