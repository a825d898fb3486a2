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
  """A new pure state dict: `state` with every tensor in the HF directory `path` replaced.

  Leaves are host arrays or jax.Arrays of any sharding, over any number of processes: each process
  writes only its own shards (a replaced leaf keeps its sharding) and reads only the tensors that fall
  in them (an expert-sharded leaf: its own experts' files). Every tensor's shape is checked from its
  header first, on every process alike, so a bad push fails the same way everywhere."""
  keys = {key: (entry, idx) for entry in entries(cfg) for idx, key in entry.keys(cfg)}
  new = jax.tree.map(lambda a: a, state)  # new containers, shared leaves
  leaves: dict[tuple[str, ...], _Pieces] = {}
  for file, key, shape, read in _tensors(path):
    if key not in keys:
      raise CheckpointError(f"{file}: tensor {key!r} is not a parameter of the served model")
    entry, idx = keys[key]
    if entry.path not in leaves:
      leaves[entry.path] = _Pieces(_get(state, entry.path))
    pieces = leaves[entry.path]
    want = pieces.shape[len(idx) :]
    if tuple(shape) != (want[::-1] if entry.transpose else want):
      raise CheckpointError(
        f"{file}: tensor {key!r} has shape {list(shape)}, the served model needs "
        f"{list(want[::-1] if entry.transpose else want)}"
      )
    if pieces.holds(idx):
      value = read()
      pieces.write(idx, value.T if entry.transpose else value)
  for leaf_path, pieces in leaves.items():
    _set(new, leaf_path, pieces.build())
  return new


class _Pieces:
  """One leaf being overlaid, as the pieces this process holds: a host array is one piece; a jax.Array
  one per addressable shard. A piece is copied to the host the first time a tensor writes into it
  (copy-on-write: the old leaf is never modified)."""

  def __init__(self, leaf):
    self.leaf, self.shape, self.dtype = leaf, tuple(leaf.shape), leaf.dtype
    if isinstance(leaf, jax.Array):
      shards = leaf.addressable_shards
      self.devices = [sh.device for sh in shards]
      self.data = [sh.data for sh in shards]
      self.index = [_starts_stops(sh.index, self.shape) for sh in shards]
    else:
      self.devices, self.data, self.index = [None], [leaf], [tuple((0, d) for d in self.shape)]
    self.copied = [False] * len(self.data)

  def _targets(self, idx: tuple[int, ...]) -> list[int]:
    return [k for k, bounds in enumerate(self.index) if all(lo <= i < hi for i, (lo, hi) in zip(idx, bounds))]

  def holds(self, idx: tuple[int, ...]) -> bool:
    return bool(self._targets(idx))

  def write(self, idx: tuple[int, ...], value: np.ndarray) -> None:
    """leaf[idx] = value, on the pieces that hold row `idx`."""
    for k in self._targets(idx):
      if not self.copied[k]:
        self.data[k], self.copied[k] = np.array(self.data[k]), True
      bounds = self.index[k]
      at = tuple(i - lo for i, (lo, _) in zip(idx, bounds))
      part = value[tuple(slice(lo, hi) for lo, hi in bounds[len(idx) :])]
      self.data[k][at] = part.astype(self.dtype)

  def build(self):
    if not isinstance(self.leaf, jax.Array):
      return self.data[0]
    arrays = [jax.device_put(x, d) if c else x for x, d, c in zip(self.data, self.devices, self.copied)]
    return jax.make_array_from_single_device_arrays(self.shape, self.leaf.sharding, arrays)


def _starts_stops(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  return tuple(sl.indices(d)[:2] for sl, d in zip(index, shape))


def _tensors(path: str):
  """(file, key, shape, read) per weight tensor of the weight-sync directory `path`; `read()` returns it
  as a host array (block-FP8 dequantized with its scale), reading only then."""
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

        def read(t=t, key=key):
          w = read_block(files, t, tuple((0, d) for d in t.shape))
          return _dequantize(files, file, header, key, w) if t.dtype == "F8_E4M3" else w

        yield file, key, t.shape, read


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
