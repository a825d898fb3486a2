"""The multi-host path: launch/slurm_gpu.sh (with a local stand-in for srun) starts 2 JAX processes
that train and checkpoint together; a 1-process run resumes from their checkpoint."""

import os

import pytest

from tests.train import _util


@pytest.mark.slow
def test_two_processes_train_checkpoint_then_one_resumes(tmp_path):
  workdir = str(tmp_path / "w")
  args = _util.flags(**{"steps": 4, "checkpoint.every_steps": 2, "log.every_steps": 1})
  _util.run_two_processes(tmp_path, workdir, args)
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
