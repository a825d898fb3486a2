"""Agent environments: the Gym-like interface, tool environments (simulated office world, sandboxed code,
repository SWE tasks in `swe.py`), and their HTTP service, client and process pool."""

from k2jax.agentic.envs.base import Environment, StepResult, ToolEnvironment
from k2jax.agentic.envs.client import RemoteEnvConfig, RemoteEnvironment
from k2jax.agentic.envs.pool import EnvPool, EnvPoolConfig
from k2jax.agentic.envs.service import EnvService
from k2jax.agentic.envs.services import EnvServices, EnvServicesConfig, parse_urls

__all__ = [
  "Environment",
  "StepResult",
  "ToolEnvironment",
  "RemoteEnvConfig",
  "RemoteEnvironment",
  "EnvPool",
  "EnvPoolConfig",
  "EnvService",
  "EnvServices",
  "EnvServicesConfig",
  "parse_urls",
]
