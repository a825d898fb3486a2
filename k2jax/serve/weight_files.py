"""Checks a weights directory sent to `/update_weights_from_disk` before the engine reads a byte of it.

The route trusts its caller (it needs the API key) but not the files: a trainer's torn write or a hostile
file must answer 400 naming the file and what is wrong, and leave the served weights as they are. The
safetensors library does check its header, but raises one untyped `SafetensorError` from wherever the
loader first touches the file (the probe got 500s), so every header is validated first by the reader's
own parser (`k2jax.convert.safetensors_io.read_header`: the format's invariants, one place for both).
Every file read must resolve (symlinks included) inside an allowed root and be a regular file (a FIFO
would block the reading worker forever): shards are opened non-blocking and checked on the fd
(`safetensors_io.open_regular`), config.json and the index are checked before they are opened. A
config.json that is not a JSON object within Python's nesting limit is refused here too; NaN or Inf
values in the shards are refused by the reader as it reads them (`safetensors_io.read_into`).
"""

from __future__ import annotations

import json
import os
import stat

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


def check_model_path(model_path: str) -> None:
  """A path the OS can take: no NUL byte (os calls raise ValueError on it; the probe got a 500)."""
  if "\0" in model_path:
    raise WeightFileError(f"model_path {model_path[:200]!r} contains a NUL byte")


def check_weights_dir(path: str, roots: list[str]) -> None:
  """Raises WeightFileError for the first file of `path` that the loader would fail on or block on."""
  config = os.path.join(path, "config.json")
  if os.path.lexists(config):
    if not inside(config, roots):
      raise WeightFileError(f"{config}: resolves to {os.path.realpath(config)}, outside the weights roots", 403)
    _read_json(config)
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
  if os.path.lexists(index):
    wmap = _read_json(index).get("weight_map")
    if not isinstance(wmap, dict) or not all(isinstance(v, str) and v for v in wmap.values()):
      raise WeightFileError(f"{index}: weight_map must be an object of shard file names")
    return [os.path.join(path, shard) for shard in sorted(set(wmap.values()))]
  single = os.path.join(path, SINGLE)
  return [single] if os.path.lexists(single) else []


def _read_json(file: str) -> dict:
  """A JSON object from a regular file; WeightFileError for anything else (a FIFO is never opened)."""
  try:
    mode = os.stat(file).st_mode
    if not stat.S_ISREG(mode):
      raise WeightFileError(f"{file}: not a regular file (mode {stat.filemode(mode)}); weights must be plain files")
    with os.fdopen(os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
      if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped in since the stat (opened non-blocking)
        raise WeightFileError(f"{file}: not a regular file; weights must be plain files")
      data = json.loads(f.read())
  except RecursionError:
    raise WeightFileError(f"{file}: not valid JSON: nested too deeply") from None
  except (OSError, ValueError) as e:
    if isinstance(e, WeightFileError):
      raise
    raise WeightFileError(f"{file}: unreadable ({str(e)[:120]})") from None
  if not isinstance(data, dict):
    raise WeightFileError(f"{file}: a JSON {type(data).__name__}, not an object")
  return data
