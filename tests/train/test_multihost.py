"""The multi-host path: launch/slurm_gpu.sh (with a local stand-in for srun) starts 2 JAX processes
that train and checkpoint together; a 1-process run resumes from their checkpoint."""

import os
import socket
import stat
import subprocess
import sys

import pytest

from tests.train import _util

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


def _tool(d, name, text):
  path = os.path.join(d, name)
  with open(path, "w") as f:
    f.write(text)
  os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_checkpoint_then_one_resumes(tmp_path):
  bin_dir, workdir = str(tmp_path / "bin"), str(tmp_path / "w")
  os.makedirs(bin_dir)
  _tool(bin_dir, "srun", FAKE_SRUN)
  _tool(bin_dir, "scontrol", FAKE_SCONTROL)
  env = _util.env(devices=4)
  env.update(
    PATH=bin_dir + os.pathsep + env["PATH"],
    SLURM_NTASKS="2",
    SLURM_JOB_NODELIST="n[1-2]",
    CONFIG=os.path.join(_util.ROOT, "configs/k2.py:tiny"),
    WORKDIR=workdir,
    REPO=_util.ROOT,
    PORT=str(_free_port()),
    PYTHON=sys.executable,
  )
  args = _util.flags(**{"steps": 4, "checkpoint.every_steps": 2, "log.every_steps": 1})
  p = subprocess.run(
    ["bash", os.path.join(_util.ROOT, "launch/slurm_gpu.sh"), *args],
    cwd=_util.ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
  data_dir = os.path.join(workdir, "checkpoints", "4", "data")
  assert sorted(os.listdir(data_dir)) == ["commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"] or {
    "process_0-of-2.json",
    "process_1-of-2.json",
  } <= set(os.listdir(data_dir))
  rows = _util.metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer: process 0

  out = _util.run_train(workdir, *_util.flags(**{"steps": 6, "checkpoint.every_steps": 2, "log.every_steps": 1}))
  assert f"resumed from {os.path.join(workdir, 'checkpoints')}/4" in out.stdout
  assert "saved by [2] processes" in out.stderr  # data restarts, said out loud
  rows = _util.metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert all(r["skipped_steps"] == 0 for r in rows) and rows[-1]["loss"] < rows[0]["loss"]
