"""What an HF model directory is, before any tensor is read: config.json, the shard index, shard names
inside the directory, and the set of tensors config.json's model accounts for.

Shared by the reader (`reader.py`), the export (`hf.py`) and the weight-sync overlay (`overlay.py`).
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping

from flax import nnx

from k2jax.convert.errors import CheckpointError
from k2jax.convert.export_dir import recover
from k2jax.convert.layout import entries
from k2jax.convert.safetensors_io import read_header
from k2jax.model.config import K2Config
from k2jax.model.transformer import K2Model

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
QUANTIZATION = "quantization_config"


def abstract_state(cfg: K2Config) -> dict:
  """Pure dict of jax.ShapeDtypeStruct for every model variable, allocating nothing."""
  model = nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))
  return nnx.to_pure_dict(nnx.state(model))


def get_path(tree: Mapping, path: tuple[str, ...]):
  for p in path:
    tree = tree[p]
  return tree


def set_path(tree: dict, path: tuple[str, ...], value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def read_config(path: str, **k2jax_fields) -> K2Config:
  """The architecture in `path/config.json`. Its `quantization_config` describes how these files store
  the weights, not the model, so it is not kept (`reader.read_quant` reads it; an export writes its own)."""
  recover(path)  # an export interrupted between its two renames (filesystems without RENAME_EXCHANGE)
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")
  try:
    cfg = K2Config.from_json_file(cfg_path, **k2jax_fields)
  except RecursionError:  # json's C decoder recurses once per level: 100,000 nested `[` end here
    raise CheckpointError(f"{cfg_path}: not valid JSON: nested too deeply") from None
  return cfg.replace(extra=tuple(kv for kv in cfg.extra if kv[0] != QUANTIZATION))


def weight_map(path: str) -> dict[str, str]:
  """HF key -> shard file name; checks that every shard exists."""
  index = os.path.join(path, INDEX)
  if os.path.isfile(index):
    try:
      with open(index) as f:
        wmap = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
      raise CheckpointError(f"{index}: unreadable index ({e})") from e
  elif os.path.isfile(os.path.join(path, SINGLE)):
    wmap = {k: SINGLE for k in read_header(os.path.join(path, SINGLE))}
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


def check_unexpected(path: str, cfg: K2Config, wmap: Mapping[str, str], known: set[str] | None = None):
  """Every tensor in the shards must be a parameter of config.json's model (or in `known`: the scales of
  its block-FP8 weights), a stale `rotary_emb.inv_freq` buffer, or one of the MTP layers config.json
  declares (num_nextn_predict_layers, stored after the last layer; k2jax does not use them)."""
  known = (known or set()) | {k for e in entries(cfg) for _, k in e.keys(cfg)}
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
