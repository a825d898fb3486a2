"""The multi-host path: launch/slurm_gpu.sh (with a local stand-in for srun) starts 2 JAX processes that train,
evaluate the held-out loss and benchmark tasks (`eval.tasks_file`: a generation and a multiple-choice task,
tests/train/test_eval_tasks.py) every 2 steps and checkpoint together. launch/eval.py (one process) on the
checkpoints of steps 2 and 4 gives the numbers, greedy texts and log-likelihoods of the in-loop task evaluations
(process 0 alone runs them, on the weights both gathered); a 1-process run (8 devices, the same mesh) resumes from
their checkpoint and evaluates it at start: the same held-out numbers as the 2 processes'. One 2-process launch
for both properties (they were two: ~50 CPU-s of process start-ups and compiles each)."""

import os
import shutil

import pytest

from tests.train import _util
from tests.train.test_eval_tasks import COMMON, GEN, MC, check_against_launch_eval, samples, tasks_file
from tests.xla_flags import launcher_cache


def _evals(workdir):
  return [r for r in _util.metrics(workdir) if "eval/loss" in r]


@pytest.mark.slow
def test_two_processes_train_evaluate_checkpoint_then_one_resumes(tmp_path):
  items, gen, mc = tasks_file(tmp_path)
  workdir, cache = str(tmp_path / "w"), launcher_cache()  # tests/xla_flags.py
  heldout = {"eval.fraction": 0.05, "eval.steps": 3, "eval.every_steps": 2}
  train = {**COMMON, "steps": 4, "checkpoint.every_steps": 2, "checkpoint.keep": 3, **heldout}
  p = _util.run_two_processes(tmp_path, workdir, _util.flags(**train, **{"eval.tasks_file": items}), cache_dir=cache)
  data_dir = os.path.join(workdir, "checkpoints", "4", "data")
  assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(os.listdir(data_dir))
  rows = [r for r in _util.metrics(workdir) if "eval/loss" not in r]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer: process 0
  evals = _evals(workdir)
  assert [r["step"] for r in evals] == [2, 4]
  for r in evals:
    assert r["eval/loss"] > 0 and r["eval/batches"] == 3 and r["eval/tokens"] > 1000
    assert set(r) >= {"eval/gen/pass@1", "eval/gen/mean@1", "eval/choice/acc", "eval/choice/acc_norm"}
    assert 0.0 <= r["eval/choice/acc"] <= 1.0 and r["eval/seconds"] >= r["eval/tasks_seconds"] > 0
  assert "eval step 4/4 " in p.stdout + p.stderr and "choice: acc " in p.stdout + p.stderr  # the console line
  assert sorted(os.listdir(os.path.join(workdir, "eval"))) == ["choice", "gen"]
  # The weights changed between the two evaluations, and the log-likelihoods with them.
  s2, s4 = (samples(os.path.join(workdir, "eval", "choice", str(s))) for s in (2, 4))
  assert s2.keys() == s4.keys() and len(s2) == len(MC) and len(GEN) > 0
  assert any(s2[k]["loglikelihoods"] != s4[k]["loglikelihoods"] for k in s2)

  # launch/eval.py on each checkpoint, before the resume below adds newer ones.
  for step, record in zip((2, 4), evals):
    model = workdir
    if step == 2:  # launch/eval.py reads a workdir's newest checkpoint: a copy whose newest is step 2
      model = str(tmp_path / "w_at_2")
      shutil.copytree(workdir, model, ignore=shutil.ignore_patterns("4", "eval", "tb"))
      assert sorted(os.listdir(os.path.join(model, "checkpoints"))) == ["2"]
    check_against_launch_eval(model, str(tmp_path / f"launch_eval_{step}"), workdir, step, record, gen, mc, cache)

  # One process resumes (without the tasks: the held-out loss is what it compares) and evaluates at start.
  out = _util.run_train(workdir, *_util.flags(**{**train, "steps": 6}), "--config.eval.at_start=True", cache_dir=cache)
  assert f"resumed from {os.path.join(workdir, 'checkpoints')}/4" in out.stdout
  assert "saved by [2] processes" in out.stderr  # data restarts, said out loud
  two, one = evals[1], _evals(workdir)[2]  # at start: the 2 processes' final weights, evaluated by 1 process
  held = {k: v for k, v in one.items() if k.startswith("eval/") and k != "eval/seconds"}
  assert one["step"] == 4 and held and held == {k: two[k] for k in held}
  rows = [r for r in _util.metrics(workdir) if "eval/loss" not in r]
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert all(r["skipped_steps"] == 0 for r in rows) and rows[-1]["loss"] < rows[0]["loss"]
