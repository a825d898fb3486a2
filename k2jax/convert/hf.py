"""Stream a Hugging Face safetensors directory into k2jax parameters, and back.

Import is `reader.py` (each process reads only its own slices; block-FP8 dequantized per slice); its
entry points are re-exported here. Export writes one shard at a time, never holding two full copies of
the model in host memory; it goes through `export_dir.write_export`: it never replaces a directory
k2jax did not write, and swaps the new export in atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from k2jax.convert.errors import CheckpointError
from k2jax.convert.export_dir import write_export
from k2jax.convert.hf_dir import (
  INDEX,
  SINGLE,
  abstract_state,
  check_shard_name,
  check_unexpected,
  get_path,
  read_config,
  set_path,
  weight_map,
)
from k2jax.convert.layout import entries, hf_shape
from k2jax.convert.reader import load_hf, read_state
from k2jax.model.config import ConfigError, K2Config

__all__ = [
  "INDEX",
  "SINGLE",
  "CheckpointError",
  "abstract_state",
  "check_shard_name",
  "check_unexpected",
  "iter_hf_tensors",
  "load_hf",
  "read_config",
  "read_state",
  "save_hf",
  "weight_map",
]

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_get, _set = get_path, set_path  # the names the export code and its callers use


# ---------------------------------------------------------------------------------------------- export


def iter_hf_tensors(cfg: K2Config, state: Mapping, dtype: str | None) -> Iterator[tuple[str, np.ndarray]]:
  """(HF key, numpy tensor) in HF order; copies one tensor at a time off the device."""
  for entry in entries(cfg):
    leaf = _get(state, entry.path)
    for idx, key in entry.keys(cfg):
      t = np.asarray(jax.device_get(leaf[idx] if idx else leaf))
      if entry.transpose:
        t = t.T
      if dtype is not None and entry.path[-1] != "bias":  # the balancing bias stays float32
        t = t.astype(_DTYPES[dtype])
      yield key, np.ascontiguousarray(t)


def save_hf(
  cfg: K2Config,
  state: Mapping,
  dst: str,
  *,
  dtype: str | None = None,
  max_shard_bytes: int = 4 << 30,
  write_extra: Callable[[str], None] | None = None,
) -> None:
  """Write `state` as an HF directory at `dst` (sharded safetensors + index + config.json).

  `write_extra(tmp)` adds more files (the tokenizer) inside the same atomic export, so they are listed
  in its marker and a later export may replace them."""
  if dtype is not None and dtype not in _DTYPES:
    raise ConfigError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
  shards = _plan_shards(cfg, state, dtype, max_shard_bytes)

  def write(tmp: str) -> None:
    wmap, total, n, buf, shard_i = {}, 0, len(shards), {}, 0
    for key, t in iter_hf_tensors(cfg, state, dtype):
      buf[key] = t
      total += t.nbytes
      if len(buf) == len(shards[shard_i]):
        name = f"model-{shard_i + 1:05d}-of-{n:05d}.safetensors"
        save_file(buf, os.path.join(tmp, name), metadata={"format": "pt"})
        wmap.update({k: name for k in buf})
        buf, shard_i = {}, shard_i + 1
    with open(os.path.join(tmp, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}, f, indent=2)
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = dtype or cfg.param_dtype
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2, sort_keys=True)
    if write_extra is not None:
      write_extra(tmp)

  write_export(dst, "hf", write)


def _plan_shards(cfg, state, dtype, max_shard_bytes) -> list[list[str]]:
  """Group HF keys (in order) into shards of at most max_shard_bytes, from shapes alone."""
  shards, cur, size = [], [], 0
  for entry in entries(cfg):
    leaf = _get(state, entry.path)
    itemsize = (
      np.dtype(_DTYPES[dtype]).itemsize if dtype and entry.path[-1] != "bias" else np.dtype(leaf.dtype).itemsize
    )
    nbytes = int(np.prod(hf_shape(leaf.shape, entry))) * itemsize
    for _, key in entry.keys(cfg):
      if cur and size + nbytes > max_shard_bytes:
        shards.append(cur)
        cur, size = [], 0
      cur.append(key)
      size += nbytes
  if cur:
    shards.append(cur)
  return shards
