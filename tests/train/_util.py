"""Shared helpers for tests/train: tiny configs and trainer subprocesses with the suite's devices."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "configs"))

import k2  # noqa: E402  configs/k2.py
from tests.xla_flags import xla_flags


def tiny_config(**overrides):
  """configs/k2.py:tiny made quick: no progress bar, no TensorBoard, short schedule."""
  c = k2.get_config("tiny")
  c.log.progress = False
  c.log.tensorboard = False
  c.optim.warmup_steps = 2
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def flags(**overrides) -> list[str]:
  base = {"log.progress": False, "log.tensorboard": False, "optim.warmup_steps": 2}
  return [f"--config.{k}={v}" for k, v in {**base, **overrides}.items()]


def env(devices: int = 8, cache_dir: str | None = None) -> dict:
  """The child's environment: fake CPU devices, highest matmul precision, shared compile cache."""
  e = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    JAX_DEFAULT_MATMUL_PRECISION="highest",
    XLA_FLAGS=xla_flags(devices),
    PYTHONPATH=ROOT,
  )
  if cache_dir:
    e.update(
      JAX_COMPILATION_CACHE_DIR=cache_dir,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
  return e


def train_cmd(workdir: str, *extra: str, script: str = "launch/train.py") -> list[str]:
  return [
    sys.executable,
    os.path.join(ROOT, script),
    "--config=" + os.path.join(ROOT, "configs/k2.py:tiny"),
    f"--workdir={workdir}",
    *extra,
  ]


def run_train(
  workdir: str,
  *extra: str,
  devices: int = 8,
  cache_dir=None,
  script="launch/train.py",
  check: bool = True,
  timeout: int = 600,
) -> subprocess.CompletedProcess:
  p = subprocess.run(
    train_cmd(workdir, *extra, script=script),
    cwd=ROOT,
    env=env(devices, cache_dir),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  if check and p.returncode != 0:
    raise AssertionError(f"trainer failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
  return p


def metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]
