"""Checks a weights directory sent to `/update_weights_from_disk` before the engine reads a byte of it.

The route trusts its caller (it needs the API key) but not the files: a trainer's torn write or a hostile
file must answer 400 naming the file and what is wrong, and leave the served weights as they are. The
safetensors library does check its header, but raises one untyped `SafetensorError` from wherever the
loader first touches the file (the probe got 500s), so every header is validated first by the reader's
own parser (`k2jax.convert.safetensors_io.read_header`: the format's invariants, one place for both).
Every file read must resolve (symlinks included) inside an allowed root.
"""

from __future__ import annotations

import json
import os

from k2jax.convert import safetensors_io
from k2jax.convert.errors import CheckpointError

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


class WeightFileError(ValueError):
  """A weights file the server refuses; `status` 400 (malformed) or 403 (outside the weights roots)."""

  def __init__(self, message: str, status: int = 400):
    super().__init__(message)
    self.status = status


def inside(path: str, roots: list[str]) -> bool:
  real = os.path.realpath(path)
  return any(os.path.commonpath([real, root]) == root for root in roots)


def check_weights_dir(path: str, roots: list[str]) -> None:
  """Raises WeightFileError for the first safetensors file of `path` that the loader would fail on."""
  for file in _shards(path):
    if not inside(file, roots):
      raise WeightFileError(f"{file}: resolves to {os.path.realpath(file)}, outside the weights roots", 403)
    check_safetensors(file)


def check_safetensors(file: str) -> None:
  try:
    safetensors_io.read_header(file)
  except CheckpointError as e:
    raise WeightFileError(str(e)) from None


def _shards(path: str) -> list[str]:
  """The safetensors files the loader reads: the index's shards, else model.safetensors (none for a
  k2jax workdir, which the engine loads through orbax)."""
  index = os.path.join(path, INDEX)
  if os.path.isfile(index):
    try:
      with open(index) as f:
        wmap = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError, RecursionError) as e:
      raise WeightFileError(f"{index}: unreadable index ({str(e)[:120]})") from None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) and v for v in wmap.values()):
      raise WeightFileError(f"{index}: weight_map must be an object of shard file names")
    return [os.path.join(path, shard) for shard in sorted(set(wmap.values()))]
  single = os.path.join(path, SINGLE)
  return [single] if os.path.isfile(single) else []
