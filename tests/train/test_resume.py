"""Exact resume: 2N steps straight == N steps, SIGKILL, resume to 2N (bitwise, on CPU), the held-out
evaluation at N and 2N included (the same numbers after the resume)."""

import os
import signal
import subprocess

import jax
import numpy as np
import pytest

from k2jax.convert import hf as hf_io
from k2jax.convert import workdir as wd
from k2jax.model.config import K2Config
from tests.train import _util
from tests.xla_flags import launcher_cache

N = 4
EVAL_KEYS = lambda r: {k: v for k, v in r.items() if k.startswith("eval/") and k != "eval/seconds"}  # noqa: E731


def _evals(rows):
  return [r for r in rows if "eval/loss" in r]


@pytest.mark.slow
def test_kill_and_resume_is_bitwise_exact(tmp_path):
  cache = launcher_cache()  # the three runs compile the same program once (tests/xla_flags.py)
  args = _util.flags(
    **{
      "steps": 2 * N,
      "checkpoint.every_steps": N,
      "log.every_steps": 1,
      "data.num_microbatches": 2,
      "eval.fraction": 0.05,
      "eval.every_steps": N,
    }
  ) + ["--config.eval.steps=2"]
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  _util.run_train(straight, *args, cache_dir=cache)

  env = _util.env(cache_dir=cache)
  env["K2JAX_KILL_AFTER_STEP"] = str(N)
  p = subprocess.run(
    _util.train_cmd(killed, *args, script="tests/train/kill_after_save.py"),
    cwd=_util.ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
  assert sorted(os.listdir(os.path.join(killed, "checkpoints"))) == [str(N)]
  assert [r["step"] for r in _evals(_util.metrics(killed))] == [N]

  out = _util.run_train(killed, *args, cache_dir=cache)
  assert f"resumed from {os.path.join(killed, 'checkpoints')}/{N}" in out.stdout

  ea, eb = _evals(_util.metrics(straight)), _evals(_util.metrics(killed))
  assert [r["step"] for r in ea] == [r["step"] for r in eb] == [N, 2 * N]
  assert [EVAL_KEYS(r) for r in ea] == [EVAL_KEYS(r) for r in eb]
  assert ea[1]["eval/loss"] < ea[0]["eval/loss"] and ea[0]["eval/batches"] == 2
  a, b = ([r for r in _util.metrics(w) if "eval/loss" not in r] for w in (straight, killed))
  assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 2 * N + 1))
  for ra, rb in zip(a, b):
    for key in (
      "loss",
      "grad_norm",
      "param_norm",
      "update_norm",
      "max_attn_logit",
      "lr",
      "expert_load_min",
      "expert_load_max",
    ):
      assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
  cfg = K2Config.from_json_file(os.path.join(straight, wd.MODEL_CONFIG))
  step_a, pa = wd.restore_model_state(straight, hf_io.abstract_state(cfg))
  step_b, pb = wd.restore_model_state(killed, hf_io.abstract_state(cfg))
  assert step_a == step_b == 2 * N
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert np.any(np.asarray(pa["moe_layers"]["moe"]["router"]["bias"]) != 0)  # the bias trained too
