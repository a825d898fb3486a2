"""Bad config values fail before anything compiles, with a message naming the key."""

import os
import subprocess
import sys

import jax
import pytest

from k2jax.model.config import ConfigError
from k2jax.train import loop
from k2jax.train.config import check_runtime, from_config_dict
from tests.train import _util


@pytest.fixture
def no_compile(monkeypatch):
  """Any jit compile inside run() fails the test (validation must happen first)."""

  def refuse(*a, **k):
    raise AssertionError("compiled before the config was validated")

  monkeypatch.setattr(jax, "jit", refuse)


@pytest.mark.parametrize(
  "override, key",
  [
    ({"mesh.data": 3}, "mesh"),  # 3 does not divide 8 devices
    ({"data.global_batch_size": 12}, "data.global_batch_size"),  # 12 rows over 8 devices
    ({"data.global_batch_size": 16, "data.num_microbatches": 3}, "data.global_batch_size"),
    ({"data.path": "/nonexistent/corpus.jsonl"}, "data.path"),
    ({"data.tokenizer_path": "/nonexistent/tok.tiktoken"}, "data.tokenizer_path"),
    ({"mesh.rules": "zigzag"}, "mesh.rules"),
    ({"optim.final_lr": 1.0}, "optim.final_lr"),
    ({"model.preset": "huge"}, "model.preset"),
    ({"model.num_experts_per_tok": 99}, "num_experts_per_tok"),
    ({"data.seq_len": 4096}, "data.seq_len"),
    ({"checkpoint.init_from": "/nonexistent/run"}, "checkpoint.init_from"),
    ({"checkpoint.on_unreadable": "skip"}, "checkpoint.on_unreadable"),
  ],
)
def test_bad_values_name_the_key(no_compile, tmp_path, override, key):
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    loop.run(_util.tiny_config(**override), str(tmp_path))


def test_unknown_key_and_type(tmp_path):
  c = _util.tiny_config()
  with pytest.raises(AttributeError, match="lrr"):  # locked ConfigDict
    c.optim.lrr = 1.0
  c = _util.tiny_config()
  c.unlock()
  c.data.shuffle = True
  with pytest.raises(ConfigError, match=r"data: unknown key\(s\) \['shuffle'\]"):
    from_config_dict(c)


def test_mesh_resolution():
  tc = from_config_dict(_util.tiny_config(**{"mesh.fsdp": 4, "mesh.data": -1}))
  assert check_runtime(tc, 8, 1) == {"stage": 1, "data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
  with pytest.raises(ConfigError, match="data.global_batch_size"):
    check_runtime(tc, 8, 3)  # 16 rows over 3 processes


def test_launcher_rejects_unknown_flag_key(tmp_path):
  p = subprocess.run(
    _util.train_cmd(str(tmp_path), "--config.optim.lrr=1"),
    cwd=_util.ROOT,
    env=_util.env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert p.returncode != 0
  assert "lrr" in p.stderr


def test_dry_run_prints_k2_counts():
  p = subprocess.run(
    [
      sys.executable,
      os.path.join(_util.ROOT, "launch/train.py"),
      "--config=" + os.path.join(_util.ROOT, "configs/k2.py:1t"),
      "--dry_run",
    ],
    cwd=_util.ROOT,
    env=_util.env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert p.returncode == 0, p.stderr[-2000:]
  assert "params_total=1026408209408" in p.stdout
  assert "params_activated=32861477888" in p.stdout
