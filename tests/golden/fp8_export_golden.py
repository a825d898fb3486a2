"""Golden key set of a block-FP8 export (`k2jax.save_hf(..., dtype='fp8')`) of a small config.

Run `PYTHONPATH=. python tests/golden/fp8_export_golden.py` to regenerate `fp8_export_keys.json`:
every stored tensor's HF name, safetensors dtype and shape, and config.json's `quantization_config`.
The config has dims that are not multiples of 128 (hidden 192) and a kv_a_proj_with_mqa of 192 rows
(kv_lora 128 + rope 64: 1.5 blocks, the shape of Kimi's 576-row [5, 56]-scale tensor), so ragged scale
grids are in the list. The list was checked by hand against the published layout (reference
checkpoints-at-scale.md §1.2): F8_E4M3 + F32 [ceil(out/128), ceil(in/128)] scale for every projection,
BF16 embeddings, lm_head, norms and router weight, F32 router bias.
"""

import json
import os
import struct
import sys
import tempfile

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "fp8_export_keys.json")
CONFIG = dict(
  vocab_size=512,
  hidden_size=192,
  intermediate_size=320,
  moe_intermediate_size=160,
  num_hidden_layers=2,
  first_k_dense_replace=1,
  num_attention_heads=2,
  num_key_value_heads=2,
  q_lora_rank=160,
  kv_lora_rank=128,
  qk_nope_head_dim=32,
  qk_rope_head_dim=64,
  v_head_dim=32,
  n_routed_experts=4,
  num_experts_per_tok=2,
)


def host_state(cfg):
  """The model's pure state dict, random normal (seed 0) scaled like an init, in numpy."""
  import jax

  from k2jax.convert.hf import abstract_state

  rng = np.random.default_rng(0)
  return jax.tree.map(lambda x: (0.05 * rng.standard_normal(x.shape)).astype(x.dtype), abstract_state(cfg))


def key_list(path: str) -> list[list]:
  """[[name, safetensors dtype, shape], ...] of every tensor in the export at `path`, sorted."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
  from k2jax.convert.safetensors_io import read_header

  out = []
  for f in sorted(os.listdir(path)):
    if f.endswith(".safetensors"):
      out += [[k, v.dtype, list(v.shape)] for k, v in read_header(os.path.join(path, f)).items()]
  return sorted(out)


def read_tensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of an export, read from the safetensors bytes (numpy's safetensors has no FP8)."""
  out = {}
  for f in sorted(os.listdir(path)):
    if not f.endswith(".safetensors"):
      continue
    with open(os.path.join(path, f), "rb") as fh:
      (n,) = struct.unpack("<Q", fh.read(8))
      head = json.loads(fh.read(n))
      data = fh.read()
    head.pop("__metadata__", None)
    for k, v in head.items():
      assert k not in out, f"{k} stored twice"
      a, b = v["data_offsets"]
      out[k] = np.frombuffer(data[a:b], _np_dtype(v["dtype"])).reshape(v["shape"])
  return out


def _np_dtype(name: str):
  return {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  }[name]


def main():
  sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
  from flax import nnx

  import k2jax
  from k2jax.model import K2Model, presets

  with tempfile.TemporaryDirectory() as d:
    k2jax.save_hf(K2Model(presets.get("tiny", **CONFIG), rngs=nnx.Rngs(0)), d, dtype="fp8")
    with open(os.path.join(d, "config.json")) as f:
      qc = json.load(f)["quantization_config"]
    golden = {"config": CONFIG, "quantization_config": qc, "tensors": key_list(d)}
  with open(GOLDEN, "w") as f:
    json.dump(golden, f, indent=1)
  print("wrote", GOLDEN, len(golden["tensors"]), "tensors")


if __name__ == "__main__":
  main()
