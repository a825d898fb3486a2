"""The run's output directory: an append-only samples file a rerun resumes from, and atomically written reports.

`samples.jsonl` holds one JSON line per scored sample, keyed by (task, doc_id, sample index) and stamped with
the fingerprint of what produced it, in parts: the model's content, the data files' content, the grader's
and format's version, and the sampling / prompt settings. Each line is written whole by one `write` and
flushed, so a killed run leaves complete lines plus at most one torn last line, which the next open cuts off.
A rerun scores only the keys the file lacks; a key stamped with another fingerprint is an error naming the
parts that changed, rather than a silent mix. Reports are written to a temporary file and renamed into place.

Content is hashed by `ContentHasher`: sha256 of each file, cached in `content_hashes.json` by the file's real
path, size, mtime_ns and ctime_ns (a checkpoint rewritten in place changes them), so a rerun of a large
checkpoint re-reads none of it; files of at most `SMALL_FILE` bytes (configs, manifests) are always hashed.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Mapping

SAMPLES = "samples.jsonl"
CONTENT_CACHE = "content_hashes.json"
SMALL_FILE = 1 << 20  # bytes: hashed on every run, never cached

Key = tuple[str, str, int]
# What each fingerprint part covers, for the error that names the parts that changed.
PARTS = {
  "model": "the model's content",
  "data": "the task's data file (or few-shot file) content",
  "grader": "the grader / format version",
  "settings": "the sampling or prompt settings",
}


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
    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  held open until close()

  def get(self, key: Key, fingerprint: Mapping[str, str]) -> dict | None:
    """The stored record of `key`, or None; ValueError naming what changed when it was made otherwise."""
    rec = self.records.get(key)
    if rec is not None and rec["fingerprint"] != fingerprint:
      stored = rec["fingerprint"]
      if isinstance(stored, Mapping):
        changed = [p for p in dict.fromkeys([*fingerprint, *stored]) if stored.get(p) != fingerprint.get(p)]
        what = ", ".join(f"{PARTS.get(p, p)} ({p} {stored.get(p)} then, {fingerprint.get(p)} now)" for p in changed)
      else:
        what = f"a fingerprint without parts ({stored}), from a k2jax before content fingerprints"
      raise ValueError(
        f"{self.path}: task {key[0]!r} doc {key[1]!r} sample {key[2]} was made with other settings: {what} "
        "changed; its samples cannot be reused: use a fresh --out (or remove the file)"
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


class ContentHasher:
  """sha256 of files' content, cached in `out_dir/content_hashes.json` by (real path, size, mtime_ns,
  ctime_ns); `save` writes the cache back."""

  def __init__(self, out_dir: str, small_file: int = SMALL_FILE, workers: int = 8):
    self.path = os.path.join(out_dir, CONTENT_CACHE)
    self.small_file, self.workers = small_file, workers
    self.hashed_bytes = 0  # read this run (what the cache saved is the rest)
    self.cache: dict[str, dict] = {}
    self._lock = threading.Lock()
    if os.path.exists(self.path):
      try:
        with open(self.path, encoding="utf-8") as f:
          self.cache = dict(json.load(f))
      except (OSError, ValueError, TypeError):
        self.cache = {}  # a cache only: rebuilt from the files

  def file(self, path: str) -> str:
    """The hex sha256 of `path`'s bytes."""
    return self.files([path])[0]

  def files(self, paths: list[str]) -> list[str]:
    """The hex sha256 of each path (uncached large files hashed by `workers` threads: hashlib frees the GIL)."""
    with cf.ThreadPoolExecutor(self.workers) as pool:
      return list(pool.map(self._one, paths))

  def tree(self, root: str, rels: list[str]) -> tuple[str, int]:
    """(sha256 over each relative path, size and content hash of `rels` under `root`, their total bytes)."""
    rels = sorted(rels)
    hashes = self.files([os.path.join(root, r) for r in rels])
    h, total = hashlib.sha256(), 0
    for rel, digest in zip(rels, hashes):
      size = os.path.getsize(os.path.join(root, rel))
      total += size
      h.update(f"{rel}\0{size}\0{digest}\n".encode())
    return h.hexdigest(), total

  def save(self) -> None:
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    with self._lock:
      text = json.dumps(self.cache, indent=0, sort_keys=True)
    write_atomic(self.path, text)

  def _one(self, path: str) -> str:
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
    if st.st_size > self.small_file:
      with self._lock:
        hit = self.cache.get(real)
      if hit is not None and all(hit.get(k) == v for k, v in stamp.items()):
        return hit["sha256"]
    with open(real, "rb") as f:
      digest = hashlib.file_digest(f, "sha256").hexdigest()
    with self._lock:
      self.hashed_bytes += st.st_size
      if st.st_size > self.small_file:
        self.cache[real] = {**stamp, "sha256": digest}
    return digest


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
