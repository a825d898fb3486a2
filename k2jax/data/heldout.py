"""Held-out evaluation batches: the same global stream of packed batches on every host and process count.

A held-out source is either its own files (every record) or the records a `HoldoutSplit` sets aside from a
training source (`sources.heldout_records`; training reads the complement). Records are read in a fixed
order (sorted by their id's hash: a shuffle that never changes), tokenized like training (pretraining text
+ EOS, or the SFT chat template with assistant-only loss) and packed by the training packer into batches of
`rows` global rows; the last partial batch is padded with all-padding rows (loss_mask 0), so every batch
has the same shape. Every process builds the whole global batch and feeds the rows its devices hold: the
batches, and so the eval numbers, do not depend on how many processes read them.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator

import grain
import numpy as np

from k2jax.data.packing import BATCH_KEYS, pack_and_batch
from k2jax.data.pretrain import TokenizeDocument
from k2jax.data.sft import RenderConversation
from k2jax.data.sources import HoldoutSplit, SourceSpec, heldout_records, open_source, record_hash, subset
from k2jax.data.tokenizer import load_tokenizer

KINDS = ("pretrain", "sft")


@dataclasses.dataclass(frozen=True)
class HeldoutSource:
  """One held-out source: `spec`'s records held out by `split`, or all of them when `split` is None."""

  name: str
  spec: SourceSpec
  split: HoldoutSplit | None = None


def parse_sources(paths: str) -> tuple[HeldoutSource, ...]:
  """`"[name=]path_or_glob,..."` -> sources with all their records held out; a name defaults to the
  file name without extension (`eval/<name>/loss`)."""
  out = []
  for entry in (e.strip() for e in paths.split(",")):
    if not entry:
      continue
    name, sep, path = entry.partition("=")
    if not sep:
      name, path = _stem(entry), entry
    out.append(HeldoutSource(name.strip(), SourceSpec(path.strip())))
  return _unique(out)


def split_sources(specs: tuple[SourceSpec, ...], split: HoldoutSplit) -> tuple[HeldoutSource, ...]:
  """The held-out part of each training source, named after its file."""
  return _unique([HeldoutSource(_stem(s.path), s, split) for s in specs])


def _stem(path: str) -> str:
  base = os.path.basename(path.rstrip("/")) or path
  for ext in (".jsonl", ".json", ".parquet", ".array_record", ".arrayrecord"):
    if base.endswith(ext):
      return base[: -len(ext)]
  return base


def _unique(sources: list[HeldoutSource]) -> tuple[HeldoutSource, ...]:
  """Names made unique (`a`, `a_1`, ...) and safe as metric keys (no '/')."""
  seen: set[str] = set()
  out = []
  for s in sources:
    base = s.name.replace("/", "_") or "source"
    name, k = base, 0
    while name in seen:
      k += 1
      name = f"{base}_{k}"
    seen.add(name)
    out.append(dataclasses.replace(s, name=name))
  return tuple(out)


def source_records(source: HeldoutSource) -> grain.MapDataset:
  """The held-out records of `source` in their fixed (hash-sorted) order."""
  ds = open_source(source.spec)
  if source.split is not None:
    return heldout_records(ds, source.split)[0]
  return subset(ds, np.argsort(record_hash(np.arange(len(ds), dtype=np.int64), 0), kind="stable"))


def batches(
  source: HeldoutSource,
  *,
  kind: str,
  seq_len: int,
  rows: int,
  tokenizer_path: str,
  max_batches: int = 0,
  num_packing_bins: int = 256,
) -> Iterator[dict]:
  """Global held-out batches of `source` (BATCH_KEYS, int32 [rows, seq_len]); `max_batches` = 0: all."""
  if kind not in KINDS:
    raise ValueError(f"held-out kind {kind!r} not in {KINDS}")
  tok = load_tokenizer(tokenizer_path)
  ds = source_records(source)
  if kind == "pretrain":
    ds = ds.map(TokenizeDocument(tokenizer_path, source.spec.text_field, tok.vocab_size, False, True))
  else:
    ds = ds.map(RenderConversation(tokenizer_path, None))
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=max(64, 4 * rows)))
  packed = pack_and_batch(
    it,
    seq_len=seq_len,
    batch_size=rows,
    num_packing_bins=num_packing_bins,
    seed=0,
    num_workers=0,
    worker_buffer_size=1,
  )
  for b in itertools.islice(packed, max_batches or None):
    yield {k: np.asarray(b[k], np.int32) for k in BATCH_KEYS}


def token_bytes(tokenizer_path: str, size: int) -> np.ndarray:
  """int64 [size]: UTF-8 bytes of each token's text (byte-level BPE: a text's token bytes sum to its own
  byte length). Special tokens, and ids past the tokenizer (a model vocab padded beyond it), count 0 bytes:
  they are markup, not text."""
  tok = load_tokenizer(tokenizer_path)
  out = np.zeros(max(size, 0), np.int64)
  n = min(size, tok.num_base_tokens)
  # The tokenizer wraps tiktoken; its Encoding gives each rank's exact bytes (its text API would replace
  # a partial UTF-8 sequence with U+FFFD and miscount).
  enc = tok._enc
  out[:n] = [len(enc.decode_single_token_bytes(i)) for i in range(n)]
  return out
