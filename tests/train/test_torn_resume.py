"""Resumes that survive what a crash leaves: a torn metrics.jsonl tail, every checkpoint unreadable,
a resume with another `model.param_dtype` (the launcher in a subprocess: exit codes and logs are the API)."""

import collections
import os
import shutil
import signal
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import sharding
from k2jax.train import config as train_config
from k2jax.train import core, loop
from k2jax.train.checkpoint import Checkpointer, abstract_like
from tests.train import _util
from tests.xla_flags import launcher_cache

TORN = b'{"expert_load_max": 1.1, "grad_norm": 0.5, "lo'  # the disk filled mid-line


# One step program per dtype for the whole module (steps, batch and devices fixed): the runs share compiles.
BASE = {
  "steps": 6,
  "checkpoint.every_steps": 2,
  "log.every_steps": 1,
  "checkpoint.async_save": False,
  "data.global_batch_size": 4,
  "data.seq_len": 32,
}


@pytest.fixture(scope="module")
def cache():
  return launcher_cache()  # tests/xla_flags.py


def _train(workdir, cache, check=True, **overrides):
  return _util.run_train(workdir, *_util.flags(**{**BASE, **overrides}), devices=1, cache_dir=cache, check=check)


def _tree(path):
  out = {}
  for d, _, names in os.walk(path):
    for n in names:
      with open(os.path.join(d, n), "rb") as f:
        out[os.path.relpath(os.path.join(d, n), path)] = f.read()
  return out


@pytest.fixture(scope="module")
def torn_resumed(tmp_path_factory, cache):
  """A float32 run SIGKILLed after step 4's checkpoint, step 5's metrics line torn, resumed in bfloat16 to step 6:
  the first test checks that resume, the second copies its workdir (checkpoints 2, 4, 6) to corrupt instead of
  training one more run (one launch fewer)."""
  w = str(tmp_path_factory.mktemp("torn") / "w")
  env = dict(_util.env(devices=1, cache_dir=cache), K2JAX_KILL_AFTER_STEP="4")
  cmd = _util.train_cmd(w, *_util.flags(**BASE), script="tests/train/kill_after_save.py")
  p = subprocess.run(cmd, cwd=_util.ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
  steps_at_kill = [r["step"] for r in _util.metrics(w)]
  with open(os.path.join(w, "metrics.jsonl"), "ab") as f:  # step 5's line, cut by the crash
    f.write(TORN)
  return w, steps_at_kill, _train(w, cache, **{"model.param_dtype": "bfloat16"})


@pytest.mark.slow
def test_torn_metrics_tail_then_resume_in_bfloat16(torn_resumed):
  """A float32 run killed mid-line of metrics.jsonl resumes with model.param_dtype=bfloat16: the torn
  line is dropped with a warning, the checkpoint is cast (params and optimizer state) and training goes on."""
  w, steps_at_kill, p = torn_resumed
  metrics = os.path.join(w, "metrics.jsonl")
  assert steps_at_kill == [1, 2, 3, 4]
  assert f"{metrics}:5: dropped a torn last line (a crash mid-write)" in p.stderr
  ckpt4 = os.path.join(w, "checkpoints", "4")
  assert f"resumed from {os.path.join(w, 'checkpoints')}/4" in p.stdout
  assert f"checkpoint {ckpt4}: model stored as float32 -> bfloat16 (" in p.stdout
  rows = _util.metrics(w)
  assert [r["step"] for r in rows] == list(range(1, 7))
  assert all(np.isfinite(r["loss"]) and r["skipped_steps"] == 0 for r in rows)
  assert rows[4]["param_norm"] == pytest.approx(rows[3]["param_norm"], rel=0.05)  # the trained weights, cast

  # What the resume restored is the float32 checkpoint cast, optimizer state included, in the dtypes a
  # fresh bfloat16 run has.
  f32, bf16 = _restore(w, 4, "float32"), _restore(w, 4, "bfloat16")
  fresh = _layout("bfloat16").abstract_state
  assert collections.Counter(str(x.dtype) for x in jax.tree.leaves(f32.opt_state))["float32"] > 0
  for got, want, like in zip(jax.tree.leaves(bf16), jax.tree.leaves(f32), jax.tree.leaves(fresh)):
    assert got.dtype == like.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(want).astype(like.dtype)))
  assert _restore(w, 6, "bfloat16").step == 6


def _layout(param_dtype):
  tc = train_config.from_config_dict(_util.tiny_config(**{"model.param_dtype": param_dtype}))
  optimizer, _ = loop.make_optimizer(tc)
  mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "expert": 1, "tensor": 1})
  return core.layout(tc.model, optimizer, mesh=mesh, preset="fsdp", seed=0)


def _restore(workdir, step, param_dtype):
  lay = _layout(param_dtype)
  ckpt = Checkpointer(workdir, keep=10, async_save=False)
  try:
    restored = ckpt._restore(step, abstract_like(lay.abstract_state, lay.device_shardings), None)
  finally:
    ckpt.close()
  return restored.state


@pytest.mark.slow
def test_unreadable_checkpoints_stop_the_run_unless_asked_to_start_fresh(tmp_path, cache, torn_resumed):
  w = str(tmp_path / "w")
  shutil.copytree(torn_resumed[0], w)  # a finished run: checkpoints 2, 4 (float32) and 6 (bfloat16)
  ckpts = os.path.join(w, "checkpoints")
  assert sorted(os.listdir(ckpts), key=int) == ["2", "4", "6"]
  for step in ("2", "4", "6"):  # a truncated array file in each: what a full disk leaves
    for d, _, names in os.walk(os.path.join(ckpts, step, "model")):
      for n in names:
        p = os.path.join(d, n)
        if os.path.getsize(p) > 1024:
          with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 2)
  before, metrics_before = _tree(w), open(os.path.join(w, "metrics.jsonl")).read()

  bf16 = {"model.param_dtype": "bfloat16"}  # the copied run's last config (and its compiled step)
  p = _train(w, cache, check=False, **bf16)
  assert p.returncode != 0, p.stdout[-2000:]
  assert f"UnreadableCheckpoints: no checkpoint in {ckpts} restores; nothing was moved or overwritten" in p.stderr
  for step in ("2", "4", "6"):
    assert f"\n  {os.path.join(ckpts, step)}: " in p.stderr  # each named, with why it failed
  assert "--config.checkpoint.on_unreadable=fresh" in p.stderr
  assert "step 1/" not in p.stdout  # it did not train
  after = _tree(w)
  assert {k: v for k, v in after.items() if k in before} == before  # nothing changed or moved
  assert not os.path.exists(os.path.join(w, "checkpoints_corrupt"))
  assert open(os.path.join(w, "metrics.jsonl")).read() == metrics_before

  p = _train(w, cache, **bf16, **{"checkpoint.on_unreadable": "fresh"})
  assert "no checkpoint restores (checkpoint.on_unreadable='fresh'): starting from step 0" in p.stdout
  assert sorted(os.listdir(os.path.join(w, "checkpoints_corrupt"))) == ["2", "4", "6"]  # moved aside, kept
  assert sorted(os.listdir(ckpts), key=int) == ["2", "4", "6"]  # the new run's
  assert [r["step"] for r in _util.metrics(w)] == list(range(1, 7))
