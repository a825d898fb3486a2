"""Checks a weights directory sent to `/update_weights_from_disk` before the engine reads a byte of it.

The route trusts its caller (it needs the API key) but not the files: a trainer's torn write or a hostile
file must answer 400 naming the file and what is wrong, and leave the served weights as they are. The
safetensors library does check its header, but raises one untyped `SafetensorError` from wherever the
loader first touches the file (the probe got 500s), so the format's invariants are checked here first,
in one place: an 8-byte little-endian header length that fits the file, a JSON object header, and per
tensor a known dtype, a shape of non-negative ints and `data_offsets` inside the data whose size matches
dtype x shape. Every file read must resolve (symlinks included) inside an allowed root.
"""

from __future__ import annotations

import json
import math
import os
import struct

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (MAX_HEADER_SIZE)
_ITEMSIZE = {
  "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2, "F16": 2,
  "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


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
    size = os.path.getsize(file)
    with open(file, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise WeightFileError(f"{file}: {size} bytes, too short for a safetensors header length (8 bytes)")
      (n,) = struct.unpack("<Q", head)
      if n == 0 or n > min(MAX_HEADER_BYTES, size - 8):
        raise WeightFileError(f"{file}: header length {n} does not fit the file ({size} bytes; at most 100 MB)")
      raw = f.read(n)
  except OSError as e:
    raise WeightFileError(f"{file}: cannot read ({e.strerror})") from e
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise WeightFileError(f"{file}: header is not valid UTF-8 JSON ({str(e)[:120]})") from None
  if not isinstance(header, dict):
    raise WeightFileError(f"{file}: header is a JSON {type(header).__name__}, not an object")
  data = size - 8 - n
  for name, info in header.items():
    if name == "__metadata__":
      if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
        raise WeightFileError(f"{file}: __metadata__ must be an object of strings")
      continue
    _check_tensor(file, name, info, data)


def _check_tensor(file: str, name: str, info, data: int) -> None:
  where = f"{file}: tensor {name!r}"
  if not isinstance(info, dict):
    raise WeightFileError(f"{where}: entry is not an object")
  dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
  if dtype not in _ITEMSIZE:
    raise WeightFileError(f"{where}: unknown dtype {str(dtype)[:40]!r}")
  if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
    raise WeightFileError(f"{where}: shape {str(shape)[:80]} is not a list of non-negative ints")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
    raise WeightFileError(f"{where}: data_offsets {str(offsets)[:80]} is not [begin, end]")
  begin, end = offsets
  if not 0 <= begin <= end <= data:
    raise WeightFileError(f"{where}: data_offsets [{begin}, {end}] outside the file's {data} data bytes")
  want = math.prod(shape) * _ITEMSIZE[dtype]
  if end - begin != want:
    raise WeightFileError(f"{where}: {end - begin} bytes at data_offsets, but {dtype} {shape} needs {want}")


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
