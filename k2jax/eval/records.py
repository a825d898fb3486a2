"""What a task format is made of: the `Doc` one record becomes, the `TaskFormat` that parses (and may grade)
it, and the readers of the files the datasets ship: JSONL (`.jsonl`, `.jsonl.gz`), Parquet and CSV.

The lowest module of the task formats: `tasks.py` (the registry), `swe.py`, `grading.py` and every module of
`formats/` import it; it imports none of them. A record that lacks a field, or has one of the wrong type, is
a `TaskFormatError` naming file and line (a Parquet or CSV file's line is its 1-based data row). So is a file
that cannot be read as what its name says: bytes that are not UTF-8 (the line and column of the first bad
byte), a `.gz` that is not gzip or is cut short, a CSV row that the csv module refuses. A UTF-8 byte-order
mark at the start of a JSONL or CSV file is read past (Excel and some exports write one); a CSV field may be
up to `CSV_FIELD_LIMIT` bytes (Python's own default, 128 KiB, is below some benchmark fields).
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from k2jax.eval.verdict import Verdict

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".csv")
_PARQUET_BATCH = 256  # rows converted to Python at a time
CSV_FIELD_LIMIT = 64 << 20  # bytes of one CSV field (the csv module's default, 128 KiB, refuses long rows)
_BOM = b"\xef\xbb\xbf"


class SkipRecord(Exception):  # a signal, not an error
  """Raised by a format's parse for a record the task leaves out (a date window, a test runner the grader does
  not run): not a doc, not an error. Its message says why; the runner counts the records left out per reason."""


class TaskFormatError(ValueError):
  """A task file or record that cannot be read; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class Doc:
  """One problem. `prompt` is the zero-shot prompt; `target` what a few-shot example shows after it."""

  doc_id: str
  prompt: str
  target: str
  data: Mapping[str, Any]
  choices: tuple[str, ...] = ()  # multiple choice: the continuations scored after the prompt
  gold: int = -1  # multiple choice: index of the right choice
  line: int = 0  # the record's line in its file (load_docs sets it), for errors that name the row


# (doc, the model's text, the code sandbox's limits) -> Verdict; a format without one is graded by grading.py.
Grader = Callable[[Doc, str, Any], Verdict]


@dataclasses.dataclass(frozen=True)
class TaskFormat:
  name: str
  kind: str  # "generate" | "choice" | "agentic" (one tool-loop episode per sample, k2jax.eval.swe)
  parse: Callable[[Mapping[str, Any], int], Doc]  # (record, record index) -> Doc; KeyError/TypeError/ValueError
  stop: tuple[str, ...] = ()  # stop strings of a completion (plain-text) prompt
  separator: str = "\n\n"  # between few-shot examples and the question
  grade: Grader | None = None  # the format's own grader (formats/); None: grading.py's
  votes: bool = False  # samples carry an answer maj@k votes on
  # maj@k's equivalence of two answers (the grader's: "\\frac12" and "0.5" are one answer); None: equal strings.
  same: Callable[[str, str], bool] | None = None
  version: str = "1"  # of the grader and format: in every sample's fingerprint (a new grader never reuses old verdicts)
  # Of how `parse` reads a record into what the grader compares against (a reference answer's text): in the
  # fingerprint beside `version` when not "1", for formats whose version is their grader's own.
  reader: str = "1"
  # Task metrics beyond the per-doc ones (pass@k, mean@k, ...): (every doc's samples) -> {metric: value}.
  aggregate: Callable[[list[list[dict]]], dict[str, float]] | None = None


def read_records(path: str, limit: int | None = None) -> Iterator[tuple[int, int, dict]]:
  """Yields (line number, record index, record) for each record of a .jsonl / .jsonl.gz / .parquet / .csv file."""
  if not os.path.isfile(path):
    raise TaskFormatError(f"{path}: no such file")
  if not path.endswith(SUFFIXES):
    raise TaskFormatError(f"{path}: expected a file ending in one of {', '.join(SUFFIXES)}")
  reader = _parquet if path.endswith(".parquet") else _csv if path.endswith(".csv") else _jsonl
  for index, (line_no, record) in enumerate(reader(path)):
    if limit is not None and index >= limit:
      return
    yield line_no, index, record


def _jsonl(path: str) -> Iterator[tuple[int, dict]]:
  for line_no, raw in _lines(path):
    if line_no == 1 and raw.startswith(_BOM):
      raw = raw[len(_BOM) :]
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise TaskFormatError(
        f"{path}:{line_no}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"
      ) from None
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise TaskFormatError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
      raise TaskFormatError(f"{path}:{line_no}: not valid JSON (nested too deep)") from None
    if not isinstance(record, dict):
      raise TaskFormatError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
    yield line_no, record


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
  """(line number, bytes) of a text file or its gzip; a `.gz` that is not gzip, or is cut short, names the file
  and the line it reached."""
  line_no = 0
  try:
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
      for line_no, raw in enumerate(f, 1):
        yield line_no, raw
  except (gzip.BadGzipFile, EOFError, zlib.error) as e:
    where = "" if line_no == 0 else f" (after line {line_no})"
    raise TaskFormatError(f"{path}: not a readable gzip file{where}: {e}") from None


def _parquet(path: str) -> Iterator[tuple[int, dict]]:
  import pyarrow.parquet as pq

  try:
    file = pq.ParquetFile(path)
  except Exception as e:  # noqa: BLE001  pyarrow raises ArrowInvalid / OSError on a file that is not Parquet
    raise TaskFormatError(f"{path}: not a Parquet file ({e})") from None
  row = 0
  for batch in file.iter_batches(batch_size=_PARQUET_BATCH):
    for record in batch.to_pylist():
      row += 1
      yield row, record


def _csv(path: str) -> Iterator[tuple[int, dict]]:
  with open(path, "rb") as f:
    data = f.read()
  data = data.removeprefix(_BOM)
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    column = e.start - data.rfind(b"\n", 0, e.start)
    raise TaskFormatError(
      f"{path}: file line {line}: not UTF-8 text (byte {data[e.start]:#04x} at column {column})"
    ) from None
  if csv.field_size_limit() < CSV_FIELD_LIMIT:
    csv.field_size_limit(CSV_FIELD_LIMIT)
  reader = csv.DictReader(io.StringIO(text, newline=""))
  row = 0
  try:
    for row, record in enumerate(reader, 1):  # row 1: the first data row (after the header)
      if None in record:  # more cells than the header names
        raise TaskFormatError(
          f"{path}:{row}: {len(record[None])} more cells than the header's {len(reader.fieldnames)}"
        )
      yield row, record
  except csv.Error as e:
    raise TaskFormatError(f"{path}:{row + 1}: not a CSV row (file line {reader.line_num}): {e}") from None


# ---- field readers (a KeyError names a missing field; TypeError / ValueError a wrong one) ----------------
def str_field(r: Mapping[str, Any], key: str) -> str:
  v = r[key]
  if not isinstance(v, str):
    raise TypeError(f"field '{key}' must be a string, got {type(v).__name__}")
  return v


def str_list(r: Mapping[str, Any], key: str) -> list[str]:
  v = r[key]
  if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
    raise TypeError(f"field '{key}' must be a non-empty list of strings")
  return v


def first_field(r: Mapping[str, Any], keys: tuple[str, ...]) -> str:
  """The first of `keys` the record has (datasets of one benchmark spell a field differently)."""
  for key in keys:
    if key in r:
      return key
  raise ValueError(f"missing field '{keys[0]}' (or " + ", ".join(f"'{k}'" for k in keys[1:]) + ")")


def record_id(r: Mapping[str, Any], keys: tuple[str, ...], i: int) -> str:
  """The first of `keys` that holds a string or an integer, else the record's index."""
  for key in keys:
    v = r.get(key)
    if isinstance(v, (str, int)) and not isinstance(v, bool):
      return str(v)
  return str(i)


def canonical_number(text: str) -> str | None:
  """The first number in `text` as a canonical string ('1,234.50' -> '1234.5'); None when there is none."""
  m = _NUMBER.search(text)
  if not m:
    return None
  raw = m.group(0).replace(",", "").rstrip(".")
  value = float(raw)
  return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
