"""The bundled offline English corpus: Python's own documentation text.

Two real-prose sources that ship with every CPython, so nothing is downloaded:
`pydoc_data.topics` (the language reference help topics) and the docstrings of the standard
library's modules, classes and functions (read with `ast`, never imported). `scripts/build_corpus.py`
writes them once into `data/corpus/` as jsonl and ArrayRecord (same records, one JSON object
`{"id", "source", "text"}` each); the committed files are what tests and demos read.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from typing import Iterator

from k2jax import pyparse
from k2jax.data.tokenizer import REPO_ROOT

CORPUS_DIR = REPO_ROOT / "data" / "corpus"
BUNDLED_CORPUS = str(CORPUS_DIR / "pydocs.jsonl")
BUNDLED_CORPUS_ARRAY_RECORD = str(CORPUS_DIR / "pydocs.array_record")

# Stdlib folders that are tests, GUIs or vendored code rather than documentation prose.
_SKIP_DIRS = {
  "test",
  "tests",
  "site-packages",
  "idlelib",
  "lib2to3",
  "__pycache__",
  "turtledemo",
  "tkinter",
  "ensurepip",
  "dist-packages",
}


def iter_corpus_records(max_docstring_chars: int, min_docstring_chars: int = 300) -> Iterator[dict]:
  """Yields `{"id", "source", "text"}` records in a fixed order (help topics, then docstrings)."""
  from pydoc_data import topics  # Stdlib; data only.

  for name in sorted(topics.topics):
    text = topics.topics[name].strip()
    if text:
      yield {"id": f"topic/{name}", "source": "pydoc_topics", "text": text}
  total, seen = 0, set()
  for rel, doc in _stdlib_docstrings(min_docstring_chars):
    if doc in seen:
      continue
    seen.add(doc)
    total += len(doc)
    if total > max_docstring_chars:
      return
    yield {"id": f"docstring/{rel}", "source": "stdlib_docstrings", "text": doc}


def write_corpus(records: list[dict], jsonl_path: str, array_record_path: str) -> None:
  """Writes the same records as jsonl lines and as ArrayRecord records (UTF-8 JSON bytes)."""
  from array_record.python.array_record_module import ArrayRecordWriter

  lines = [json.dumps(r, ensure_ascii=False) for r in records]
  with open(jsonl_path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  writer = ArrayRecordWriter(array_record_path, "group_size:1")
  for line in lines:
    writer.write(line.encode("utf-8"))
  writer.close()


def _stdlib_docstrings(min_chars: int) -> Iterator[tuple[str, str]]:
  root = sysconfig.get_paths()["stdlib"]
  for d, dirs, files in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
    for f in sorted(files):
      if not f.endswith(".py"):
        continue
      path = os.path.join(d, f)
      try:
        with open(path, encoding="utf-8") as fh:
          tree = pyparse.parse(fh.read())
      except (SyntaxError, UnicodeDecodeError, ValueError):
        continue  # A few stdlib files are deliberately invalid (test inputs, templates).
      rel = os.path.relpath(path, root)
      for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
          doc = ast.get_docstring(node)
          if doc and len(doc) >= min_chars:
            yield f"{rel}:{getattr(node, 'name', '<module>')}", doc
