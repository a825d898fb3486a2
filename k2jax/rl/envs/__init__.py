"""RL environments: the Gym-like interface, tool environments (simulated office world, sandboxed code),
and their HTTP service, client and process pool."""

from k2jax.rl.envs.base import Environment, StepResult, ToolEnvironment
from k2jax.rl.envs.client import RemoteEnvConfig, RemoteEnvironment
from k2jax.rl.envs.pool import EnvPool, EnvPoolConfig
from k2jax.rl.envs.service import EnvService

__all__ = [
  "Environment",
  "StepResult",
  "ToolEnvironment",
  "RemoteEnvConfig",
  "RemoteEnvironment",
  "EnvPool",
  "EnvPoolConfig",
  "EnvService",
]
