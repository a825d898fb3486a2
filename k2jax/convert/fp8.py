"""The published block-FP8 layout of Kimi-K2 / DeepSeek-V3 (`quant_method: fp8`, e4m3, 128x128 blocks).

A quantized Linear stores `X.weight` as F8_E4M3 `[out, in]` (HF orientation, not transposed) and
`X.weight_scale_inv` as float32 `[ceil(out/b0), ceil(in/b1)]`. Despite its name the scale is the
multiplier (DeepSeek `README_WEIGHTS.md`):

  W[i, j] = float32(W_fp8[i, j]) * scale_inv[i // b0, j // b1]

Ragged edge blocks (Kimi's `kv_a_proj_with_mqa` is [576, 7168] with a [5, 56] grid) are zero-padded
before their scale is computed and cropped after. The release quantizes every attention and MLP
projection (dense, shared and routed experts); embeddings, lm_head, norms and the router weight stay
bf16, the router's `e_score_correction_bias` float32 (a bf16 bias routes wrongly).

Written here rather than taken from a library: transformers' `Fp8Dequantize` raises on the 576-row
tensor and its `Fp8Quantize` leaves it unquantized; the other writers (slime, prime-rl) are PyTorch on
GPU. These are numpy, exact per slice, and never materialise more than the slice being converted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from k2jax.convert.errors import CheckpointError

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # HF key of a weight's scale: f"{key}{SCALE_SUFFIX}"
QUANT_GROUP_ELEMS = 1 << 20  # elements of the block rows `quantize` converts per group of numpy calls
# float32 of every e4m3 byte: a table lookup is the same conversion as `astype` (bit for bit) and measured
# ~10x faster than ml_dtypes' element-wise cast.
_E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)
# e4m3 bits of every bfloat16 (ml_dtypes' round-to-nearest-even cast): `to_e4m3_bits`' second rounding.
_BF16_TO_E4M3 = np.arange(1 << 16, dtype=np.uint16).view(BF16).astype(np.float32).astype(E4M3).view(np.uint8)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """`config.json`'s `quantization_config` for the block-FP8 layout."""

  block: tuple[int, int] = (128, 128)

  def to_hf(self) -> dict:
    return {
      "activation_scheme": "dynamic",
      "fmt": "e4m3",
      "quant_method": "fp8",
      "weight_block_size": list(self.block),
    }

  @classmethod
  def from_hf(cls, qc, where: str) -> QuantConfig:
    """Validate a `quantization_config` object; CheckpointError naming `where` (the config file) if it is
    not the block-FP8 layout k2jax reads."""
    if not isinstance(qc, Mapping):
      raise CheckpointError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "fp8":
      raise CheckpointError(
        f"{where}: quantization_config.quant_method={method!r} is not supported (k2jax reads quant_method "
        "'fp8', the block-FP8 layout of the released Kimi-K2 / DeepSeek-V3)"
      )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
      raise CheckpointError(f"{where}: quantization_config.fmt={fmt!r} is not supported (expected 'e4m3')")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":
      raise CheckpointError(
        f"{where}: quantization_config.activation_scheme={act!r} is not supported: block-FP8 checkpoints use "
        "'dynamic' activation scales (there are no static activation scales to read)"
      )
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):  # ue8m0 scales are still float32 on disk (powers of two)
      raise CheckpointError(f"{where}: quantization_config.scale_fmt={scale_fmt!r} is not supported")
    block = qc.get("weight_block_size")
    ok = (
      isinstance(block, (list, tuple))
      and len(block) == 2
      and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    )
    if not ok:
      raise CheckpointError(
        f"{where}: quantization_config.weight_block_size={block!r} is not a pair of positive integers "
        "(block-wise FP8 needs [rows, cols], e.g. [128, 128]; per-tensor or per-channel FP8 is not supported)"
      )
    return cls(block=(block[0], block[1]))


def is_quantized_key(key: str) -> bool:
  """Whether the release stores this HF key as block-FP8: every attention/MLP projection weight."""
  return key.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
  """The `weight_scale_inv` grid of an `[out, in]` weight."""
  if len(shape) != 2:
    raise ValueError(f"block-FP8 weights are 2-D [out, in], got shape {list(shape)}")
  return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def dequantize(
  w_fp8: np.ndarray,
  scale_inv: np.ndarray,
  block: tuple[int, int] = (128, 128),
  origin: tuple[int, int] = (0, 0),
) -> np.ndarray:
  """float32 of a 2-D slice `w_fp8` whose first element is the full weight's `origin` (row, col).

  `scale_inv` is the full weight's scale grid (or any grid whose [0, 0] is block (0, 0)); each element
  gets the scale of the block it lies in, so a slice that is not block-aligned (FSDP-64 rows of a
  7168-wide axis) still dequantizes exactly as the whole tensor would."""
  if w_fp8.ndim != 2 or scale_inv.ndim != 2:
    raise ValueError(f"dequantize: expected 2-D weight and scale, got {w_fp8.shape} and {scale_inv.shape}")
  r0, c0 = origin
  n_r, n_c = w_fp8.shape
  col_blocks = (c0 + np.arange(n_c)) // block[1]
  out = _E4M3_TO_F32[w_fp8.view(np.uint8)] if w_fp8.dtype == E4M3 else w_fp8.astype(np.float32)
  row = 0
  while row < n_r:  # one block row at a time: the transient is one row of column scales
    b = (r0 + row) // block[0]
    end = min(n_r, (b + 1) * block[0] - r0)
    out[row:end] *= scale_inv[b, col_blocks].astype(np.float32)[None, :]
    row = end
  return out


def quantize(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
  """(F8_E4M3 weight, float32 scale_inv) of a 2-D `[out, in]` weight, per block `scale = amax / 448`.

  An all-zero block gets scale 1.0 (not 0, inf or NaN: 0/0 is what writers without a guard produce),
  so its zeros stay zeros and every scale a reader multiplies by is finite and positive."""
  if w.ndim != 2:
    raise ValueError(f"quantize: expected a 2-D [out, in] weight, got shape {list(w.shape)}")
  n_r, n_c = w.shape
  g_r, g_c = scale_shape(w.shape, block)
  col_starts = np.arange(0, n_c, block[1])
  col_blocks = np.arange(n_c) // block[1]
  amax = np.empty((g_r, g_c), np.float32)
  q = np.empty((n_r, n_c), np.uint8)
  # Block rows a group of about QUANT_GROUP_ELEMS at a time through scratch buffers allocated once: a dozen
  # large numpy calls per group rather than per block row (each call hands the GIL over and back: with the
  # writer's threads sharing it, groups of 2**18 spent 6-9 s of system time in futex waits on an FP8
  # export that takes 1.3 s with 2**20, the writer's job size), operands of a few MiB (whole-matrix passes
  # measured ~1.6x slower on [1024, 7168]), and no fresh pages per group.
  per_group = max(1, QUANT_GROUP_ELEMS // max(1, block[0] * n_c))
  g_rows = min(n_r, per_group * block[0])
  w32, x, bits = (np.empty((g_rows, n_c), dt) for dt in (np.float32, np.float32, np.uint32))
  for b0 in range(0, g_r, per_group):
    b1 = min(g_r, b0 + per_group)
    r0, r1 = b0 * block[0], min(n_r, b1 * block[0])
    n = r1 - r0
    whole = n == (b1 - b0) * block[0]  # False: the group ends with the ragged last block row
    rows, xs = to_float32(w[r0:r1], out=w32[:n]), x[:n]
    np.abs(rows, out=xs)
    if whole:
      colmax = xs.reshape(b1 - b0, block[0], n_c).max(axis=1)
    else:
      colmax = np.stack([xs[i : i + block[0]].max(axis=0) for i in range(0, n, block[0])])
    amax[b0:b1] = np.maximum.reduceat(colmax, col_starts, axis=1)
    if not np.all(np.isfinite(amax[b0:b1])):  # max propagates NaN, and |inf| is inf: the blocks' amax sees them
      raise ValueError("quantize: the weight has NaN or inf entries; FP8 cannot represent them")
    scale = np.where(amax[b0:b1] > 0, amax[b0:b1] / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    amax[b0:b1] = scale  # amax becomes the scale grid
    per_col = scale[:, col_blocks]  # [block rows, cols]: each column's scale
    if whole:
      np.divide(rows.reshape(-1, block[0], n_c), per_col[:, None, :], out=xs.reshape(-1, block[0], n_c))
    else:
      for i, r in enumerate(range(0, n, block[0])):
        np.divide(rows[r : r + block[0]], per_col[i], out=xs[r : r + block[0]])
    _e4m3_bits_into(np.clip(xs, -E4M3_MAX, E4M3_MAX, out=xs), q[r0:r1], bits[:n])
  scale = amax
  return q.view(E4M3), scale


def to_float32(w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
  """float32 of `w` (into `out` when given); bfloat16 by a 16-bit shift of its bits in one pass (exact, and
  ~1.5x ml_dtypes' cast)."""
  if w.dtype == BF16:
    dst = None if out is None else out.view(np.uint32)
    return np.left_shift(w.view(np.uint16), np.uint32(16), dtype=np.uint32, out=dst).view(np.float32)
  if out is None:
    return np.asarray(w, np.float32)
  np.copyto(out, w, casting="unsafe")
  return out


def to_e4m3_bits(x: np.ndarray) -> np.ndarray:
  """uint8 bits of float8_e4m3fn(x) for finite float32 `x` with |x| <= 448, bitwise equal to ml_dtypes'
  round-to-nearest-even cast and ~1.7x faster: x is rounded to bfloat16 by round-to-odd (truncate, set
  the last bit when any dropped bit is set), then a 65536-entry table rounds that to e4m3 with
  ml_dtypes' own cast. Rounding to odd at >= 2 more bits of precision than the target (bf16: 8, e4m3: 4)
  and then to nearest-even gives the correctly rounded result (Boldo & Melquiond, "When double
  rounding is odd", 2005); tests/convert/test_fp8.py checks every midpoint between e4m3 values."""
  x = np.array(x, np.float32)  # a copy: `_e4m3_bits_into` overwrites it
  out = np.empty(x.shape, np.uint8)
  _e4m3_bits_into(x, out, np.empty(x.shape, np.uint32))
  return out


def _e4m3_bits_into(x: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
  """`out` = to_e4m3_bits(x), overwriting `x` (float32) and `scratch` (uint32, x's shape): no allocations."""
  u = x.view(np.uint32)
  np.bitwise_and(u, np.uint32(0xFFFF), out=scratch)
  scratch += np.uint32(0xFFFF)  # >= 0x10000 exactly when a dropped bit is set
  scratch >>= np.uint32(16)
  u >>= np.uint32(16)
  u |= scratch
  np.take(_BF16_TO_E4M3, u, out=out, mode="clip")  # indices < 2**16 by construction: no bounds pass
