"""The colocated sglang-jax engine (`k2jax/engine/sglang_jax.py`) on a `tiny128` model, CPU.

sglang-jax needs Python >= 3.12 and its own jax/flax pins, so it is usually not importable in the suite's
interpreter. There these tests skip and say why, and `test_under_sglang_jax_python` runs this file under
SGLANG_JAX_PYTHON (a Python that can `import sgl_jax`, docs/rl.md "sglang-jax colocated") when it is set.
"""

import importlib.util
import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import k2jax
from k2jax.engine.base import GenerateRequest, SamplingParams
from k2jax.engine.inference import EngineConfig, InferenceEngine
from k2jax.model import K2Model, presets
from k2jax.rl.algo import token_logprobs

HAVE_SGL = importlib.util.find_spec("sgl_jax") is not None
PYTHON = os.environ.get("SGLANG_JAX_PYTHON", "")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHY = (
  f"sgl_jax is not importable in Python {sys.version_info.major}.{sys.version_info.minor} (sglang-jax needs "
  ">= 3.12, docs/rl.md 'sglang-jax colocated'); set SGLANG_JAX_PYTHON to run these tests under such a Python"
)
needs_sgl = pytest.mark.skipif(not HAVE_SGL, reason=WHY)
pytestmark = pytest.mark.slow
PROMPTS = [(11, 12, 13), (400, 7, 9, 31), (5,), (1000, 2000, 3000, 17, 18)]


@pytest.mark.skipif(HAVE_SGL or not PYTHON, reason="sgl_jax runs here directly" if HAVE_SGL else WHY)
def test_under_sglang_jax_python():
  """This file's tests under SGLANG_JAX_PYTHON, on one CPU device (sglang-jax's 1x1 mesh)."""
  env = {
    **os.environ,
    "PYTHONPATH": REPO,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
  }
  cmd = [PYTHON, "-m", "pytest", "-q", "-x", "-rs", os.path.abspath(__file__), "-k", "not under_sglang_jax_python"]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def _model(seed: int) -> K2Model:
  return K2Model(presets.get("tiny128", num_hidden_layers=2, max_position_embeddings=512), rngs=nnx.Rngs(seed))


def _state(model: K2Model) -> dict:
  return nnx.to_pure_dict(nnx.state(model))


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
  from k2jax.engine.sglang_jax import SglangJaxEngine, write_model_dir

  model = _model(0)
  engine = SglangJaxEngine(model.cfg, write_model_dir(model.cfg, str(tmp_path_factory.mktemp("sgl_model"))))
  yield engine, model
  engine.close()


def _trainer_logprobs(model: K2Model, prompt, output_ids) -> jax.Array:
  tokens = jnp.asarray([list(prompt) + list(output_ids)])
  return token_logprobs(model(tokens).logits, tokens)[0, len(prompt) :]


@needs_sgl
def test_logprobs_after_each_update_equal_the_trainers(colocated):
  """Three pushes of different weights: every sampled token's logprob equals the trainer's recomputation."""
  engine, _ = colocated
  before = None
  for version, seed in ((1, 0), (2, 1), (3, 2)):
    model = _model(seed)
    engine.update_weights_from_params(_state(model), version)
    outs = []
    for i, prompt in enumerate(PROMPTS):
      sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=100 + i)
      res = engine.generate(GenerateRequest(f"v{version}/{i}", prompt, sampling))
      assert len(res.output_ids) == 24 and res.weight_versions == (version,) * 24
      gap = jnp.max(jnp.abs(_trainer_logprobs(model, prompt, res.output_ids) - jnp.asarray(res.output_logprobs)))
      assert float(gap) <= 1e-4, (version, i, float(gap))
      outs.append(res.output_logprobs)
    assert outs != before  # the new weights really serve
    before = outs


@needs_sgl
def test_greedy_tokens_equal_k2jax_engine(colocated):
  engine, _ = colocated
  model = _model(3)
  engine.update_weights_from_params(_state(model), 10)
  own = InferenceEngine(model, EngineConfig(max_slots=4, max_seq_len=512))
  try:
    for i, prompt in enumerate(PROMPTS):
      sampling = SamplingParams(max_new_tokens=40, temperature=0.0)
      res = engine.generate(GenerateRequest(f"g{i}", prompt, sampling))
      ref = own.generate(GenerateRequest(f"g{i}", prompt, sampling))
      assert res.output_ids == ref.output_ids
      assert max(abs(a - b) for a, b in zip(res.output_logprobs, ref.output_logprobs)) <= 1e-4
  finally:
    own.close()


@needs_sgl
def test_update_from_disk_and_aborts(colocated, tmp_path):
  """A whole HF export loads too (the restart-free disk path); aborted requests return their partial output."""
  engine, _ = colocated
  model = _model(4)
  k2jax.save_hf(model, str(tmp_path / "hf"))
  engine.update_weights(str(tmp_path / "hf"), 11)
  res = engine.generate(GenerateRequest("disk", PROMPTS[1], SamplingParams(max_new_tokens=16, seed=5)))
  assert res.weight_versions == (11,) * 16
  assert (
    float(jnp.max(jnp.abs(_trainer_logprobs(model, PROMPTS[1], res.output_ids) - jnp.asarray(res.output_logprobs))))
    <= 1e-4
  )
  out = {}

  def run(rid):
    out[rid] = engine.generate(GenerateRequest(rid, (5, 6, 7), SamplingParams(max_new_tokens=400, seed=1)))

  threads = [threading.Thread(target=run, args=(f"a{i}",)) for i in range(10)]
  for t in threads:
    t.start()
  while not engine._in_flight:  # wait until the requests are submitted
    threading.Event().wait(0.1)
  threading.Event().wait(2.0)
  engine.abort([f"a{i}" for i in range(10)])
  for t in threads:
    t.join(300)
  assert sorted(out) == sorted(f"a{i}" for i in range(10))
  assert all(r.finish_reason == "abort" and len(r.output_ids) < 400 for r in out.values())
  early = threading.Thread(target=run, args=("early",))  # aborted before sglang-jax has registered it
  early.start()
  while "early" not in engine._in_flight:
    threading.Event().wait(0.001)
  engine.abort(["early"])
  early.join(300)
  assert out["early"].finish_reason == "abort" and len(out["early"].output_ids) < 400


@needs_sgl
def test_rl_launch_completes_iterations_with_colocated_engine(tmp_path):
  """`launch/rl.py` with rollout.engine=sglang_jax_colocated: iterations complete, every push serves, and the
  engine's logprobs of fresh tokens equal the trainer's recomputed pi_old."""
  workdir = tmp_path / "rl"
  flags = {
    "rollout.engine": "sglang_jax_colocated",
    "model.preset": "tiny128",
    "iterations": 3,
    "warm_start.steps": 2,
    "rollout.target_groups": 4,
    "rollout.launch_groups": 5,
    "rollout.group_size": 4,
    "ptx.batch_size": 4,
    "eval.every": 0,
    "checkpoint.every": 3,
  }
  cmd = [sys.executable, os.path.join(REPO, "launch/rl.py"), "--config=configs/rl.py:tiny", f"--workdir={workdir}"]
  cmd += [f"--config.{k}={v}" for k, v in flags.items()]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  its = [r for r in records if r.get("phase") != "warm_start"]
  assert [r["step"] for r in its] == [1, 2, 3]
  versions = [r["weight_version"] for r in its]
  assert versions == sorted(versions) and len(set(versions)) == 3
  for r in its:
    assert r["unknown_version_token_frac"] == 0.0
    assert r["engine_logprob_max_abs_diff"] <= 1e-4, r
