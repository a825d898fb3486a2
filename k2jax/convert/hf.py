"""Stream a Hugging Face safetensors directory into k2jax parameters, and back.

Import reads one tensor at a time into preallocated k2jax leaves, never two full copies of the model in
host memory. Export is `k2jax.convert.writer` (the one HF writer: per process, streamed, bf16 / FP8);
`save_hf` and `iter_hf_tensors` are re-exported here for existing callers. Import checks that config.json and the shards describe the same layers and that every
shard the index names lies inside the directory.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from k2jax.convert.errors import CheckpointError
from k2jax.convert.export_dir import recover
from k2jax.convert.layout import Entry, entries, hf_shape
from k2jax.convert.writer import iter_hf_tensors, save_hf  # noqa: F401  (moved to writer.py; re-exported)
from k2jax.model.config import K2Config
from k2jax.model.transformer import K2Model

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def abstract_state(cfg: K2Config) -> dict:
  """Pure dict of jax.ShapeDtypeStruct for every model variable, allocating nothing."""
  model = nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))
  return nnx.to_pure_dict(nnx.state(model))


def _get(tree: Mapping, path: tuple[str, ...]):
  for p in path:
    tree = tree[p]
  return tree


def _set(tree: dict, path: tuple[str, ...], value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


# ---------------------------------------------------------------------------------------------- import


def read_config(path: str, **k2jax_fields) -> K2Config:
  recover(path)  # an export interrupted between its two renames (filesystems without RENAME_EXCHANGE)
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")
  return K2Config.from_json_file(cfg_path, **k2jax_fields)


def weight_map(path: str) -> dict[str, str]:
  """HF key -> shard file name; checks that every shard exists."""
  index = os.path.join(path, INDEX)
  if os.path.isfile(index):
    try:
      with open(index) as f:
        wmap = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{index}: unreadable index ({e})") from e
  elif os.path.isfile(os.path.join(path, SINGLE)):
    with safe_open(os.path.join(path, SINGLE), "numpy") as f:
      wmap = {k: SINGLE for k in f.keys()}
  else:
    raise CheckpointError(f"{path}: neither {INDEX} nor {SINGLE} found")
  if not isinstance(wmap, dict):
    raise CheckpointError(f"{index}: weight_map is not an object")
  for shard in set(wmap.values()):
    check_shard_name(path, shard)
  for shard in sorted(set(wmap.values())):
    if not os.path.isfile(os.path.join(path, shard)):
      n = sum(1 for v in wmap.values() if v == shard)
      raise CheckpointError(f"{os.path.join(path, shard)}: shard listed in {INDEX} is missing ({n} tensors)")
  return wmap


def check_shard_name(path: str, shard) -> None:
  """A shard named by an index must be a plain relative path inside `path` (not /etc/passwd, not ../x)."""
  bad = (
    not isinstance(shard, str)
    or not shard
    or "\\" in shard
    or "\0" in shard
    or posixpath.isabs(shard)
    or any(part in ("", ".", "..") for part in shard.split("/"))
  )
  if bad:
    raise CheckpointError(f"{os.path.join(path, INDEX)}: shard path {shard!r} is not a file inside {path}")


def load_hf(path: str, **k2jax_fields) -> tuple[K2Config, dict]:
  """Read an HF directory: (config, pure state dict of numpy arrays in the config's param dtype)."""
  cfg = read_config(path, **k2jax_fields)
  wmap = weight_map(path)
  abstract = abstract_state(cfg)
  state: dict = {}
  plan = entries(cfg)
  wanted: dict[str, list[tuple[Entry, tuple[int, ...]]]] = {}
  for entry in plan:
    leaf = _get(abstract, entry.path)
    _set(state, entry.path, np.empty(leaf.shape, leaf.dtype))
    for idx, key in entry.keys(cfg):
      if key not in wmap:
        raise CheckpointError(f"{path}: tensor {key!r} is missing (needed for k2jax {'.'.join(entry.path)})")
      wanted.setdefault(wmap[key], []).append((entry, idx, key))
  _check_unexpected(path, cfg, wmap)
  for shard, items in sorted(wanted.items()):
    file = os.path.join(path, shard)
    try:
      with safe_open(file, "numpy") as f:
        for entry, idx, key in items:
          _read_into(f, file, cfg, entry, idx, key, _get(state, entry.path), _get(abstract, entry.path))
    except CheckpointError:
      raise
    except Exception as e:  # safetensors raises its own errors on truncated/corrupt headers
      raise CheckpointError(f"{file}: cannot read safetensors shard ({e})") from e
  return cfg, state


def _read_into(f, file, cfg, entry: Entry, idx, key, dest: np.ndarray, leaf):
  if key not in f.keys():
    raise CheckpointError(f"{file}: tensor {key!r} listed in the index is not in the shard")
  sl = f.get_slice(key)
  want = hf_shape(leaf.shape, entry)
  got = tuple(sl.get_shape())
  if got != want:
    raise CheckpointError(f"{file}: tensor {key!r} has shape {list(got)}, expected {list(want)} for this config.json")
  if sl.get_dtype().startswith("F8"):
    raise CheckpointError(
      f"{file}: tensor {key!r} is {sl.get_dtype()}; dequantize FP8 checkpoints to "
      "bfloat16 first (the released Kimi-K2 weights are FP8 with block scales)"
    )
  t = f.get_tensor(key)
  dest[idx] = (t.T if entry.transpose else t).astype(dest.dtype)


def _check_unexpected(path: str, cfg: K2Config, wmap: Mapping[str, str]):
  """Every tensor in the shards must be a parameter of config.json's model, or one of the MTP layers
  config.json declares (num_nextn_predict_layers, stored after the last layer; k2jax does not use them)."""
  known = {k for e in entries(cfg) for _, k in e.keys(cfg)}
  mtp = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
  extra = []
  for key in sorted(wmap):
    if key in known or key.endswith("rotary_emb.inv_freq"):
      continue
    layer = _layer_of(key)
    if layer is not None and layer in mtp:
      continue
    extra.append(key)
  if extra:
    layers = sorted({_layer_of(k) for k in extra} - {None})
    what = f" (of layers {layers})" if layers else ""
    raise CheckpointError(
      f"{path}: {len(extra)} tensors{what} are not described by config.json (num_hidden_layers="
      f"{cfg.num_hidden_layers}, num_nextn_predict_layers={cfg.num_nextn_predict_layers}): "
      f"{', '.join(repr(k) for k in extra[:5])}{' ...' if len(extra) > 5 else ''}"
    )


def _layer_of(key: str) -> int | None:
  parts = key.split(".")
  return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None
