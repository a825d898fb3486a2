"""Apply a partial HF safetensors directory (only the tensors that changed) onto a model's state.

RL weight sync (`k2jax.rl.weight_sync`) writes just the changed tensors plus an index, with no
config.json; engines overlay them on the weights they serve. A block-FP8 push (F8_E4M3 + float32
`weight_scale_inv`, 128x128 blocks: the release's layout, `fp8.QuantConfig`) is dequantized here. Copy-on-write: leaves that no tensor
touches are shared with the old state, and the old state is never modified (an error leaves it intact).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from k2jax.convert import fp8
from k2jax.convert.errors import CheckpointError
from k2jax.convert.hf_dir import INDEX, check_shard_name, get_path as _get, set_path as _set
from k2jax.convert.safetensors_io import ShardFiles, read_block, read_header
from k2jax.convert.layout import entries
from k2jax.model.config import K2Config


def is_partial_hf_dir(path: str) -> bool:
  """An index of safetensors without config.json: a weight-sync delta, not a full model."""
  return os.path.isfile(os.path.join(path, INDEX)) and not os.path.isfile(os.path.join(path, "config.json"))


def overlay_hf_tensors(cfg: K2Config, state: dict, path: str) -> dict:
  """A new pure state dict: `state` with every tensor in the HF directory `path` replaced."""
  keys = {key: (entry, idx) for entry in entries(cfg) for idx, key in entry.keys(cfg)}
  new = jax.tree.map(lambda a: a, state)  # new containers, shared leaves
  copied: set[tuple[str, ...]] = set()
  for file, key, tensor in _read_tensors(path):
    if key not in keys:
      raise CheckpointError(f"{file}: tensor {key!r} is not a parameter of the served model")
    entry, idx = keys[key]
    if entry.path not in copied:  # copy-on-write
      _set(new, entry.path, np.array(_get(new, entry.path)))
      copied.add(entry.path)
    leaf = _get(new, entry.path)
    value = tensor.T if entry.transpose else tensor
    want = leaf[idx].shape
    if value.shape != want:
      raise CheckpointError(
        f"{file}: tensor {key!r} has shape {list(tensor.shape)}, the served model needs "
        f"{list(want[::-1] if entry.transpose else want)}"
      )
    leaf[idx] = value.astype(leaf.dtype)
  return new


def _read_tensors(path: str):
  index = os.path.join(path, INDEX)
  if not os.path.isfile(index):
    raise CheckpointError(f"{path}: no {INDEX} (expected a weight-sync directory)")
  try:
    with open(index) as f:
      files = set(json.load(f)["weight_map"].values())
  except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
    raise CheckpointError(f"{index}: unreadable index ({e})") from e
  for name in files:
    check_shard_name(path, name)  # an index entry may not point outside the directory
  for name in sorted(files):
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      raise CheckpointError(f"{file}: shard listed in {INDEX} is missing")
    header = read_header(file)
    with ShardFiles() as files:
      for key, t in header.items():
        if key.endswith(fp8.SCALE_SUFFIX):
          continue  # applied with its weight
        w = read_block(files, t, tuple((0, d) for d in t.shape))
        if t.dtype == "F8_E4M3":
          w = _dequantize(files, file, header, key, w)
        yield file, key, w


def _dequantize(files: ShardFiles, file: str, header: dict, key: str, w_fp8: np.ndarray) -> np.ndarray:
  block = fp8.QuantConfig().block
  s = header.get(key + fp8.SCALE_SUFFIX)
  if s is None or s.dtype != "F32" or s.shape != fp8.scale_shape(w_fp8.shape, block):
    got = "missing" if s is None else f"{s.dtype} {list(s.shape)}"
    raise CheckpointError(
      f"{file}: tensor {key!r} is F8_E4M3 but its scale {key + fp8.SCALE_SUFFIX!r} is {got} (expected F32 "
      f"{list(fp8.scale_shape(w_fp8.shape, block))} in the same file)"
    )
  return fp8.dequantize(w_fp8, read_block(files, s, tuple((0, d) for d in s.shape)), block)
