"""The Kimi-K2-Thinking INT4 release layout: compressed-tensors `pack-quantized` routed experts.

Every routed expert's projection `X.weight` ([out, in], HF orientation) is stored as three tensors
(../shared/reference/int4-qat.md §2):
  X.weight_packed  I32  [out, ceil(in/8)]   8 codes per word, element 8m+j in bits [4j, 4j+4) of word m as
                                           the nibble q + 8 (offset binary, little-endian, two's-complement
                                           int32); a ragged last word padded with nibble 0
  X.weight_scale   BF16 [out, ceil(in/32)]  one scale per group of 32 inputs
  X.weight_shape   I32  [2]                 (out, in)
on the grid of `k2jax.model.int4` (scale amax/7, codes in [-7, 7]): the same numbers the QAT forward pass
trains on. Everything else (attention, shared experts, the dense layers, router, embeddings, norms, lm_head)
is stored unquantized in bf16, and config.json's `quantization_config` lists them as `ignore`d.

Written here with numpy rather than through compressed-tensors: that library is PyTorch, quantizes on the
amax/7.5 grid with codes in [-8, 7] (it would move every trained weight), and works on whole tensors, while
the writer and reader convert row blocks and column slices of one tensor at a time. Its packing is the same
(tests/convert/test_int4.py decompresses an export with compressed-tensors itself).
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from k2jax.convert.errors import CheckpointError
from k2jax.model import int4 as grid

BITS, GROUP, QMAX = grid.BITS, grid.GROUP, grid.QMAX
PER_WORD = 32 // BITS  # codes per int32 word
BF16 = np.dtype(ml_dtypes.bfloat16)
# The marker dtype of a tensor written as the INT4 triplet (the writer's `out` dtype of routed experts).
INT4 = np.dtype(ml_dtypes.int4)
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
WEIGHTS = {
  "num_bits": BITS,
  "type": "int",
  "symmetric": True,
  "strategy": "group",
  "group_size": GROUP,
  "dynamic": False,
  "actorder": None,
  "block_structure": None,
  "observer": "minmax",
  "observer_kwargs": {},
}
# What each weights field must be for k2jax to read a file as the release's grid (the rest is metadata).
_REQUIRED = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "actorder")


def release_config() -> dict:
  """config.json's `quantization_config` of the Kimi-K2-Thinking release."""
  return {
    "config_groups": {
      "group_0": {
        "input_activations": None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": dict(WEIGHTS),
      }
    },
    "format": "pack-quantized",
    "ignore": list(IGNORE),
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
  }


def is_release_config(qc) -> bool:
  return isinstance(qc, Mapping) and qc.get("quant_method") == "compressed-tensors"


def check_config(qc: Mapping, where: str) -> None:
  """CheckpointError naming `where` (config.json) and the field unless `qc` is the release's INT4 layout:
  pack-quantized, one group of weight-only symmetric int4 in groups of 32, no activation quantization."""

  def need(ok: bool, field: str, value, want) -> None:
    if not ok:
      raise CheckpointError(
        f"{where}: quantization_config.{field}={value!r} is not the Kimi-K2-Thinking INT4 layout k2jax "
        f"reads (expected {want!r}: pack-quantized symmetric int4, group_size {GROUP}, weights only)"
      )

  need(qc.get("format") == "pack-quantized", "format", qc.get("format"), "pack-quantized")
  status = qc.get("quantization_status", "compressed")
  need(status == "compressed", "quantization_status", status, "compressed")
  need(qc.get("kv_cache_scheme") is None, "kv_cache_scheme", qc.get("kv_cache_scheme"), None)
  groups = qc.get("config_groups")
  need(isinstance(groups, Mapping) and len(groups) == 1, "config_groups", groups, "one group")
  ((name, group),) = groups.items()
  need(isinstance(group, Mapping), f"config_groups.{name}", group, "an object")
  for act in ("input_activations", "output_activations"):
    need(group.get(act) is None, f"config_groups.{name}.{act}", group.get(act), None)
  weights = group.get("weights")
  need(isinstance(weights, Mapping), f"config_groups.{name}.weights", weights, "an object")
  for field in _REQUIRED:
    need(
      weights.get(field) == WEIGHTS[field], f"config_groups.{name}.weights.{field}", weights.get(field), WEIGHTS[field]
    )
  ignore = qc.get("ignore")
  need(isinstance(ignore, list), "ignore", ignore, IGNORE)


def is_int4_key(key: str) -> bool:
  """Whether the release stores HF key `key` (a `.weight`) as the INT4 triplet: the routed experts."""
  return ".mlp.experts." in key and key.endswith("_proj.weight")


def triplet(key: str) -> tuple[str, str, str]:
  """The packed, scale and shape keys of a routed expert's `X.weight`."""
  base = key[: -len("weight")]
  return tuple(base + s for s in SUFFIXES)


def packed_shape(shape: tuple[int, int]) -> tuple[int, int]:
  return (shape[0], -(-shape[1] // PER_WORD))


def scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
  return (shape[0], -(-shape[1] // GROUP))


def quantize(w_RC: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(codes int8 [R, C], scales bf16 [R, ceil(C/32)]) of a 2-D [out, in] block, groups along the last axis:
  bitwise `k2jax.model.int4.quantize` of its transpose (the quotient rounded to the weight's dtype)."""
  if w_RC.ndim != 2:
    raise ValueError(f"int4 quantize: expected a 2-D [out, in] weight, got shape {list(w_RC.shape)}")
  R, C = w_RC.shape
  G = -(-C // GROUP)
  w32 = np.zeros((R, G * GROUP), np.float32)
  w32[:, :C] = w_RC
  w_RGK = w32.reshape(R, G, GROUP)
  amax = np.abs(w_RGK).max(axis=-1)
  if not np.all(np.isfinite(amax)):
    raise ValueError("the weight has NaN or inf entries; INT4 cannot represent them")
  scale = (amax / np.float32(QMAX)).astype(BF16)
  div = np.where(scale == 0, np.float32(1), scale.astype(np.float32))
  x = w_RGK / div[..., None]
  if w_RC.dtype != np.float32:  # the quotient in the weight's dtype (bf16: rounded once more)
    x = x.astype(w_RC.dtype).astype(np.float32)
  q = np.clip(np.rint(x), -QMAX, QMAX).astype(np.int8).reshape(R, G * GROUP)[:, :C]
  return q, scale


def pack(q_RC: np.ndarray) -> np.ndarray:
  """int32 [R, ceil(C/8)] of int8 codes [R, C] in [-8, 7] (compressed-tensors' `pack_to_int32`)."""
  R, C = q_RC.shape
  W = -(-C // PER_WORD)
  nib = np.zeros((R, W * PER_WORD), np.uint32)
  nib[:, :C] = q_RC.astype(np.int32) + (1 << (BITS - 1))
  shifts = np.arange(PER_WORD, dtype=np.uint32) * np.uint32(BITS)
  words = np.bitwise_or.reduce(nib.reshape(R, W, PER_WORD) << shifts, axis=-1)
  return words.astype(np.uint32).view(np.int32)


def unpack(packed_RW: np.ndarray, n_cols: int) -> np.ndarray:
  """int8 codes [R, n_cols] of packed words [R, W] (the first n_cols of their 8 * W codes)."""
  shifts = np.arange(PER_WORD, dtype=np.uint32) * np.uint32(BITS)
  nib = (packed_RW.view(np.uint32)[..., None] >> shifts) & np.uint32(0xF)
  q = nib.reshape(*packed_RW.shape[:-1], -1).astype(np.int8) - np.int8(1 << (BITS - 1))
  return q[..., :n_cols]


def dequantize(q_RC: np.ndarray, scale_RG: np.ndarray, dtype=np.float32, col0: int = 0) -> np.ndarray:
  """[R, C] in `dtype` of codes whose first column is the full weight's column `col0` and the scale
  columns from group col0 // 32 on: fp32(q) * fp32(s), exact, then one rounding (bitwise
  `k2jax.model.int4.dequantize`)."""
  C = q_RC.shape[-1]
  groups = (col0 + np.arange(C)) // GROUP - col0 // GROUP
  s = scale_RG.astype(np.float32)[..., groups]
  return (q_RC.astype(np.float32) * s).astype(dtype)


def read_slice(read, key: str, rows: tuple[int, int], cols: tuple[int, int], dtype) -> np.ndarray:
  """Block rows x cols of routed expert `key`'s weight [out, in] in `dtype`, from its packed words and
  scales alone: `read(name, bounds)` returns that block of a stored tensor. Only the words and scale
  columns the block touches are read (each host reads its own slices)."""
  packed_key, scale_key, _ = triplet(key)
  (c0, c1) = cols
  w0, w1 = c0 // PER_WORD, -(-c1 // PER_WORD)
  g0, g1 = c0 // GROUP, -(-c1 // GROUP)
  q = unpack(read(packed_key, (rows, (w0, w1))), (w1 - w0) * PER_WORD)[:, c0 - w0 * PER_WORD :][:, : c1 - c0]
  if np.any(q == -(1 << (BITS - 1))):
    raise CheckpointError(
      f"tensor {packed_key!r} holds code -8 (nibble 0): not on the release's amax/7 grid with codes in "
      "[-7, 7] (compressed-tensors' default amax/7.5 grid uses -8); k2jax would re-quantize every weight"
    )
  return dequantize(q, read(scale_key, (rows, (g0, g1))), dtype, col0=c0)
