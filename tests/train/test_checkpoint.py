"""Checkpoints: SIGTERM saves and stops; a corrupt latest checkpoint is reported by path and the
previous one is used; a checkpoint restores onto a different mesh shape; k2jax.load reads the workdir."""

import logging
import os
import signal

import jax.numpy as jnp
import numpy as np
import pytest

import k2jax
from k2jax.train import inputs, loop
from tests.train import _util


def _truncate_tree(path):
  for d, _, files in os.walk(path):
    for f in files:
      p = os.path.join(d, f)
      size = os.path.getsize(p)
      with open(p, "r+b") as fh:
        fh.truncate(size // 2)


@pytest.mark.slow
def test_sigterm_corrupt_fallback_and_new_mesh(tmp_path, monkeypatch, caplog, capsys):
  workdir = str(tmp_path / "w")
  calls = {"n": 0}
  real_to_global = inputs.to_global

  def to_global_then_sigterm(*args):
    calls["n"] += 1
    if calls["n"] == 5:  # the 5th batch: the signal lands while step 5 is in flight
      os.kill(os.getpid(), signal.SIGTERM)
    return real_to_global(*args)

  monkeypatch.setattr(inputs, "to_global", to_global_then_sigterm)
  cfg = _util.tiny_config(**{"steps": 8, "checkpoint.every_steps": 2, "checkpoint.keep": 3, "log.every_steps": 1})
  out = loop.run(cfg, workdir)
  assert out["step"] == 5  # stopped early, by the signal
  ckpts = os.path.join(workdir, "checkpoints")
  assert sorted(os.listdir(ckpts), key=int) == ["2", "4", "5"]
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
  monkeypatch.setattr(inputs, "to_global", real_to_global)
  capsys.readouterr()

  _truncate_tree(os.path.join(ckpts, "5", "model"))
  cfg = _util.tiny_config(
    **{
      "steps": 8,
      "checkpoint.every_steps": 2,
      "checkpoint.keep": 3,
      "log.every_steps": 1,
      "mesh.rules": "fsdp_ep",
      "mesh.fsdp": 4,
      "mesh.expert": 2,
    }
  )
  with caplog.at_level(logging.ERROR):
    out = loop.run(cfg, workdir)
  assert f"checkpoint {os.path.join(ckpts, '5')} is unreadable" in caplog.text
  fell_back = f"unreadable; resuming from the newest readable one, {os.path.join(ckpts, '4')}"
  assert f"checkpoint(s) {os.path.join(ckpts, '5')} {fell_back}" in capsys.readouterr().out
  assert os.path.isdir(os.path.join(workdir, "checkpoints_corrupt", "5"))
  assert out["step"] == 8 and np.isfinite(out["loss"])
  rows = _util.metrics(workdir)
  assert [r["step"] for r in rows] == list(range(1, 9))  # steps 5.. re-run from checkpoint 4

  model = k2jax.load(workdir)  # the workdir contract
  logits = model(jnp.zeros((1, 8), jnp.int32)).logits
  assert logits.shape == (1, 8, model.cfg.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))
