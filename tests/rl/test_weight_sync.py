"""Weight handoff from the sharded trainer state to an engine.

Colocated: the embedded engine gets device arrays; its next generation's logprobs equal the trainer's
recomputation and nothing is written. Remote: per-process streamed safetensors that load as the full HF
model, only changed tensors after the first push, peak host memory under 2x the largest tensor.
"""

import functools
import glob
import json
import os
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from k2jax import sharding
from k2jax.api import model_from_state
from k2jax.convert import hf as hf_io
from k2jax.convert.st_stream import BLOCK_BYTES
from k2jax.model import K2Model, presets
from k2jax.rl import rl_step
from k2jax.engine.base import GenerateRequest, SamplingParams
from k2jax.engine.inference import EngineConfig, InferenceEngine
from k2jax.engine.fake import FakeEngine, FakeEngineConfig
from k2jax.transport import RequestRejected
from k2jax.rl.weight_sync import INDEX_NAME, WeightSync, WeightSyncConfig
from k2jax.train.checkpoint import merge_dicts, split_dict
from k2jax.train.step import ModelDef


@functools.cache
def _model():
  cfg = presets.get("tiny")
  model = K2Model(cfg, rngs=nnx.Rngs(0))
  return cfg, jax.device_get(nnx.to_pure_dict(nnx.state(model)))


def _sharded(state, preset="fsdp_ep", shape=(("fsdp", 4), ("expert", 2))):
  """`state` on an 8-device mesh, sharded as the trainer holds it."""
  cfg, _ = _model()
  mesh = sharding.make_mesh(dict(shape))
  abstract = nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  shardings = nnx.to_pure_dict(sharding.param_shardings(abstract, mesh, preset))
  return jax.device_put(state, shardings)


class _Recorder(FakeEngine):
  def __init__(self):
    super().__init__(FakeEngineConfig(), lambda r: 1)
    self.updates = []

  def update_weights(self, model_path, weight_version):
    self.updates.append((model_path, weight_version))


def _read_dir(path):
  index = json.load(open(os.path.join(path, INDEX_NAME)))
  tensors, owner = {}, {}
  for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
    for name, t in load_file(f).items():
      assert name not in tensors, f"{name} written twice"
      tensors[name], owner[name] = t, os.path.basename(f)
  assert owner == index["weight_map"]
  return tensors


def test_remote_push_streams_hf_tensors_and_skips_unchanged(tmp_path):
  cfg, host = _model()
  state = _sharded(host)
  engine = _Recorder()
  # One host thread: the writer's documented bound is one tensor of prepared blocks plus (threads + 2) blocks
  # (k2jax.convert.writer), 1.75x the largest tensor here; the default two threads per core make it 2.5x on
  # 2 cores, above the 2x this test tells apart from gathering the model.
  config = WeightSyncConfig(str(tmp_path), keep_last=2, max_shard_bytes=300_000, threads=1)
  sync = WeightSync(config, engine, cfg)
  want = dict(hf_io.iter_hf_tensors(cfg, host, dtype=None))
  largest = max(t.nbytes for t in want.values())

  assert sync.push(state) == 1  # compiles the hash and export programs
  path, version = engine.updates[-1]
  assert version == 1 and os.path.basename(path) == "v00000001"
  got = _read_dir(path)
  assert sorted(got) == sorted(want)  # the full model in the HF layout
  for name, t in want.items():
    np.testing.assert_array_equal(got[name], t, err_msg=name)
  assert len(set(json.load(open(os.path.join(path, INDEX_NAME)))["weight_map"].values())) > 1  # max_shard_bytes

  assert sync.push(state) == 1 and len(engine.updates) == 1  # nothing changed: no write, no update
  tracemalloc.start()
  try:
    assert sync.push(state, full=True) == 2
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  # Streamed: host memory stays near one tensor; gathering the model (2.75x the largest tensor) would not.
  assert largest + 3 * BLOCK_BYTES < 2 * largest
  assert peak < 2 * largest, (peak, largest)
  assert sum(t.nbytes for t in want.values()) > 2.5 * largest
  assert len(_read_dir(engine.updates[-1][0])) == len(want)

  host2 = jax.tree.map(np.copy, host)
  host2["lm_head"]["w"] = host2["lm_head"]["w"] + 1.0
  host2["moe_layers"]["moe"]["experts"]["w_up"][1, 3] += 0.5  # one expert of one layer
  assert sync.push(_sharded(host2)) == 3
  got = _read_dir(engine.updates[-1][0])
  layer = cfg.num_dense_layers + 1
  assert sorted(got) == sorted(["lm_head.weight", f"model.layers.{layer}.mlp.experts.3.up_proj.weight"])
  np.testing.assert_array_equal(got["lm_head.weight"], host2["lm_head"]["w"].T)
  assert sorted(os.listdir(tmp_path)) == ["v00000002", "v00000003"]  # keep_last


def test_failed_update_rolls_back(tmp_path):
  class Failing(FakeEngine):
    def update_weights(self, model_path, weight_version):
      raise RequestRejected(f"{model_path}: refused")

  cfg, host = _model()
  sync = WeightSync(WeightSyncConfig(str(tmp_path)), Failing(FakeEngineConfig(), lambda r: 1), cfg)
  with pytest.raises(RequestRejected):
    sync.push(_sharded(host))
  assert sync.version == 0 and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_colocated_push_serves_trainer_weights_without_files(tmp_path):
  cfg, host = _model()
  engine = InferenceEngine(model_from_state(cfg, host), EngineConfig(max_slots=2, max_seq_len=32))
  root = tmp_path / "weights"
  sync = WeightSync(WeightSyncConfig(str(root)), engine, cfg)
  assert sync.colocated
  trained = jax.tree.map(np.copy, host)
  trained["lm_head"]["w"] = trained["lm_head"]["w"] * 3.0  # sharper logits: the next token changes odds
  state = _sharded(trained)
  prompt, greedy = [5, 17, 99, 3], SamplingParams(max_new_tokens=3, temperature=0.0)
  before = engine.generate(GenerateRequest("before", prompt, greedy))
  try:
    assert sync.push(state) == 1
    after = engine.generate(GenerateRequest("after", prompt, greedy))
    assert after.weight_versions == (1, 1, 1) and engine.weight_version == 1
    assert not root.exists() and os.listdir(tmp_path) == []  # no file anywhere
    params, bias = split_dict(state, nnx.to_pure_dict(nnx.state(K2Model(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    mdef = ModelDef.from_model(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
    ids = prompt + list(after.output_ids)
    tokens = np.asarray([ids], np.int32)
    lp = np.asarray(jax.jit(rl_step.make_logprobs_fn(mdef))(params, bias, tokens, np.ones_like(tokens)))
    np.testing.assert_allclose(lp[0, len(prompt) :], after.output_logprobs, atol=1e-4)
    assert np.max(np.abs(np.asarray(after.output_logprobs) - np.asarray(before.output_logprobs))) > 1e-3
    # Weights already on the engine's device are served as they are: no copy at all.
    local = jax.device_put(trained, jax.local_devices()[0])
    assert sync.push(local) == 2
    served = jax.tree.leaves(engine._runner.params())
    assert [a.unsafe_buffer_pointer() for a in served] == [a.unsafe_buffer_pointer() for a in jax.tree.leaves(local)]
    again = engine.generate(GenerateRequest("again", prompt, greedy))
    assert again.output_ids == after.output_ids and again.weight_versions == (2, 2, 2)
    assert merge_dicts(params, bias).keys() == trained.keys()
  finally:
    engine.close()


@pytest.mark.slow
def test_two_processes_write_disjoint_files_that_form_the_model(tmp_path):
  """2 JAX processes, one 8-device mesh: each writes only tensors it holds; together the full HF model."""
  import socket
  import subprocess
  import sys

  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  here = os.path.dirname(os.path.abspath(__file__))
  root = os.path.dirname(os.path.dirname(here))
  env = {**os.environ, "PYTHONPATH": root}
  env.pop("XLA_FLAGS", None)
  procs = [
    subprocess.Popen(
      [sys.executable, os.path.join(here, "weight_sync_worker.py"), str(port), str(i), str(tmp_path)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=850)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
  assert f"update_weights {tmp_path}/v00000001 1" in outs[0]  # one call, from process 0
  path = str(tmp_path / "v00000001")
  files = {p: sorted(glob.glob(os.path.join(path, f"model-p{p:05d}-*.safetensors"))) for p in (0, 1)}
  assert files[0] and files[1]
  cfg = presets.get("tiny")
  abstract = nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  host = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), nnx.to_pure_dict(abstract))
  want = dict(hf_io.iter_hf_tensors(cfg, host, dtype=None))
  got = _read_dir(path)  # asserts no tensor is written twice and the index names every file's tensors
  assert sorted(got) == sorted(want)
  for name, t in want.items():
    np.testing.assert_array_equal(got[name], t, err_msg=name)
  by_proc = [{n for f in files[p] for n in load_file(f)} for p in (0, 1)]
  assert by_proc[0] and by_proc[1] and not by_proc[0] & by_proc[1]


def test_fp8_push_sends_block_fp8_at_about_half_the_bytes(tmp_path):
  """`WeightSyncConfig.dtype='fp8'`: the push holds the release's layout (FP8 projections + float32
  scales, bf16 rest), dequantizes to the trainer's weights within e4m3's rounding, and stores about half
  the bytes of a bfloat16 push of the same state; an unchanged re-push is skipped as before."""
  from k2jax.convert import fp8

  cfg, host = _model()
  state = _sharded(host)
  pushed = {}
  for dtype in ("bfloat16", "fp8"):
    engine = _Recorder()
    sync = WeightSync(WeightSyncConfig(str(tmp_path / dtype), dtype=dtype), engine, cfg)
    assert sync.push(state) == 1 and sync.push(state) == 1 and len(engine.updates) == 1
    pushed[dtype] = (sync.bytes_written, engine.updates[0][0])
  ratio = pushed["fp8"][0] / pushed["bfloat16"][0]
  print(f"fp8_over_bf16_push_bytes={ratio:.3f} ({pushed['fp8'][0]} / {pushed['bfloat16'][0]})")
  # Projections go from 2 bytes to 1 + 4/128^2 (their scale); embeddings, lm_head and norms stay bf16
  # (in the tiny preset they are most of the bytes; in Kimi-K2 the projections are 98%).
  linear = sum(w.size for k, w in hf_io.iter_hf_tensors(cfg, host, None) if fp8.is_quantized_key(k))
  scales = sum(
    int(np.prod(fp8.scale_shape(w.shape, (128, 128))))
    for k, w in hf_io.iter_hf_tensors(cfg, host, None)
    if fp8.is_quantized_key(k)
  )
  assert pushed["bfloat16"][0] - pushed["fp8"][0] == linear - 4 * scales and linear > 100_000
  index = json.load(open(os.path.join(pushed["fp8"][1], INDEX_NAME)))
  assert index["metadata"]["total_size"] == pushed["fp8"][0]
  import sys

  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden"))
  from fp8_export_golden import read_tensors

  got = read_tensors(pushed["fp8"][1])
  for name, w in hf_io.iter_hf_tensors(cfg, host, None):
    if fp8.is_quantized_key(name):
      assert got[name].dtype == fp8.E4M3 and got[name + "_scale_inv"].dtype == np.float32, name
      back = fp8.dequantize(got[name], got[name + "_scale_inv"])
      scale = np.repeat(np.repeat(got[name + "_scale_inv"], 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
      assert np.all(np.abs(back - w) <= np.abs(w) * 2.0**-4 + scale * 2.0**-9), name
    else:
      assert got[name].dtype == (np.float32 if name.endswith("bias") else ml_dtypes.bfloat16), name
