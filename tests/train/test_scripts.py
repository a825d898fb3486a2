"""Launch helpers that cannot run here are tested for the commands they build."""

import os
import subprocess
import sys

from k2jax.train import sweep
from tests.train import _util

CONFIG = os.path.join(_util.ROOT, "configs/k2.py") + ":tiny"


def test_sweep_expands_to_absl_overrides():
  runs = sweep.load_sweep(CONFIG, "lr")
  assert [r["optim.peak_lr"] for r in runs] == [3e-3, 1e-2, 3e-2]
  cmd = sweep.train_command(CONFIG, "/w/lr/0", runs[1], ["--config.steps=5"])
  assert cmd[1:] == [
    "launch/train.py",
    f"--config={CONFIG}",
    "--workdir=/w/lr/0",
    "--config.optim.peak_lr=0.01",
    "--config.optim.final_lr=0.001",
    "--config.steps=5",
  ]
  pod = sweep.pod_command(cmd, "k2-pod", "us-east5-a")
  assert pod.startswith("bash launch/tpu_pod.sh run k2-pod us-east5-a -- python launch/train.py ")


def test_sweep_rejects_unknown_names(tmp_path):
  import pytest

  with pytest.raises(ValueError, match="unknown sweep 'nope'"):
    sweep.load_sweep(CONFIG, "nope")


def test_sweep_pod_mode_prints_one_command_per_run(tmp_path):
  p = subprocess.run(
    [
      sys.executable,
      "launch/sweep.py",
      f"--config={CONFIG}",
      "--sweep=microbatches",
      f"--workdir={tmp_path}",
      "--mode=pod",
      "--tpu=k2",
      "--zone=us-east5-a",
    ],
    cwd=_util.ROOT,
    env=_util.env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert p.returncode == 0, p.stderr[-2000:]
  lines = p.stdout.strip().splitlines()
  assert len(lines) == 3
  assert all("--config.data.num_microbatches=" in l and "--worker" not in l for l in lines)


def test_tpu_pod_run_uses_all_workers():
  env = dict(os.environ, TPU_POD_DRY_RUN="1", PROJECT="my-proj")
  p = subprocess.run(
    [
      "bash",
      "launch/tpu_pod.sh",
      "run",
      "k2",
      "us-east5-a",
      "--",
      "python",
      "launch/train.py",
      "--config=configs/k2.py:1t",
      "--workdir=/mnt/k2 run",
    ],
    cwd=_util.ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert p.returncode == 0, p.stderr
  out = p.stdout.strip()
  assert out.startswith("gcloud compute tpus tpu-vm ssh k2 --zone=us-east5-a --worker=all --command=")
  assert "--project=my-proj" in out
  assert r"--workdir=/mnt/k2\\\ run" in out or r"/mnt/k2\ run" in out  # the space survives quoting
  p = subprocess.run(
    ["bash", "launch/tpu_pod.sh", "create", "k2", "us-east5-a", "v5p-1024"],
    cwd=_util.ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert "tpu-vm create k2 --zone=us-east5-a --accelerator-type=v5p-1024 --version=v2-alpha-tpuv5" in p.stdout
