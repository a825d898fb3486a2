"""Builds the bundled corpus in data/corpus/ from Python's own documentation text (offline).

  python scripts/build_corpus.py [--max_docstring_chars=600000]

Writes data/corpus/pydocs.jsonl and data/corpus/pydocs.array_record (same records).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from k2jax.data import corpus  # noqa: E402

_MAX = flags.DEFINE_integer("max_docstring_chars", 600_000, "Cap on stdlib docstring characters.")


def main(argv):
  del argv
  records = list(corpus.iter_corpus_records(_MAX.value))
  os.makedirs(corpus.CORPUS_DIR, exist_ok=True)
  corpus.write_corpus(records, corpus.BUNDLED_CORPUS, corpus.BUNDLED_CORPUS_ARRAY_RECORD)
  chars = sum(len(r["text"]) for r in records)
  print(f"documents={len(records)} characters={chars} jsonl={corpus.BUNDLED_CORPUS}")


if __name__ == "__main__":
  app.run(main)
