"""The Kimi-K2-Thinking INT4 layout in and out (k2jax/convert/int4.py through the one writer and reader):
compressed-tensors itself decompresses an export to k2jax's own dequantization and to the QAT forward's
weights, export -> import -> export is byte-identical, each host's slices dequantize exactly, and input
that is not the release's layout is refused naming what is wrong."""

import functools
import hashlib
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "golden"))
import fp8_export_golden  # noqa: E402

from k2jax import sharding  # noqa: E402
from k2jax.convert import int4, writer  # noqa: E402
from k2jax.convert.errors import CheckpointError  # noqa: E402
from k2jax.convert.hf import abstract_state, load_hf, read_state  # noqa: E402
from k2jax.model import int4 as grid  # noqa: E402
from k2jax.model import presets  # noqa: E402

CFG = presets.get("tiny")
EXPERT = "model.layers.1.mlp.experts.3.down_proj."


@functools.cache
def _host():
  state = fp8_export_golden.host_state(CFG)
  state["moe_layers"]["moe"]["experts"]["w_down"][0, 3, :32, 5] = 0.0  # an all-zero group (HF row 5, group 0)
  return state


@pytest.fixture(scope="module")
def export(tmp_path_factory):
  dst = str(tmp_path_factory.mktemp("int4") / "hf")
  writer.save_hf(CFG, _host(), dst, dtype="int4", max_shard_bytes=60_000)
  return dst


def _tensors(path):
  out = {}
  for f in sorted(os.listdir(path)):
    if f.endswith(".safetensors"):
      out.update(load_file(os.path.join(path, f)))
  return out


def test_export_has_the_release_layout(export):
  cfg = json.load(open(os.path.join(export, "config.json")))
  assert cfg["quantization_config"] == int4.release_config() and cfg["torch_dtype"] == "bfloat16"
  qc = cfg["quantization_config"]
  assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32 and qc["format"] == "pack-quantized"
  index = json.load(open(os.path.join(export, writer.INDEX)))["weight_map"]
  t = _tensors(export)
  assert set(index) == set(t)
  experts = [k for k in t if ".mlp.experts." in k]
  assert len(experts) == 3 * 3 * CFG.num_moe_layers * CFG.n_routed_experts and not any(
    k.endswith(".weight") for k in experts
  )
  D, F = CFG.hidden_size, CFG.moe_intermediate_size
  assert t[EXPERT + "weight_packed"].dtype == np.int32 and t[EXPERT + "weight_packed"].shape == (D, F // 8)
  assert t[EXPERT + "weight_scale"].dtype == ml_dtypes.bfloat16 and t[EXPERT + "weight_scale"].shape == (D, F // 32)
  np.testing.assert_array_equal(t[EXPERT + "weight_shape"], np.array([D, F], np.int32))
  assert t["model.layers.1.mlp.experts.0.gate_proj.weight_packed"].shape == (F, D // 8)
  for k in ("model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"):
    assert t[k].dtype == ml_dtypes.bfloat16  # attention, shared experts, dense layers, head: unquantized
  assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32
  for triplet in (int4.triplet(k[: -len("weight_packed")] + "weight") for k in experts if k.endswith("_packed")):
    assert len({index[k] for k in triplet}) == 1  # each triplet in one shard


def test_compressed_tensors_decompresses_the_export_to_k2jax_dequantization_and_the_qat_weights(export):
  """Independent check: compressed-tensors' own unpack and dequantize (PyTorch, CPU), read with
  safetensors' torch loader, against the QAT forward's fake-quantized master weights."""
  torch = pytest.importorskip("torch")
  from compressed_tensors.compressors import unpack_from_int32
  from compressed_tensors.quantization import QuantizationArgs
  from compressed_tensors.quantization.lifecycle.forward import dequantize
  from safetensors.torch import load_file as torch_load

  args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
  t = {}
  for f in sorted(os.listdir(export)):
    if f.endswith(".safetensors"):
      t.update(torch_load(os.path.join(export, f)))
  experts = _host()["moe_layers"]["moe"]["experts"]
  fq = {p: np.asarray(grid.fake_quant(jnp.asarray(experts[f"w_{p}"]))) for p in ("gate", "up", "down")}
  assert np.all(fq["down"][0, 3, :32, 5] == 0)
  for l in range(CFG.num_moe_layers):
    for e in range(CFG.n_routed_experts):
      for p in ("gate", "up", "down"):
        base = f"model.layers.{l + 1}.mlp.experts.{e}.{p}_proj."
        shape = torch.Size(t[base + "weight_shape"].tolist())
        q = unpack_from_int32(t[base + "weight_packed"], 4, shape)
        w_ct = dequantize(q, t[base + "weight_scale"], args=args)
        assert w_ct.dtype == torch.bfloat16
        ct = w_ct.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        ours = int4.dequantize(
          int4.unpack(t[base + "weight_packed"].numpy(), shape[1]),
          t[base + "weight_scale"].view(torch.int16).numpy().view(ml_dtypes.bfloat16),
          ml_dtypes.bfloat16,
        )
        np.testing.assert_array_equal(ct.view(np.uint16), ours.view(np.uint16))
        want = fq[p][l, e].T.astype(ml_dtypes.bfloat16)  # the QAT forward's weight, HF [out, in]
        np.testing.assert_array_equal(ct.view(np.uint16), want.view(np.uint16))


def test_pack_matches_compressed_tensors_and_the_worked_example():
  torch = pytest.importorskip("torch")
  from compressed_tensors.compressors import pack_to_int32

  q = np.array([[1, -2, 3, -4, 5, -6, 7, 0]], np.int8)
  assert int(int4.pack(q)[0, 0]) == -1892856983  # 0x8F2D4B69 (../shared/reference/int4-qat.md §2.3)
  q = np.random.default_rng(0).integers(-7, 8, (5, 44)).astype(np.int8)  # a ragged last word
  np.testing.assert_array_equal(int4.pack(q), pack_to_int32(torch.from_numpy(q), 4).numpy())
  np.testing.assert_array_equal(int4.unpack(int4.pack(q), 44), q)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_host_quantize_is_the_model_grid_bitwise(dtype):
  w = (np.random.default_rng(2).standard_normal((2, 96, 40)) * 0.03).astype(dtype)
  w[0, 32:64, 1] = 0
  q_j, s_j = grid.quantize(jnp.asarray(w))
  for i in range(2):
    q, s = int4.quantize(w[i].T)
    np.testing.assert_array_equal(q, np.asarray(q_j[i]).T)
    np.testing.assert_array_equal(s.view(np.uint16), np.asarray(s_j[i]).T.view(np.uint16))


def test_export_import_export_is_byte_identical(export, tmp_path):
  cfg, state = load_hf(export)
  assert cfg.param_dtype == "float32"
  w = state["moe_layers"]["moe"]["experts"]["w_down"]
  np.testing.assert_array_equal(
    w, np.asarray(grid.fake_quant(jnp.asarray(_host()["moe_layers"]["moe"]["experts"]["w_down"])))
  )
  again = str(tmp_path / "again")
  writer.save_hf(cfg, state, again, dtype="int4", max_shard_bytes=60_000)
  names = sorted(f for f in os.listdir(export) if f.endswith((".safetensors", ".json")))
  assert names == sorted(f for f in os.listdir(again) if f.endswith((".safetensors", ".json")))
  digest = lambda d, f: hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()  # noqa: E731
  assert [digest(export, f) for f in names] == [digest(again, f) for f in names]


def test_each_host_slice_dequantizes_as_the_whole_tensor(export):
  """Experts split 8 ways along their input axis: down_proj's 32 inputs in 4-wide slices (not even a whole
  packed word), gate/up's 64 in 8-wide ones (not a whole group)."""
  cfg, whole = load_hf(export)
  mesh = sharding.make_mesh({"fsdp": 8})

  def spec(path, x):
    split = "experts" in jax.tree_util.keystr(path)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(None, None, "fsdp") if split else P()))

  abstract = jax.tree_util.tree_map_with_path(spec, abstract_state(cfg))
  state = read_state(export, cfg, abstract)
  for p in ("gate", "up", "down"):
    got = state["moe_layers"]["moe"]["experts"][f"w_{p}"]
    assert len(got.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(got), whole["moe_layers"]["moe"]["experts"][f"w_{p}"])


def _edited(export, tmp_path, qc_edit=None, tensor_edit=None):
  dst = str(tmp_path / "edited")
  shutil.copytree(export, dst)
  if qc_edit is not None:
    path = os.path.join(dst, "config.json")
    cfg = json.load(open(path))
    qc_edit(cfg["quantization_config"])
    json.dump(cfg, open(path, "w"))
  if tensor_edit is not None:
    name, fn = tensor_edit
    shard = json.load(open(os.path.join(dst, writer.INDEX)))["weight_map"][name]
    t = load_file(os.path.join(dst, shard))
    t[name] = fn(t[name])
    save_file(t, os.path.join(dst, shard))
  return dst


def _weights(qc):
  return qc["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
  "edit,match",
  [
    (lambda qc: _weights(qc).update(group_size=128), r"weights\.group_size=128 is not the Kimi-K2-Thinking INT4"),
    (lambda qc: _weights(qc).update(num_bits=8), r"weights\.num_bits=8"),
    (lambda qc: _weights(qc).update(symmetric=False), r"weights\.symmetric=False"),
    (lambda qc: qc.update(format="int-quantized"), r"quantization_config\.format='int-quantized'"),
    (lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), r"input_activations="),
    (lambda qc: qc.update(quant_method="awq"), r"quant_method='awq' is not supported"),
  ],
)
def test_a_quantization_config_that_is_not_the_release_is_refused(export, tmp_path, edit, match):
  with pytest.raises(CheckpointError, match=r"config\.json: .*" + match):
    load_hf(_edited(export, tmp_path, qc_edit=edit))


def test_a_packed_tensor_of_the_wrong_shape_is_refused_naming_it(export, tmp_path):
  bad = _edited(export, tmp_path, tensor_edit=(EXPERT + "weight_packed", lambda a: a[:, :-1].copy()))
  with pytest.raises(CheckpointError, match=rf"{EXPERT}weight_packed' is I32 \[64, 3\], expected I32 \[64, 4\]"):
    load_hf(bad)
  bad = _edited(export, tmp_path / "s", tensor_edit=(EXPERT + "weight_scale", lambda a: a.astype(np.float32)))
  with pytest.raises(CheckpointError, match=r"weight_scale' is F32 \[64, 1\], expected BF16"):
    load_hf(bad)


def test_codes_off_the_release_grid_are_refused(export, tmp_path):
  """Code -8 (nibble 0) never occurs on the amax/7 grid: such a file was quantized on another grid."""

  def zero_word(a):
    a = a.copy()
    a[0, 0] = 0
    return a

  with pytest.raises(CheckpointError, match=r"holds code -8 \(nibble 0\): not on the release's amax/7 grid"):
    load_hf(_edited(export, tmp_path, tensor_edit=(EXPERT + "weight_packed", zero_word)))


@pytest.mark.slow
def test_convert_cli_round_trips_the_int4_layout_through_a_sharded_workdir(export, tmp_path):
  """launch/convert.py: INT4 release -> workdir (float32 masters, sharded over 2 devices) -> --dtype=int4
  export: the same bytes as the in-process export it started from."""
  import subprocess

  from tests.xla_flags import xla_flags

  root = os.path.dirname(os.path.dirname(HERE))
  w, hf = str(tmp_path / "w"), str(tmp_path / "hf")
  env = {**os.environ, "PYTHONPATH": root, "XLA_FLAGS": xla_flags(2)}
  for args in ([f"--src={export}", f"--dst={w}"], [f"--src={w}", f"--dst={hf}", "--dtype=int4"]):
    cmd = [sys.executable, "launch/convert.py", *args, "--mesh=fsdp=2"]
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
  a, b = _tensors(hf), _tensors(export)
  assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in b)
  assert json.load(open(os.path.join(hf, "config.json")))["quantization_config"] == int4.release_config()


@pytest.mark.slow
def test_the_export_loads_in_transformers_with_its_experts_decompressed(export):
  """transformers 5.x (compressed-tensors' CPU decompression, fused DeepseekV3Experts) loads the INT4 export:
  every routed expert equals k2jax's dequantization rounded to bf16 (the scale dtype), and it runs."""
  transformers = pytest.importorskip("transformers")
  import torch

  model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
  _, state = load_hf(export)
  experts = state["moe_layers"]["moe"]["experts"]
  bf16 = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
  for l in range(CFG.num_moe_layers):
    tf = model.model.layers[CFG.num_dense_layers + l].mlp.experts
    gate_up = np.concatenate([experts["w_gate"][l], experts["w_up"][l]], axis=-1).transpose(0, 2, 1)
    np.testing.assert_array_equal(tf.gate_up_proj.detach().float().numpy(), bf16(gate_up))
    np.testing.assert_array_equal(tf.down_proj.detach().float().numpy(), bf16(experts["w_down"][l].transpose(0, 2, 1)))
  logits = model(torch.tensor([[1, 2, 3, 4]])).logits
  assert logits.shape == (1, 4, CFG.vocab_size) and bool(torch.isfinite(logits).all())
