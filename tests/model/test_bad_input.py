"""Bad checkpoints and configs fail with errors naming the file, tensor or field; exports are atomic."""

import json
import os
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "golden"))
import hf_golden  # noqa: E402

import k2jax  # noqa: E402
from k2jax.convert.hf import CheckpointError  # noqa: E402
from k2jax.model import ConfigError, K2Config, presets  # noqa: E402

CFG = hf_golden.CONFIGS["plain_rope"]


@pytest.fixture()
def good_dir(tmp_path):
  path = str(tmp_path / "hf")
  hf_golden.write_hf_dir(path, CFG, hf_golden.random_hf_state(CFG, 2), n_shards=3)
  return path


def test_missing_shard_names_the_file(good_dir):
  os.remove(os.path.join(good_dir, "model-00002-of-00003.safetensors"))
  with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
    k2jax.load(good_dir)


def test_wrong_shape_names_the_tensor(good_dir):
  state = hf_golden.random_hf_state(CFG, 2)
  key = "model.layers.1.self_attn.kv_b_proj.weight"
  with open(os.path.join(good_dir, "model.safetensors.index.json")) as f:
    shard = json.load(f)["weight_map"][key]
  from safetensors.numpy import load_file

  tensors = load_file(os.path.join(good_dir, shard))
  tensors[key] = state[key][:, :-1].copy()
  save_file(tensors, os.path.join(good_dir, shard))
  with pytest.raises(CheckpointError, match=r"kv_b_proj.weight.*shape"):
    k2jax.load(good_dir)


def test_missing_tensor_and_truncated_shard(good_dir):
  idx = os.path.join(good_dir, "model.safetensors.index.json")
  with open(idx) as f:
    index = json.load(f)
  del index["weight_map"]["model.layers.0.mlp.experts.3.up_proj.weight"]
  with open(idx, "w") as f:
    json.dump(index, f)
  with pytest.raises(CheckpointError, match="experts.3.up_proj"):
    k2jax.load(good_dir)


def test_truncated_shard_names_the_file(good_dir):
  shard = os.path.join(good_dir, "model-00003-of-00003.safetensors")
  with open(shard, "r+b") as f:
    f.truncate(100)
  with pytest.raises(CheckpointError, match="model-00003-of-00003"):
    k2jax.load(good_dir)


def test_unsupported_architecture(good_dir):
  with open(os.path.join(good_dir, "config.json"), "w") as f:
    json.dump(dict(CFG, architectures=["LlamaForCausalLM"]), f)
  with pytest.raises(ConfigError, match="architectures.*LlamaForCausalLM"):
    k2jax.load(good_dir)


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("n_group", 3, "n_group"),  # 8 experts not divisible by 3 groups
    ("topk_group", 5, "topk_group"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("num_experts_per_tok", 99, "num_experts_per_tok"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ("scoring_func", "softmax", "scoring_func"),
    ("hidden_size", -4, "hidden_size"),
  ],
)
def test_inconsistent_config_names_the_field(field, value, match):
  with pytest.raises(ConfigError, match=match):
    K2Config.from_hf_dict(dict(CFG, **{field: value}))


def test_unknown_rope_type():
  with pytest.raises(ConfigError, match="rope_scaling.type"):
    K2Config.from_hf_dict(dict(CFG, rope_scaling={"type": "longrope", "factor": 2.0}))


def test_export_is_atomic_on_failure(tmp_path, monkeypatch):
  model = k2jax.load(_write(tmp_path))
  dst = str(tmp_path / "export")
  from k2jax.convert import st_stream

  calls = {"n": 0}
  real = st_stream.SafetensorsStream._submit

  def failing(self, *a, **k):  # the writer's file writes: the 20th block fails (mid-export)
    calls["n"] += 1
    if calls["n"] == 20:
      raise OSError("disk full")
    return real(self, *a, **k)

  monkeypatch.setattr(st_stream.SafetensorsStream, "_submit", failing)
  with pytest.raises(OSError, match="disk full"):
    k2jax.save_hf(model, dst, max_shard_bytes=50_000)
  assert not os.path.exists(dst)
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".k2jax-")]


def _write(tmp_path):
  path = str(tmp_path / "src")
  hf_golden.write_hf_dir(path, CFG, hf_golden.random_hf_state(CFG, 2))
  return path


def test_config_json_round_trip():
  published = dict(
    hf_golden.CONFIGS["k2_like"],
    transformers_version="4.51.0",
    quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
  )
  cfg = K2Config.from_hf_dict(published)
  assert cfg.rope["rope_type"] == "yarn" and cfg.rope["factor"] == 32.0
  back = cfg.to_hf_dict()
  for k, v in published.items():
    assert back[k] == v, k
  assert K2Config.from_hf_dict(back) == cfg
  # transformers >= 5 style `rope_parameters`
  v5 = dict(published)
  rs = v5.pop("rope_scaling")
  v5["rope_parameters"] = dict(
    rope_type="yarn", rope_theta=v5.pop("rope_theta"), **{k: v for k, v in rs.items() if k != "type"}
  )
  assert K2Config.from_hf_dict(v5) == cfg
  # the 1t preset is Kimi K2's published config
  k2 = presets.get("1t").to_hf_dict()
  assert (k2["n_routed_experts"], k2["num_experts_per_tok"], k2["routed_scaling_factor"]) == (384, 8, 2.827)
  assert k2["rope_scaling"]["factor"] == 32.0 and k2["rope_scaling"]["original_max_position_embeddings"] == 4096
