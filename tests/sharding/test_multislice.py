"""Multislice: a DCN level in the mesh (jax's hybrid device mesh). Two CPU processes stand in for two slices
(`data: 2` over DCN, `fsdp: 4` inside each); their MuonClip train step equals one process's on one device, and
their checkpoint restores on one device. The refusals: a DCN level the devices cannot form, expert parallelism over DCN unless asked."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from multislice_common import reference_inputs, step_fn, summarize

from k2jax import sharding
from k2jax.model.config import ConfigError
from k2jax.train import config as train_config
from k2jax.train import core
from k2jax.train.checkpoint import Checkpointer, abstract_like
from k2jax.train.step import ModelDef

WORKER = pathlib.Path(__file__).parent / "multislice_worker.py"
REPO = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_slices_over_dcn_equal_one_process(tmp_path):
  port = _free_port()
  env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  env.pop("XLA_FLAGS", None)
  out = tmp_path / "p0.json"
  procs = [
    subprocess.Popen(
      [sys.executable, str(WORKER), str(port), str(i), str(out)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=600)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  got = json.loads(out.read_text())
  assert got["rows"] == [0, 4]  # process 0 loaded only its slice's rows

  from flax import nnx

  from k2jax.model import K2Model

  cfg, opt, state, batch = reference_inputs()
  mdef = ModelDef.from_model(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  new, metrics = jax.jit(step_fn(mdef, opt))(state, batch)
  want = summarize(new, metrics)
  assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"])
  assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * abs(want["grad_norm"])
  assert got["qk_clipped_heads"] == want["qk_clipped_heads"] > 0
  assert got["param_sums"].keys() == want["param_sums"].keys()
  for k, v in want["param_sums"].items():
    assert abs(got["param_sums"][k] - v) <= 1e-5 * max(1.0, abs(v)), (k, got["param_sums"][k], v)
  # The checkpoint the two slices saved restores in one process on one device: the one-process step's state.
  lay = core.layout(cfg, opt, mesh=sharding.make_mesh({}, devices=jax.devices()[:1]), preset="fsdp", seed=0)
  with lay.use():
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=1, async_save=False)
    restored = ckpt.restore_latest(abstract_like(lay.abstract_state, lay.shardings), on_unreadable="error").state
    ckpt.close()
  assert int(restored.step) == 1
  for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(new.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_dcn_level_refusals():
  with pytest.raises(sharding.ShardingError, match=r"2 slices asked for, the devices form 1"):
    sharding.make_mesh({"fsdp": 4}, dcn_shape={"data": 2})  # one process, no slice_index: one slice
  with pytest.raises(ConfigError, match=r"dcn_expert: 2: expert parallelism across slices"):
    train_config.mesh_spec({"rules": "fsdp_ep", "dcn_expert": 2})
  spec = train_config.mesh_spec({"rules": "fsdp_ep", "dcn_expert": 2, "dcn_allow_expert": True})
  assert spec.dcn_shape["expert"] == 2
  cfg = reference_inputs()[0]
  with pytest.raises(ConfigError, match=r"3 slices .* do not divide the 8 devices"):
    train_config.mesh_shape(train_config.mesh_spec({"dcn_data": 3}), cfg, 8, rows=8, what="rows")
  shape = train_config.mesh_shape(train_config.mesh_spec({"dcn_data": 2, "fsdp": -1}), cfg, 8, rows=8, what="rows")
  assert shape == {"stage": 1, "data": 2, "fsdp": 4, "expert": 1, "tensor": 1}


def test_megascale_environment():
  from k2jax import distributed

  env = distributed.megascale_env("10.0.0.2", 4, 3)
  assert env == {
    "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2",
    "MEGASCALE_PORT": "8081",
    "MEGASCALE_NUM_SLICES": "4",
    "MEGASCALE_SLICE_ID": "3",
  }
  with pytest.raises(ValueError, match=r"slice_id=4 is not in \[0, 4\)"):
    distributed.megascale_env("10.0.0.2", 4, 4)
  distributed.check_slices(2, "tpu", env={"MEGASCALE_NUM_SLICES": "2"})
  distributed.check_slices(2, "cpu", env={})  # CPU/GPU: processes are the slices, no TPU runtime to tell
  with pytest.raises(ValueError, match=r"2 slices, but MEGASCALE_NUM_SLICES=None"):
    distributed.check_slices(2, "tpu", env={})


def test_dry_run_counts_one_cross_slice_reduction_per_microbatch():
  """`--dry_run`'s DCN estimate: XLA reduces each gradient microbatch across slices where the accumulation
  loop computes it (1t_multislice on 2 x v5p-1024: 16 x 4.12 GB), so the estimate counts one reduction of
  each microbatch's gradient (`grad_accum_bytes_per_device`), 2 (n - 1) / n of it per slice pair."""
  import sys

  from k2jax.train import dryrun

  sys.path.insert(0, str(REPO / "configs"))
  import k2  # noqa: PLC0415

  def lines(slices, microbatches):
    c = k2.get_config("tiny")
    with c.unlocked():
      c.topology, c.mesh.dcn_data, c.mesh.fsdp, c.mesh.data = "v5p-1024", slices, 8, -1
      c.data.global_batch_size, c.data.num_microbatches = 4096, microbatches
    return dict(line.split("=", 1) for line in dryrun.report(c).splitlines())

  two, four = lines(2, 4), lines(4, 4)
  per_microbatch = int(two["grad_accum_bytes_per_device"])
  assert per_microbatch > 0
  assert int(two["dcn_grad_allreduce_bytes_per_device_per_step_estimate"]) == 4 * per_microbatch  # 2 (2-1)/2 = 1
  assert int(four["dcn_grad_allreduce_bytes_per_device_per_step_estimate"]) == round(1.5 * 4 * per_microbatch)
  one_pass = lines(2, 1)
  assert int(one_pass["dcn_grad_allreduce_bytes_per_device_per_step_estimate"]) == int(
    one_pass["grads_bytes_per_device"]
  )
  assert "dcn_grad_allreduce_bytes_per_device_per_step_estimate" not in lines(1, 4)
