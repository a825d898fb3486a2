"""launch/convert.py both ways, and the demo's transformers loader on the export (same logits)."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import k2jax
from k2jax.convert import workdir as wd
from k2jax.model import K2Model, presets
from tests.train import _util


def _convert(src, dst, *extra):
  p = subprocess.run(
    [sys.executable, "launch/convert.py", f"--src={src}", f"--dst={dst}", *extra],
    cwd=_util.ROOT,
    env=_util.env(devices=1),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  return p


def test_workdir_to_hf_and_back(tmp_path):
  pytest.importorskip("transformers")
  cfg = presets.get("tiny", num_hidden_layers=2)
  model = K2Model(cfg, rngs=nnx.Rngs(3))
  state = nnx.to_pure_dict(nnx.state(model))
  state["moe_layers"]["moe"]["router"]["bias"] = np.linspace(-0.1, 0.1, 8, dtype=np.float32)[None]
  w, hf, back = (str(tmp_path / d) for d in ("w", "hf", "back"))
  wd.save_model_only(cfg, state, w)
  _convert(w, hf)
  assert json.load(open(os.path.join(hf, "config.json")))["architectures"] == ["DeepseekV3ForCausalLM"]
  _convert(hf, back)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(nnx.state(k2jax.load(back)))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  spec = importlib.util.spec_from_file_location("hf_generate", os.path.join(_util.ROOT, "scripts/hf_generate.py"))
  hf_generate = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(hf_generate)
  import torch

  ids = np.arange(3, 19, dtype=np.int32)[None]
  with torch.no_grad():
    theirs = hf_generate.load_hf_model(hf)(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  ours = np.asarray(k2jax.load(w)(ids).logits)
  np.testing.assert_allclose(theirs, ours, atol=1e-4)  # experts loaded, not left random

  p = subprocess.run(
    [sys.executable, "launch/convert.py", f"--src={tmp_path}", f"--dst={tmp_path / 'x'}"],
    cwd=_util.ROOT,
    env=_util.env(devices=1),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert p.returncode != 0 and "neither a k2jax workdir" in p.stderr


def _convert_fails(src, dst):
  p = subprocess.run(
    [sys.executable, "launch/convert.py", f"--src={src}", f"--dst={dst}"],
    cwd=_util.ROOT,
    env=_util.env(devices=1),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert p.returncode != 0
  return p.stderr


def test_cli_refuses_a_foreign_dst_and_a_dst_containing_src(tmp_path):
  """`--dst` naming someone's directory, or a directory holding the source, deletes nothing."""
  cfg = presets.get("tiny", num_hidden_layers=2)
  w = tmp_path / "runs" / "w"
  wd.save_model_only(cfg, nnx.to_pure_dict(nnx.state(K2Model(cfg, rngs=nnx.Rngs(0)))), str(w))
  (tmp_path / "runs" / "notes.txt").write_text("mine")
  before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  err = _convert_fails(w, tmp_path / "runs")
  assert "contains --src" in err, err[-2000:]
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  (foreign / "data.bin").write_bytes(b"\0" * 10)
  err = _convert_fails(w, foreign)
  assert "not empty and not (only) a k2jax export" in err and "refusing to replace" in err, err[-2000:]
  after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  assert after == sorted(before + ["foreign", "foreign/data.bin"])
