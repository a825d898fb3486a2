"""The one HF writer (`k2jax.convert.writer`): block-FP8 in the published layout, bounded by e4m3's
rounding, refused for NaN weights with nothing written; sharded and two-process exports equal the
one-process export tensor for tensor, and the two-process export loads in transformers."""

import functools
import hashlib
import json
import os
import socket
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "golden"))
import fp8_export_golden  # noqa: E402

from k2jax import sharding  # noqa: E402
from k2jax.api import model_from_state  # noqa: E402
from k2jax.convert import fp8, writer  # noqa: E402
from k2jax.convert.errors import CheckpointError  # noqa: E402
from k2jax.convert.hf import abstract_state  # noqa: E402
from k2jax.convert.hf_dir import get_path  # noqa: E402
from k2jax.model import K2Model, presets  # noqa: E402
from tests.xla_flags import xla_flags

CFG = presets.get("tiny", **fp8_export_golden.CONFIG)
ZERO_BLOCK = ("moe_layers", "attn", "w_kv_a")  # HF kv_a_proj_with_mqa [192, 192]: block (1, 0) zeroed


@functools.cache
def _host():
  state = fp8_export_golden.host_state(CFG)
  w = state[ZERO_BLOCK[0]][ZERO_BLOCK[1]][ZERO_BLOCK[2]]  # k2jax [L, in, out]: HF rows are `out`
  w[0, :128, 128:] = 0.0
  return state


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory):
  dst = str(tmp_path_factory.mktemp("fp8"))
  writer.save_hf(CFG, _host(), dst, dtype="fp8", max_shard_bytes=100_000)
  return dst


def test_fp8_export_has_the_published_keys_dtypes_and_scale_shapes(fp8_export):
  with open(fp8_export_golden.GOLDEN) as f:
    golden = json.load(f)
  assert golden["config"] == fp8_export_golden.CONFIG
  assert fp8_export_golden.key_list(fp8_export) == golden["tensors"]
  config = json.load(open(os.path.join(fp8_export, "config.json")))
  assert config["quantization_config"] == golden["quantization_config"] == fp8.QuantConfig().to_hf()
  assert "modules_to_not_convert" not in config and config["torch_dtype"] == "bfloat16"
  for name, dtype, shape in golden["tensors"]:  # the layout rule, not only the list
    if fp8.is_quantized_key(name):
      assert dtype == "F8_E4M3", name
      scale = next(t for t in golden["tensors"] if t[0] == name + "_scale_inv")
      assert scale[1:] == ["F32", [-(-shape[0] // 128), -(-shape[1] // 128)]], name
    elif not name.endswith("_scale_inv"):
      assert dtype == ("F32" if name.endswith("e_score_correction_bias") else "BF16"), name
  index = json.load(open(os.path.join(fp8_export, writer.INDEX)))
  assert sorted(index["weight_map"]) == sorted(t[0] for t in golden["tensors"])
  assert len(set(index["weight_map"].values())) > 1


def test_fp8_export_loads_back_within_e4m3_rounding(fp8_export):
  got = fp8_export_golden.read_tensors(fp8_export)
  want = dict(writer.iter_hf_tensors(CFG, _host(), None))  # float32, HF layout
  n_quantized = 0
  for name, w in want.items():
    if not fp8.is_quantized_key(name):
      expect = w if name.endswith("e_score_correction_bias") else w.astype(ml_dtypes.bfloat16)
      assert got[name].dtype == expect.dtype and got[name].tobytes() == expect.tobytes(), name
      continue
    q, s = got[name], got[name + "_scale_inv"]
    assert np.all(np.isfinite(s)) and np.all(s > 0), name
    back = fp8.dequantize(q, s)
    sub = np.repeat(np.repeat(s, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]] * 2.0**-9  # subnormal step
    assert np.all(np.abs(back - w) <= np.abs(w) * 2.0**-4 + sub), name  # 3 mantissa bits: half-ulp 2**-4
    assert np.abs(back - w).max() > 0, name  # really rounded
    n_quantized += 1
  assert n_quantized == sum(fp8.is_quantized_key(k) for k in want) > 20
  zero = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # the all-zero block: scale 1, zero codes
  assert got[zero + "_scale_inv"][1, 0] == 1.0 and not np.any(got[zero][128:, :128].astype(np.float32))


def test_nan_weight_is_refused_and_nothing_is_written(fp8_export, tmp_path):
  dst = str(tmp_path / "hf")
  writer.save_hf(CFG, _host(), dst, dtype="fp8")
  before = {f: hashlib.sha256(open(os.path.join(dst, f), "rb").read()).hexdigest() for f in os.listdir(dst)}
  bad = jax.tree.map(np.copy, _host())
  bad["moe_layers"]["moe"]["experts"]["w_down"][0, 3, 100, 7] = np.nan  # layer 1, expert 3; HF row 7, col 100
  with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight.*NaN"):
    writer.save_hf(CFG, bad, dst, dtype="fp8")
  after = {f: hashlib.sha256(open(os.path.join(dst, f), "rb").read()).hexdigest() for f in os.listdir(dst)}
  assert after == before and os.listdir(tmp_path) == ["hf"]  # the old export intact, no temp left
  with pytest.raises(CheckpointError, match="NaN"):
    writer.save_hf(CFG, bad, str(tmp_path / "new"), dtype="fp8")
  assert os.listdir(tmp_path) == ["hf"]


def _sharded(host, mesh_shape):
  mesh = sharding.make_mesh(mesh_shape)
  abstract = nnx.state(nnx.eval_shape(lambda: K2Model(CFG, rngs=nnx.Rngs(0))))
  return jax.device_put(host, nnx.to_pure_dict(sharding.param_shardings(abstract, mesh, "fsdp_ep")))


@pytest.mark.parametrize("dtype", [None, "bfloat16", "fp8"])
def test_sharded_export_equals_host_export(tmp_path, dtype):
  """Devices holding parts of tensors (fsdp) and whole experts (expert): per-layer exports, every
  tensor once, equal to the export of the same weights as host arrays."""
  host = _host()
  writer.save_hf(CFG, host, str(tmp_path / "host"), dtype=dtype)
  writer.save_hf(CFG, _sharded(host, {"fsdp": 4, "expert": 2}), str(tmp_path / "mesh"), dtype=dtype)
  a, b = fp8_export_golden.read_tensors(str(tmp_path / "host")), fp8_export_golden.read_tensors(str(tmp_path / "mesh"))
  assert sorted(a) == sorted(b) and len(a) > 40
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes(), k


def test_experts_no_mesh_axis_divides_are_exported_one_at_a_time(tmp_path):
  """3 experts on an expert axis of 2 (and fsdp 4): no axis splits them, so each expert is exported
  alone (never the layer's stacked experts replicated)."""
  cfg = presets.get("tiny", **{**fp8_export_golden.CONFIG, "n_routed_experts": 3})
  rng = np.random.default_rng(1)
  host = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), abstract_state(cfg))
  state = jax.device_put(
    host, jax.sharding.NamedSharding(sharding.make_mesh({"fsdp": 8}), jax.sharding.PartitionSpec())
  )
  state["moe_layers"]["moe"]["experts"]["w_up"] = jax.device_put(
    host["moe_layers"]["moe"]["experts"]["w_up"],
    jax.sharding.NamedSharding(sharding.make_mesh({"fsdp": 8}), jax.sharding.PartitionSpec(None, None, "fsdp")),
  )
  plan = writer.make_plan(cfg, state, None)
  up = [s for s in plan if s.entry.path[-1] == "w_up" and s.entry.kind == "expert"]
  assert len(up) == 3 and all(s.index == (0, e) and len(s.tensors) == 1 for e, s in enumerate(up))
  writer.save_hf(cfg, state, str(tmp_path / "hf"))
  got = fp8_export_golden.read_tensors(str(tmp_path / "hf"))
  for k, t in writer.iter_hf_tensors(cfg, host, None):
    assert got[k].tobytes() == t.tobytes(), k


@pytest.mark.slow
def test_two_processes_export_equals_one_process_and_loads_in_transformers(tmp_path):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(HERE))}
  env.pop("XLA_FLAGS", None)
  procs = [
    subprocess.Popen(
      [sys.executable, os.path.join(HERE, "export_worker.py"), str(port), str(i), str(tmp_path)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
  host = jax.tree.map(np.copy, _host())
  host[ZERO_BLOCK[0]][ZERO_BLOCK[1]][ZERO_BLOCK[2]][0, :128, 128:] = _fresh_block()  # the worker's weights
  for name, dtype in (("f32", None), ("fp8", "fp8")):
    mine = [
      line.split()[3:] for out in outs for line in out.splitlines() if line.startswith(f"files {name} ")
    ]  # each process's files
    assert len(mine) == 2 and mine[0] and mine[1] and not set(mine[0]) & set(mine[1])
    path = str(tmp_path / name)
    assert sorted(mine[0] + mine[1]) == sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    one = str(tmp_path / f"one_{name}")
    writer.save_hf(CFG, host, one, dtype=dtype)
    a, b = fp8_export_golden.read_tensors(path), fp8_export_golden.read_tensors(one)
    assert sorted(a) == sorted(b)
    for k in a:
      assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), (name, k)
  pytest.importorskip("transformers")
  from hf_golden import hf_logits

  ids = (np.arange(48, dtype=np.int32).reshape(2, 24) * 37) % CFG.vocab_size
  theirs = hf_logits(str(tmp_path / "f32"), ids)
  ours = np.asarray(model_from_state(CFG, host)(ids).logits)
  assert np.abs(ours).max() > 0.1 and np.abs(theirs - ours).max() < 1e-4


def _fresh_block():
  """The block `_host` zeroes, as the worker (which does not zero it) has it."""
  return fp8_export_golden.host_state(CFG)[ZERO_BLOCK[0]][ZERO_BLOCK[1]][ZERO_BLOCK[2]][0, :128, 128:]


@pytest.mark.slow
def test_convert_cli_exports_a_sharded_workdir_as_fp8(tmp_path):
  """launch/convert.py WORKDIR -> HF --dtype=fp8 restores the checkpoint sharded over the devices and
  writes the golden FP8 layout, equal to the in-process export of the same weights."""
  from k2jax.convert import workdir as wd

  root = os.path.dirname(os.path.dirname(HERE))
  w, hf = str(tmp_path / "w"), str(tmp_path / "hf")
  wd.save_model_only(CFG, _host(), w)
  env = {**os.environ, "PYTHONPATH": root, "XLA_FLAGS": xla_flags(2)}
  cmd = [sys.executable, "launch/convert.py", f"--src={w}", f"--dst={hf}", "--dtype=fp8", "--mesh=fsdp=2"]
  p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  with open(fp8_export_golden.GOLDEN) as f:
    assert fp8_export_golden.key_list(hf) == json.load(f)["tensors"]
  writer.save_hf(CFG, _host(), str(tmp_path / "ref"), dtype="fp8")
  a, b = fp8_export_golden.read_tensors(hf), fp8_export_golden.read_tensors(str(tmp_path / "ref"))
  assert all(a[k].tobytes() == b[k].tobytes() for k in b) and sorted(a) == sorted(b)


def _from_hf_tensors(cfg, tensors: dict) -> dict:
  """A k2jax state dict from HF tensors (FP8 ones dequantized with `fp8.dequantize`), float32."""
  from k2jax.convert.layout import entries

  state = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), abstract_state(cfg))
  for entry in entries(cfg):
    leaf = get_path(state, entry.path)
    for idx, key in entry.keys(cfg):
      t = tensors[key]
      t = fp8.dequantize(t, tensors[key + "_scale_inv"]) if t.dtype == fp8.E4M3 else t.astype(np.float32)
      leaf[idx] = t.T if entry.transpose else t
  return state


@pytest.mark.slow
def test_fp8_export_of_an_aligned_config_loads_in_transformers(tmp_path):
  """transformers 5.x dequantizes block-FP8 on CPU when every dim is a multiple of 128 (its
  Fp8Dequantize refuses ragged grids such as Kimi's 576 rows): its logits equal k2jax's on the
  dequantized weights (which differ from the unquantized ones by the rounding)."""
  transformers = pytest.importorskip("transformers")
  import torch

  aligned = dict(fp8_export_golden.CONFIG, hidden_size=256, intermediate_size=256, moe_intermediate_size=128)
  aligned.update(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=128, v_head_dim=128)
  cfg = presets.get("tiny", **aligned)
  host = jax.tree.map(lambda x: x * 8, fp8_export_golden.host_state(cfg))  # std 0.4: logits of order 1
  dst = str(tmp_path / "fp8")
  writer.save_hf(cfg, host, dst, dtype="fp8")
  model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
  ids = (np.arange(48).reshape(2, 24) * 37) % cfg.vocab_size
  with torch.no_grad():
    theirs = model(torch.from_numpy(ids)).logits.float().numpy()
  dequantized = _from_hf_tensors(cfg, fp8_export_golden.read_tensors(dst))
  ours = np.asarray(model_from_state(cfg, dequantized)(ids.astype(np.int32)).logits)
  assert np.abs(ours).max() > 0.5 and np.abs(theirs - ours).max() < 1e-4 * np.abs(ours).max()
  w_up = dequantized["moe_layers"]["moe"]["experts"]["w_up"]
  assert 0 < np.abs(w_up - host["moe_layers"]["moe"]["experts"]["w_up"]).max() < 0.1  # rounded, not lost
