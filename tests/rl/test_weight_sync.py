"""Weight sync: delta safetensors + /update_weights_from_disk, monotonically increasing versions."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from k2jax.engine.fake import FakeEngine, FakeEngineConfig
from k2jax.engine.http import HttpEngine, HttpEngineConfig
from k2jax.transport import RequestRejected, RetryPolicy
from k2jax.rl.weight_sync import INDEX_NAME, WeightSync, WeightSyncConfig

from tests.engine.fake_sglang_server import FakeSglangServer


def _params():
  rng = np.random.default_rng(0)
  return {
    "model.embed_tokens.weight": rng.normal(size=(16, 8)).astype(np.float32),
    "model.layers.0.self_attn.o_proj.weight": rng.normal(size=(8, 8)).astype(ml_dtypes.bfloat16),
    "lm_head.weight": rng.normal(size=(16, 8)).astype(np.float32),
  }


def test_delta_push_over_http(tmp_path):
  with FakeSglangServer(FakeEngine(FakeEngineConfig(), lambda r: 1)) as server:
    sync = WeightSync(
      WeightSyncConfig(str(tmp_path), max_shard_bytes=600, keep_last=2),
      HttpEngine(HttpEngineConfig(server.url, retry=RetryPolicy(max_retries=0))),
    )
    params = _params()
    assert sync.push(params) == 1
    assert server.loaded[-1][1:] == (1, sorted(params))  # first push is full
    assert sync.push(params) == 1 and len(server.loaded) == 1  # nothing changed: no update
    params["lm_head.weight"] = params["lm_head.weight"] + 1
    assert sync.push(params) == 2
    path, version, names = server.loaded[-1]
    assert (version, names) == (2, ["lm_head.weight"])
    np.testing.assert_array_equal(
      load_file(os.path.join(path, "model-00001-of-00001.safetensors"))["lm_head.weight"], params["lm_head.weight"]
    )
    index = json.load(open(os.path.join(path, INDEX_NAME)))
    assert index["weight_map"] == {"lm_head.weight": "model-00001-of-00001.safetensors"}
    assert sync.push(params, full=True) == 3 and server.loaded[-1][2] == sorted(params)
    # Full push of 1.3 KB split into <=600-byte shards; only the newest keep_last versions remain.
    full = json.load(open(os.path.join(server.loaded[-1][0], INDEX_NAME)))
    assert len(set(full["weight_map"].values())) == 3
    assert sorted(os.listdir(tmp_path)) == ["v00000002", "v00000003"]
    out = load_file(os.path.join(server.loaded[-1][0], full["weight_map"]["model.layers.0.self_attn.o_proj.weight"]))[
      "model.layers.0.self_attn.o_proj.weight"
    ]
    assert out.dtype == ml_dtypes.bfloat16


def test_failed_update_rolls_back(tmp_path):
  class Failing(FakeEngine):
    def update_weights(self, model_path, weight_version):
      raise RequestRejected(f"{model_path}: refused")

  sync = WeightSync(WeightSyncConfig(str(tmp_path)), Failing(FakeEngineConfig(), lambda r: 1))
  with pytest.raises(RequestRejected):
    sync.push(_params())
  assert sync.version == 0 and os.listdir(tmp_path) == []
  with pytest.raises(ValueError, match="missing"):
    good = WeightSync(WeightSyncConfig(str(tmp_path / "b")), FakeEngine(FakeEngineConfig(), lambda r: 1))
    good.push(_params())
    good.push({"lm_head.weight": np.zeros((16, 8), np.float32)})
