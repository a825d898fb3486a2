"""The sharded HF reader on the release's block-FP8 layout: bitwise equal to the format's equation in
numpy, logits equal to the dequantized bf16 twin, onto a mesh equal to the one-host read, and every bad
input a CheckpointError naming the file and tensor."""

import json
import os

import ml_dtypes
import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import k2jax
from k2jax import sharding
from k2jax.convert import fp8, reader
from k2jax.convert import hf as hf_io
from k2jax.convert.errors import CheckpointError
from k2jax.convert.layout import entries
from k2jax.convert.safetensors_io import STATS, read_header
from k2jax.data.tokenizer import load_tokenizer
from k2jax.model import K2Model
from tests.convert import kimi_dir

CFG = kimi_dir.CFG


@pytest.fixture(scope="module")
def fp8_state():
  return kimi_dir.quantized_state(CFG, 0)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory, fp8_state):
  return kimi_dir.write_dir(str(tmp_path_factory.mktemp("kimi") / "hf"), CFG, fp8_state)


def _expect(cfg, ref: dict, entry, idx, key):
  t = ref[key]
  return t.T if entry.transpose else t


def test_fp8_loads_bitwise_equal_to_numpy_dequantization(fp8_dir, fp8_state):
  assert fp8_state[kimi_dir.ZERO_KEY + fp8.SCALE_SUFFIX][0, 0] == 1.0  # the all-zero block's guard scale
  kv_a = fp8_state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
  assert kv_a.shape == (144, 192) and fp8_state[
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
  ].shape == (2, 2)
  ref = kimi_dir.dequantized(fp8_state)
  cfg, state = hf_io.load_hf(fp8_dir)
  assert cfg.model_type == "kimi_k2" and "quantization_config" not in dict(cfg.extra)
  n = 0
  for entry in entries(cfg):
    leaf = hf_io.get_path(state, entry.path)
    assert leaf.dtype == np.float32, entry.path
    for idx, key in entry.keys(cfg):
      want = _expect(cfg, ref, entry, idx, key)
      assert leaf[idx].tobytes() == want.tobytes(), key
      n += 1
  assert n == len(ref)
  bias = state["moe_layers"]["moe"]["router"]["bias"]
  assert (
    bias.dtype == np.float32
    and bias[0].tobytes() == fp8_state["model.layers.1.mlp.gate.e_score_correction_bias"].tobytes()
  )
  zero = state["moe_layers"]["moe"]["experts"]["w_gate"][0, 2]  # [in, out] of ZERO_KEY
  assert np.all(zero[:128, :48] == 0) and np.all(np.isfinite(zero))


@pytest.mark.slow  # compile-bound
def test_sharded_read_equals_host_read_and_bf16_params(fp8_dir, monkeypatch):
  """Onto 8 devices with `fsdp_ep` (slices not 128-aligned: kv_lora 136 / 2 = 68), and cast to bf16;
  every block converted on the device (`_convert`), as a real model's large blocks are."""
  monkeypatch.setattr(reader, "DEVICE_CONVERT_BYTES", 0)
  monkeypatch.setattr(reader, "HOST_CONVERT_PLATFORMS", ())
  _, host = hf_io.load_hf(fp8_dir)
  cfg = hf_io.read_config(fp8_dir, param_dtype="bfloat16")
  mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
  shardings = _shardings(cfg, mesh)
  got = k2jax.api.source_state(fp8_dir, cfg, shardings, read_budget_bytes=4096)  # expert slices arrive in pieces
  for path, leaf in _flat(got):
    assert leaf.sharding == _get(shardings, path), path
    want = _get(host, path)
    want = want if path[-1] == "bias" else want.astype(ml_dtypes.bfloat16)
    assert leaf.dtype == want.dtype and np.asarray(leaf).tobytes() == want.tobytes(), path


@pytest.mark.slow  # compile-bound
def test_fp8_logits_equal_dequantized_bf16_twin(fp8_dir, fp8_state, tmp_path):
  ref = kimi_dir.dequantized(fp8_state)
  twin = {k: (v if k.endswith("correction_bias") else v.astype(ml_dtypes.bfloat16)) for k, v in ref.items()}
  twin_dir = kimi_dir.write_dir(str(tmp_path / "twin"), CFG, twin, n_shards=2)
  ids = np.random.default_rng(0).integers(0, CFG["vocab_size"], (2, 16)).astype(np.int32)
  a = k2jax.load(fp8_dir, param_dtype="bfloat16")(ids).logits
  b = k2jax.load(twin_dir, param_dtype="bfloat16")(ids).logits
  assert float(np.abs(np.asarray(b)).max()) > 1.0
  np.testing.assert_array_less(np.abs(np.asarray(a) - np.asarray(b)).max(), 1e-5)


def test_budget_bounds_reads_in_flight_and_counts_every_byte(fp8_dir):
  """A 4 KiB budget still reads everything (one block at a time); the counter sees every tensor byte."""
  inv_freq = sum(t.nbytes for f in _shards(fp8_dir) for k, t in read_header(f).items() if "inv_freq" in k)
  STATS.reset()
  _, a = hf_io.load_hf(fp8_dir)
  total = sum(os.path.getsize(f) for f in _shards(fp8_dir))
  assert STATS.data_bytes == total - STATS.header_bytes - inv_freq  # each byte once; the stale buffer never
  cfg = hf_io.read_config(fp8_dir)
  b = k2jax.api.source_state(fp8_dir, cfg, read_budget_bytes=4096)
  for path, leaf in _flat(b):
    assert np.asarray(leaf).tobytes() == _get(a, path).tobytes(), path


def test_kimi_tokenizer_files_load_as_published(fp8_dir):
  tok = load_tokenizer(fp8_dir)  # the directory: its tiktoken.model + tokenizer_config.json
  assert tok.path == os.path.join(fp8_dir, "tiktoken.model") and tok.vocab_size == CFG["vocab_size"]
  n = tok.num_base_tokens
  assert tok.special_ids["<|im_user|>"] == n + 3 and tok.special_ids["[PAD]"] == n + 254
  import jinja2

  with open(os.path.join(fp8_dir, "tokenizer_config.json")) as f:
    template = jinja2.Environment().from_string(json.load(f)["chat_template"])
  text = template.render(messages=[{"role": "user", "content": "hi there"}], add_generation_prompt=True)
  ids = tok.encode_with_specials(text)
  assert ids[0] == tok.special_ids["<|im_user|>"] and ids[-1] == tok.special_ids["<|im_middle|>"]
  assert tok.decode(ids) == text
  assert not os.path.exists(os.path.join(fp8_dir, "tokenizer.json"))


def _have_transformers_fp8():
  try:
    import accelerate  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    return True
  except ImportError:
    return False


# Every dim a multiple of 128 or under 128: transformers 5.24's Fp8Dequantize derives the block from the
# scale grid (rows // grid_rows), so a ragged dim over 128 (Kimi's 576-row kv_a, hidden 192 here) is
# refused when it does not divide and misread when it does (192 / 2 -> 96-wide blocks); k2jax reads both.
ALIGNED = dict(
  CFG,
  hidden_size=256,
  q_lora_rank=128,
  kv_lora_rank=120,
  v_head_dim=16,
  intermediate_size=384,
  moe_intermediate_size=64,
  vocab_size=512,
  model_type="deepseek_v3",
)


@pytest.mark.slow
@pytest.mark.skipif(not _have_transformers_fp8(), reason="torch/transformers/accelerate not installed")
def test_transformers_loads_the_same_fp8_directory(tmp_path):
  """transformers 5.x on CPU dequantizes FP8 checkpoints itself (no GPU: dequantize=True): its weights
  equal k2jax's bitwise and its logits agree."""
  import torch
  import transformers

  path = kimi_dir.write_dir(str(tmp_path / "hf"), ALIGNED, kimi_dir.quantized_state(ALIGNED, 5), kimi=False)
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(path, "config.json"), "w") as f:  # deepseek_v3: no remote code needed
    json.dump(dict(config, quantization_config=kimi_dir.KIMI_KEYS["quantization_config"]), f)
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
  cfg, state = hf_io.load_hf(path)
  theirs = model.state_dict()
  checked = 0
  for entry in entries(cfg):
    for idx, key in entry.keys(cfg):
      mine = hf_io.get_path(state, entry.path)[idx]
      if "experts." in key and ".shared_experts." not in key:
        continue  # transformers 5 fuses routed experts into one parameter per layer
      t = theirs[key].detach().numpy()
      assert (t.T if entry.transpose else t).tobytes() == mine.tobytes(), key
      checked += int(fp8.is_quantized_key(key))
  assert checked >= 14  # every attention, dense and shared-expert projection
  ids = np.random.default_rng(0).integers(0, ALIGNED["vocab_size"], (2, 16))
  with torch.no_grad():
    ref = model(torch.from_numpy(ids)).logits.numpy()
  out = np.asarray(k2jax.load(path)(ids.astype(np.int32)).logits)
  assert np.abs(ref).max() > 1.0
  np.testing.assert_array_less(np.abs(out - ref).max(), 1e-4)


# ---------------------------------------------------------------------------------------------- bad input


def _rewrite(path, key, fn):
  """Apply `fn(tensors)` to the shard holding `key`."""
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    shard = os.path.join(path, json.load(f)["weight_map"][key])
  tensors = kimi_dir.load_shard(shard)
  fn(tensors)
  save_file(tensors, shard)
  return shard


def _config(path, **kw):
  with open(os.path.join(path, "config.json")) as f:
    cfg = json.load(f)
  cfg["quantization_config"] = dict(cfg["quantization_config"], **kw)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)


KEY = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
SCALE = KEY + fp8.SCALE_SUFFIX


def _drop_scale(p):
  _rewrite(p, SCALE, lambda t: t.pop(SCALE))
  idx = os.path.join(p, "model.safetensors.index.json")
  with open(idx) as f:
    index = json.load(f)
  del index["weight_map"][SCALE]
  with open(idx, "w") as f:
    json.dump(index, f)


def _truncate(p):
  shard = os.path.join(p, "model-2-of-3.safetensors")
  with open(shard, "r+b") as f:
    f.truncate(os.path.getsize(shard) - 10)


BAD = {
  "missing scale": (_drop_scale, rf"{KEY}.*scale.*missing"),
  "misshapen scale": (
    lambda p: _rewrite(p, SCALE, lambda t: t.update({SCALE: np.ones((1, 2), np.float32)})),
    rf"weight_scale_inv.*\[1, 2\], expected F32 \[2, 2\]",
  ),
  "bf16 scale": (
    lambda p: _rewrite(p, SCALE, lambda t: t.update({SCALE: t[SCALE].astype(ml_dtypes.bfloat16)})),
    "weight_scale_inv.*BF16",
  ),
  "unknown quant_method": (lambda p: _config(p, quant_method="awq"), r"config.json.*quant_method='awq'"),
  "bad block size": (lambda p: _config(p, weight_block_size=[128]), r"config.json.*weight_block_size"),
  "truncated shard": (_truncate, r"model-2-of-3.safetensors.*truncated"),
  "bf16 where fp8": (
    lambda p: _rewrite(p, KEY, lambda t: t.update({KEY: t[KEY].astype(np.float32).astype(ml_dtypes.bfloat16)})),
    rf"{KEY}.*BF16.*quantization_config",
  ),
  "fp8 without quantization_config": (lambda p: _no_quant(p), rf"F8_E4M3.*no quantization_config"),
}


def _no_quant(p):
  with open(os.path.join(p, "config.json")) as f:
    cfg = json.load(f)
  del cfg["quantization_config"]
  with open(os.path.join(p, "config.json"), "w") as f:
    json.dump(cfg, f)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_file_and_tensor(case, fp8_state, tmp_path):
  path = kimi_dir.write_dir(str(tmp_path / "hf"), CFG, fp8_state)
  corrupt, match = BAD[case]
  corrupt(path)
  STATS.reset()
  with pytest.raises(CheckpointError, match=match):
    hf_io.load_hf(path)
  assert STATS.data_bytes == 0  # validated before the first tensor byte is read


def _shards(path):
  return [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]


def _shardings(cfg, mesh):
  from flax import nnx

  abstract = nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))
  return nnx.to_pure_dict(sharding.param_shardings(nnx.state(abstract), mesh, "fsdp_ep"))


def _flat(tree, prefix=()):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flat(v, prefix + (k,))
    else:
      yield prefix + (k,), v


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def test_overlay_applies_an_fp8_weight_push(fp8_dir, tmp_path):
  """A weight-sync delta in block-FP8 (index + shard, no config.json) is dequantized onto the served state."""
  from k2jax.convert import overlay

  cfg, state = hf_io.load_hf(fp8_dir)
  key = "model.layers.1.mlp.experts.5.down_proj.weight"
  w = np.random.default_rng(7).standard_normal((CFG["hidden_size"], CFG["moe_intermediate_size"])).astype(np.float32)
  q, s = fp8.quantize(w)
  delta = tmp_path / "v1"
  delta.mkdir()
  save_file({key: q, key + fp8.SCALE_SUFFIX: s}, str(delta / "model-p00000-00001.safetensors"))
  with open(delta / "model.safetensors.index.json", "w") as f:
    json.dump({"metadata": {}, "weight_map": {key: "model-p00000-00001.safetensors"}}, f)
  assert overlay.is_partial_hf_dir(str(delta))
  new = overlay.overlay_hf_tensors(cfg, state, str(delta))
  got = new["moe_layers"]["moe"]["experts"]["w_down"][0, 5]
  assert got.tobytes() == fp8.dequantize(q, s).T.tobytes()
  assert (
    new["moe_layers"]["moe"]["experts"]["w_down"][0, 4].tobytes()
    == state["moe_layers"]["moe"]["experts"]["w_down"][0, 4].tobytes()
  )


def test_overlay_on_sharded_arrays_writes_each_shard_and_keeps_the_sharding(fp8_dir, tmp_path):
  """The same push onto a state sharded over 8 devices (fsdp_ep): the replaced leaves keep their
  shardings, each shard is rewritten from the tensors that fall in it, and the result equals the host
  overlay; untouched leaves are the very same arrays."""
  from k2jax.convert import overlay

  cfg, state = hf_io.load_hf(fp8_dir)
  rng = np.random.default_rng(11)
  tensors = {
    "model.layers.1.mlp.experts.6.up_proj.weight": (CFG["moe_intermediate_size"], CFG["hidden_size"]),
    "model.layers.1.self_attn.o_proj.weight": None,
    "model.norm.weight": None,
  }
  host = {k: np.asarray(v) for k, v in hf_io.iter_hf_tensors(cfg, state, None) if k in tensors}
  push = {k: rng.standard_normal(host[k].shape).astype(np.float32) for k in tensors}
  delta = tmp_path / "v1"
  delta.mkdir()
  save_file(push, str(delta / "model-p00000-00001.safetensors"))
  with open(delta / "model.safetensors.index.json", "w") as f:
    json.dump({"metadata": {}, "weight_map": {k: "model-p00000-00001.safetensors" for k in push}}, f)

  mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
  sharded = jax.device_put(state, _shardings(cfg, mesh))
  want = overlay.overlay_hf_tensors(cfg, state, str(delta))
  got = overlay.overlay_hf_tensors(cfg, sharded, str(delta))
  changed = {("moe_layers", "moe", "experts", "w_up"), ("moe_layers", "attn", "w_o"), ("final_norm", "scale")}
  for path, x in _flat(got):
    old = _get(sharded, path)
    assert x.sharding == old.sharding, path
    np.testing.assert_array_equal(np.asarray(x), np.asarray(_get(want, path)), err_msg=str(path))
    assert (x is old) == (path not in changed), path
  np.testing.assert_array_equal(
    np.asarray(_get(got, ("moe_layers", "moe", "experts", "w_up")))[0, 6],
    push["model.layers.1.mlp.experts.6.up_proj.weight"].T.astype(
      np.asarray(_get(state, ("moe_layers", "moe", "experts", "w_up"))).dtype
    ),
  )


@pytest.mark.slow  # compile-bound (optimizer init)
def test_init_from_the_fp8_release_layout_onto_a_training_mesh(fp8_dir):
  """`init_from=<Kimi FP8 dir>` (pretraining/SFT `checkpoint.init_from`, RL `model.init_from`): the
  architecture comes from its config.json, the step-0 params from the reader, straight onto the mesh."""
  from k2jax.model import presets
  from k2jax.optim import QKClipSpec, muonclip
  from k2jax.train import core
  from k2jax.train.init_from import initial_state, resolve_model

  cfg = resolve_model(presets.get("tiny"), fp8_dir, key="checkpoint.init_from")
  assert (cfg.hidden_size, cfg.model_type) == (CFG["hidden_size"], "kimi_k2")
  opt = muonclip(1e-2, qk_clip_spec=QKClipSpec.from_config(cfg))
  lay = core.layout(cfg, opt, mesh=sharding.make_mesh({"fsdp": 2, "expert": 4}), preset="fsdp_ep", seed=0)
  state = initial_state(cfg, fp8_dir, lay.make, opt, lay.shardings, read_budget_bytes=1 << 16)
  _, host = hf_io.load_hf(fp8_dir)
  for path, want in _flat(host):
    tree = state.bias if path[-1] == "bias" else state.params
    assert np.asarray(_get(tree, path)).tobytes() == want.tobytes(), path


def test_cpu_blocks_filled_in_place_equal_host_read(fp8_dir, monkeypatch):
  """Onto CPU devices every block is built in one host buffer the device aliases: row slabs transposed,
  FP8 dequantized by XLA in groups (sizes forced small: several slabs per tensor, not tile multiples,
  groups of 3 experts with a partial one), bitwise equal to `load_hf`, also for unaligned fsdp slices."""
  monkeypatch.setattr(reader, "DEVICE_CONVERT_BYTES", 0)
  monkeypatch.setattr(reader, "SLAB_BYTES", 1000)
  monkeypatch.setattr(reader, "XLA_GROUP_ELEMS", 3 * CFG["moe_intermediate_size"] * CFG["hidden_size"])
  _, host = hf_io.load_hf(fp8_dir)
  mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
  for dtype, on_mesh in (("float32", False), ("bfloat16", True)):
    cfg = hf_io.read_config(fp8_dir, param_dtype=dtype)
    got = k2jax.api.source_state(fp8_dir, cfg, _shardings(cfg, mesh) if on_mesh else None)
    for path, leaf in _flat(got):
      want = _get(host, path)
      want = want if path[-1] == "bias" else want.astype(dtype)
      assert leaf.dtype == want.dtype and np.asarray(leaf).tobytes() == want.tobytes(), (dtype, path)
