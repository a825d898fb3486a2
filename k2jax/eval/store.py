"""The run's output directory: an append-only samples file a rerun resumes from, and atomically written reports.

`samples.jsonl` holds one JSON line per scored sample, keyed by (task, doc_id, sample index) and stamped with
the fingerprint of the settings that produced it. Each line is written whole by one `write` and flushed, so a
killed run leaves complete lines plus at most one torn last line, which the next open cuts off. A rerun scores
only the keys the file lacks; a key stamped with another fingerprint (other sampling settings, prompt format or
model) is an error rather than a silent mix. Reports are written to a temporary file and renamed into place.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading

SAMPLES = "samples.jsonl"

Key = tuple[str, str, int]


class SampleStore:
  def __init__(self, out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    self.path = os.path.join(out_dir, SAMPLES)
    self.records: dict[Key, dict] = {}
    self._lock = threading.Lock()
    self.torn_bytes = _cut_torn_tail(self.path)
    if os.path.exists(self.path):
      with open(self.path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
          try:
            rec = json.loads(line)
            self.records[(rec["task"], rec["doc_id"], int(rec["sample"]))] = rec
          except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.path}:{line_no}: not a sample record ({e}); move the file away to start over")
    self._file = open(self.path, "a", encoding="utf-8")

  def get(self, key: Key, fingerprint: str) -> dict | None:
    """The stored record of `key`, or None; ValueError when it was made with other settings."""
    rec = self.records.get(key)
    if rec is not None and rec["fingerprint"] != fingerprint:
      raise ValueError(
        f"{self.path}: task {key[0]!r} doc {key[1]!r} sample {key[2]} was made with other settings "
        f"(fingerprint {rec['fingerprint']}, this run {fingerprint}): use another --out or remove the file"
      )
    return rec

  def add(self, record: dict) -> None:
    line = json.dumps(record, ensure_ascii=False) + "\n"
    with self._lock:
      self._file.write(line)  # one write of a whole line: a kill cannot interleave two records
      self._file.flush()
      self.records[(record["task"], record["doc_id"], int(record["sample"]))] = record

  def sync(self) -> None:
    with self._lock:
      self._file.flush()
      os.fsync(self._file.fileno())

  def close(self) -> None:
    with self._lock:
      if not self._file.closed:
        self._file.close()


def write_atomic(path: str, text: str) -> None:
  """`path` holds either its old content or all of `text`, never a part."""
  d = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.")
  try:
    os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a report is for everyone who can read the dir
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def _cut_torn_tail(path: str) -> int:
  """Truncates a last line without its newline (a write the kill interrupted); returns the bytes cut."""
  if not os.path.exists(path):
    return 0
  with open(path, "rb+") as f:
    data = f.read()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
      f.truncate(keep)
    return len(data) - keep
