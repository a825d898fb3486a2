"""Shared helpers for tests/train: tiny configs and trainer subprocesses with the suite's devices."""

import json
import os
import socket
import stat
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


def env(devices: int = 8, cache_dir: str | None = None, optimize: bool = False) -> dict:
  """The child's environment: fake CPU devices, highest matmul precision, shared compile cache; `optimize`:
  the optimised level instead of the suite's quick compiles (tests/xla_flags.py)."""
  e = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    JAX_DEFAULT_MATMUL_PRECISION="highest",
    XLA_FLAGS=xla_flags(devices, optimize),
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
  optimize: bool = False,
) -> subprocess.CompletedProcess:
  p = subprocess.run(
    train_cmd(workdir, *extra, script=script),
    cwd=ROOT,
    env=env(devices, cache_dir, optimize),
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


FAKE_SRUN = """#!/usr/bin/env bash
# Stand-in for srun on one machine: skip srun's options, run the command once per task.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
echo localhost
echo otherhost
"""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_two_processes(tmp_path, workdir: str, args: list[str], cache_dir: str | None = None, timeout: int = 900):
  """launch/slurm_gpu.sh on configs/k2.py:tiny with stand-ins for srun/scontrol (under tmp_path/bin): two
  JAX processes of 4 fake devices each on this machine. Asserts it exits 0 (the logs' tails otherwise)."""
  bin_dir = os.path.join(str(tmp_path), "bin")
  os.makedirs(bin_dir, exist_ok=True)
  for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
    path = os.path.join(bin_dir, name)
    with open(path, "w") as f:
      f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
  e = env(devices=4, cache_dir=cache_dir)
  e.update(
    PATH=bin_dir + os.pathsep + e["PATH"],
    SLURM_NTASKS="2",
    SLURM_JOB_NODELIST="n[1-2]",
    CONFIG=os.path.join(ROOT, "configs/k2.py:tiny"),
    WORKDIR=workdir,
    REPO=ROOT,
    PORT=str(free_port()),
    PYTHON=sys.executable,
  )
  p = subprocess.run(
    ["bash", os.path.join(ROOT, "launch/slurm_gpu.sh"), *args],
    cwd=ROOT,
    env=e,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
  return p
