"""Random-access record sources (jsonl, parquet, ArrayRecord) and record decoding.

All three give grain a `Sequence` of raw records, so shuffling, sharding and mixing happen on
`MapDataset` indices. A missing or unreadable file fails here, at pipeline construction, with the
path in the message; bad individual records are not errors but `Issue` codes (see report.py).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import mmap
import os
from typing import Any

import grain
import numpy as np

from k2jax.data.report import Issue


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  """One data source. `path` may be a glob (files are read in sorted order).

  Records are JSON objects (a jsonl line, an ArrayRecord record of UTF-8 JSON, a parquet row) with
  either a text field (`text_field`) or pre-tokenized `input_ids`.
  """

  path: str
  weight: float = 1.0
  text_field: str = "text"


@dataclasses.dataclass(frozen=True)
class HoldoutSplit:
  """A fraction of every source's records set aside for held-out evaluation, never read by training.

  A record's id is its index in its source (`open_source`: files in sorted order, concatenated; rows in
  file order). Record i is held out iff `u(i) < fraction`, where `u(i)` in [0, 1) is the splitmix64 hash
  of `i` and `seed`: a pure function of the id, so every host, process count and resume draws the same
  split, and no held-out record reaches any process's training stream. Appending files at the end of a
  source keeps the split of its existing records; inserting or reordering files re-deals it.
  """

  fraction: float = 0.0
  seed: int = 0

  def __post_init__(self):
    if not 0.0 <= self.fraction < 1.0:
      raise ValueError(f"HoldoutSplit.fraction: {self.fraction} not in [0, 1)")


_HASH_CHUNK = 1 << 22  # ids hashed per numpy pass: bounds the split's transient memory (32 MiB)


def record_hash(ids: np.ndarray, seed: int) -> np.ndarray:
  """splitmix64 of `ids` (uint64) salted by `seed`, as floats in [0, 1).

  Hand-written (a dozen numpy ops) because it must be vectorised over billions of ids and stable forever:
  Python's `hash` is salted per process and hashlib runs one id per call."""
  with np.errstate(over="ignore"):
    z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15) * np.uint64(seed + 1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
  return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def heldout_ids(n: int, split: HoldoutSplit) -> np.ndarray:
  """Sorted ids in [0, n) that `split` holds out (int64); memory is that of the held-out ids only."""
  out = []
  for lo in range(0, n, _HASH_CHUNK):
    ids = np.arange(lo, min(n, lo + _HASH_CHUNK), dtype=np.int64)
    out.append(ids[record_hash(ids, split.seed) < split.fraction])
  return np.concatenate(out) if out else np.zeros(0, np.int64)


def training_records(ds: grain.MapDataset, split: HoldoutSplit | None) -> grain.MapDataset:
  """`ds` without the records `split` holds out (in their original order); `ds` itself when none are."""
  if split is None or split.fraction == 0.0:
    return ds
  held = heldout_ids(len(ds), split)
  if len(held) == len(ds):
    raise ValueError(f"HoldoutSplit(fraction={split.fraction}) holds out all {len(ds)} records: none left to train")
  return grain.MapDataset.source(_Complement(ds, held))


def heldout_records(ds: grain.MapDataset, split: HoldoutSplit) -> tuple[grain.MapDataset, np.ndarray]:
  """(the held-out records of `ds` ordered by their hash: a fixed shuffle; their ids in that order)."""
  held = heldout_ids(len(ds), split)
  if len(held) == 0:
    raise ValueError(f"HoldoutSplit(fraction={split.fraction}, seed={split.seed}) holds out none of {len(ds)} records")
  held = held[np.argsort(record_hash(held, split.seed), kind="stable")]
  return subset(ds, held), held


def subset(ds: grain.MapDataset, ids: np.ndarray) -> grain.MapDataset:
  """Records `ids` of `ds`, in that order."""
  return grain.MapDataset.source(_Subset(ds, ids))


class _Subset:
  """Records `ids` of `ds`, by position."""

  def __init__(self, ds, ids: np.ndarray):
    self.ds, self.ids = ds, ids

  def __len__(self) -> int:
    return len(self.ids)

  def __getitem__(self, k: int):
    return self.ds[int(self.ids[k])]


class _Complement:
  """Records of `ds` not in the sorted `held` ids, in order. Record k is id k + (held ids at or before it):
  with d[j] = held[j] - j (training records before held[j]), that count is searchsorted(d, k, 'right')."""

  def __init__(self, ds, held: np.ndarray):
    self.ds = ds
    self.n = len(ds) - len(held)
    self.d = held - np.arange(len(held), dtype=np.int64)

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, k: int):
    k = int(k)
    if not 0 <= k < self.n:
      raise IndexError(f"record {k} of {self.n}")
    return self.ds[k + int(np.searchsorted(self.d, k, side="right"))]


def open_source(spec: SourceSpec) -> grain.MapDataset:
  """MapDataset of raw records (bytes or dict) over all files of `spec`; fails early on bad paths."""
  paths = sorted(glob.glob(spec.path)) if glob.has_magic(spec.path) else [spec.path]
  if not paths:
    raise FileNotFoundError(f"data source pattern matches no files: {spec.path}")
  parts = [grain.MapDataset.source(_open_file(p, spec.text_field)) for p in paths]
  ds = parts[0] if len(parts) == 1 else grain.MapDataset.concatenate(parts)
  if len(ds) == 0:
    raise ValueError(f"data source has no records: {spec.path}")
  return ds


def _open_file(path: str, text_field: str):
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data source file not found: {path}")
  if not os.access(path, os.R_OK):
    raise PermissionError(f"data source file not readable: {path}")
  if path.endswith((".jsonl", ".json")):
    return JsonlSource(path)
  if path.endswith(".parquet"):
    return ParquetSource(path, text_field)
  if ".array_record" in os.path.basename(path) or path.endswith(".arrayrecord"):
    try:
      return grain.sources.ArrayRecordDataSource([path])
    except Exception as e:  # The C++ reader's message does not always name the file.
      raise ValueError(f"cannot open ArrayRecord file {path}: {e}") from e
  raise ValueError(f"unknown data source format (want .jsonl, .parquet, .array_record): {path}")


class JsonlSource:
  """Lines of a jsonl file as bytes, by index. Line offsets are found once (vectorised) at open."""

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    if size == 0:
      self._starts = self._ends = np.zeros(0, np.int64)
      return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
      newlines = np.flatnonzero(np.frombuffer(mm, np.uint8) == ord("\n"))
    starts = np.concatenate([[0], newlines + 1])
    ends = np.concatenate([newlines, [size]])
    keep = starts < size  # A trailing newline does not start another record.
    self._starts, self._ends = starts[keep], ends[keep]
    self._fd = None

  def __len__(self) -> int:
    return len(self._starts)

  def __getitem__(self, index: int) -> bytes:
    if self._fd is None:  # Opened lazily so the source pickles into grain worker processes.
      self._fd = os.open(self.path, os.O_RDONLY)
    start = int(self._starts[index])
    return os.pread(self._fd, int(self._ends[index]) - start, start)

  def __getstate__(self):
    return {**self.__dict__, "_fd": None}

  def __repr__(self) -> str:
    return f"JsonlSource({self.path!r}, records={len(self)})"


class ParquetSource:
  """Rows of one parquet column as `{field: value}` dicts; the column is memory-mapped per process."""

  def __init__(self, path: str, field: str):
    import pyarrow.parquet as pq

    self.path = path
    try:
      meta = pq.ParquetFile(path)
    except Exception as e:
      raise ValueError(f"cannot read parquet file {path}: {e}") from e
    names = meta.schema_arrow.names
    self.field = "input_ids" if "input_ids" in names else field
    if self.field not in names:
      raise ValueError(f"parquet file {path} has no column {field!r} or 'input_ids' (has {names})")
    self._len = meta.metadata.num_rows
    self._column = None

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict:
    if self._column is None:
      import pyarrow.parquet as pq

      self._column = pq.read_table(self.path, columns=[self.field], memory_map=True)[self.field]
    return {self.field: self._column[int(index)].as_py()}

  def __getstate__(self):
    return {**self.__dict__, "_column": None}

  def __repr__(self) -> str:
    return f"ParquetSource({self.path!r}, field={self.field!r}, records={len(self)})"


def decode_record(raw: Any) -> tuple[dict | None, Issue]:
  """Raw record -> (JSON object, Issue.OK) or (None, the reason it is unusable)."""
  if isinstance(raw, dict):
    return raw, Issue.OK
  try:
    line = raw.decode("utf-8")
  except UnicodeDecodeError:
    return None, Issue.NOT_UTF8
  if not line.strip():
    return None, Issue.EMPTY
  try:
    obj = json.loads(line)
  except ValueError:
    return None, Issue.MALFORMED_JSON
  if not isinstance(obj, dict):
    return None, Issue.MALFORMED_JSON
  return obj, Issue.OK


def end_torn_line(path: str) -> None:
  """Terminate a torn last line of an append-only jsonl output (a crash mid-write), so the next
  appended record starts on its own line; readers skip the torn record and its unit is redone."""
  if os.path.exists(path) and os.path.getsize(path) > 0:
    with open(path, "rb+") as f:
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        f.write(b"\n")


def iter_jsonl_strict(path: str):
  """(line number, record) for each non-blank line of a small curated jsonl file; a malformed line is
  an error naming `path:line` (unlike the training sources, which count and skip bad records)."""
  with open(path, encoding="utf-8") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield line_no, json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: not JSON ({e})") from e
