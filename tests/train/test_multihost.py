"""The multi-host path: launch/slurm_gpu.sh (with a local stand-in for srun) starts 2 JAX processes
that train, evaluate the held-out loss and checkpoint together; a 1-process run (8 devices, the same mesh)
resumes from their checkpoint and evaluates it at start: the same held-out numbers as the 2 processes'."""

import os

import pytest

from tests.train import _util

EVAL_KEYS = lambda r: {k: v for k, v in r.items() if k.startswith("eval/") and k != "eval/seconds"}  # noqa: E731


def _evals(workdir):
  return [r for r in _util.metrics(workdir) if "eval/loss" in r]


@pytest.mark.slow
def test_two_processes_train_checkpoint_then_one_resumes(tmp_path):
  workdir = str(tmp_path / "w")
  heldout = {"eval.fraction": 0.05, "eval.steps": 3}
  args = _util.flags(**{"steps": 4, "checkpoint.every_steps": 2, "log.every_steps": 1, **heldout})
  _util.run_two_processes(tmp_path, workdir, args)
  data_dir = os.path.join(workdir, "checkpoints", "4", "data")
  assert sorted(os.listdir(data_dir)) == ["commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"] or {
    "process_0-of-2.json",
    "process_1-of-2.json",
  } <= set(os.listdir(data_dir))
  rows = [r for r in _util.metrics(workdir) if "eval/loss" not in r]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer: process 0
  (two,) = _evals(workdir)  # at the end
  assert two["step"] == 4 and two["eval/batches"] == 3 and two["eval/tokens"] > 1000

  args = _util.flags(**{"steps": 6, "checkpoint.every_steps": 2, "log.every_steps": 1, **heldout})
  out = _util.run_train(workdir, *args, "--config.eval.at_start=True")
  assert f"resumed from {os.path.join(workdir, 'checkpoints')}/4" in out.stdout
  assert "saved by [2] processes" in out.stderr  # data restarts, said out loud
  one = _evals(workdir)[1]  # at start: the 2 processes' final weights, evaluated by 1 process
  assert one["step"] == 4 and EVAL_KEYS(one) == EVAL_KEYS(two)
  rows = [r for r in _util.metrics(workdir) if "eval/loss" not in r]
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert all(r["skipped_steps"] == 0 for r in rows) and rows[-1]["loss"] < rows[0]["loss"]
