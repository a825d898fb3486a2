"""RL runs as processes get the pretraining guarantees: 2 JAX processes that train against an engine URL,
checkpoint and push weights together (each writing only its own tensors) and a 1-process run that resumes
from their checkpoints, falling back past a truncated latest one. (The exact resume after SIGKILL is
tests/rl/test_rl_colocated.py's, colocated, warm start and PTX included.)

Each run is as short as its assertions allow (compiles dominate: the later run loads them from the module's
cache): two iterations with a checkpoint after each, so a resume from the first has one more to redo."""

import glob
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from k2jax.api import model_from_state
from k2jax.convert import hf as hf_io
from k2jax.convert import workdir as wd
from k2jax.model import K2Model, presets
from k2jax.engine.inference import EngineConfig, InferenceEngine
from k2jax.rl.weight_sync import INDEX_NAME

from tests.engine.fake_sglang_server import FakeSglangServer
from tests.xla_flags import launcher_cache, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # RL runs in subprocesses (compile-bound)

# Deterministic rollouts: no over-sampling, no partial rollouts (their carry-over is not checkpointed).
QUICK = {
  "iterations": 2,
  "checkpoint.every": 1,
  "warm_start.steps": 2,
  "warm_start.batch_size": 16,
  "rollout.group_size": 4,
  "rollout.target_groups": 4,
  "rollout.launch_groups": 4,
  "rollout.partial_rollout": False,
  "ptx.batch_size": 8,
  "eval.every": 0,
}
EXACT_KEYS = ("loss", "rl_loss", "ptx_loss", "grad_norm", "param_norm", "update_norm", "reward_mean", "max_attn_logit")


def _flags(**overrides):
  return [f"--config.{k}={v}" for k, v in {**QUICK, **overrides}.items()]


def _env(cache, devices=8, second_host=False):
  return dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    JAX_DEFAULT_MATMUL_PRECISION="highest",
    XLA_FLAGS=xla_flags(devices, second_host=second_host),
    PYTHONPATH=ROOT,
    JAX_COMPILATION_CACHE_DIR=cache,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )


def _cmd(workdir, *extra, script="launch/rl.py"):
  return [
    sys.executable,
    os.path.join(ROOT, script),
    "--config=" + os.path.join(ROOT, "configs/rl.py:tiny"),
    f"--workdir={workdir}",
    *extra,
  ]


def _run(workdir, *extra, env, expect=0, script="launch/rl.py"):
  p = subprocess.run(
    _cmd(workdir, *extra, script=script), cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500
  )
  assert p.returncode == expect, p.stdout[-3000:] + p.stderr[-6000:]
  return p


def _metrics(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def _params(workdir):
  cfg = wd.read_model_config(workdir)
  return wd.restore_model_state(workdir, hf_io.abstract_state(cfg))


@pytest.fixture(scope="module")
def cache():
  """The suite's launcher compile cache (tests/xla_flags.py): a resume loads the programs an earlier run of
  the same config and shapes compiled, here or in tests/rl/test_rl_colocated.py."""
  return launcher_cache()


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_train_checkpoint_push_then_one_resumes_past_a_truncated_latest(tmp_path, cache):
  workdir = str(tmp_path / "w")
  cfg = presets.get("tiny")
  served = InferenceEngine(
    model_from_state(cfg, nnx.to_pure_dict(nnx.state(K2Model(cfg, rngs=nnx.Rngs(9))))),
    EngineConfig(max_slots=32, max_seq_len=64),
  )
  flags = _flags(iterations=2, **{"sync.keep_last": 100})
  with FakeSglangServer(served) as server:
    flags.append(f"--config.rollout.engine_url={server.url}")
    port = _free_port()
    procs = [
      subprocess.Popen(
        _cmd(workdir, *flags, f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"),
        cwd=ROOT,
        env=_env(cache, devices=4),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
      for i in range(2)
    ]
    outs = [p.communicate(timeout=1500)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-4000:] + outs[1][-4000:]
    assert [r["step"] for r in _metrics(workdir) if "phase" not in r] == [1, 2]  # one writer: process 0
    # The first push is full: both processes wrote files, no tensor twice, together the whole HF model.
    first = server.loaded[0][0]
    by_process = {p: glob.glob(os.path.join(first, f"model-p{p:05d}-*.safetensors")) for p in (0, 1)}
    assert by_process[0] and by_process[1]
    names = [n for files in by_process.values() for f in files for n in load_file(f)]
    index = json.load(open(os.path.join(first, INDEX_NAME)))["weight_map"]
    want = [
      k
      for k, _ in hf_io.iter_hf_tensors(
        cfg, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), hf_io.abstract_state(cfg)), None
      )
    ]
    assert len(names) == len(set(names)) and sorted(names) == sorted(want) == sorted(index)
    # Every push after it reached the engine: it serves exactly the final checkpoint's weights.
    _, final = _params(workdir)
    served_now = served._runner.params()
    for path, x in jax.tree_util.tree_flatten_with_path(final)[0]:
      y = served_now
      for k in path:
        y = y[k.key]
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=jax.tree_util.keystr(path))

    # Truncate a data file of the newest checkpoint: the learner reports it, moves it aside, resumes from 1
    # (the 1-process run reads the 2 processes' checkpoint, as without the truncation).
    files = [
      f
      for f in glob.glob(os.path.join(workdir, "checkpoints", "2", "model", "**", "*"), recursive=True)
      if os.path.isfile(f)
    ]
    victim = max(files, key=os.path.getsize)
    with open(victim, "r+b") as f:
      f.truncate(os.path.getsize(victim) // 2)
    out = _run(
      workdir,
      *_flags(iterations=2, **{"sync.keep_last": 100}),
      f"--config.rollout.engine_url={server.url}",
      env=_env(cache),
    )
  assert f"resumed RL from {os.path.join(workdir, 'checkpoints')}/1" in out.stdout
  assert "unreadable" in out.stderr and os.path.isdir(os.path.join(workdir, "checkpoints_corrupt", "2"))
  assert [r["step"] for r in _metrics(workdir) if "phase" not in r] == [1, 2]  # iteration 2 redone, logged once
  served.close()
