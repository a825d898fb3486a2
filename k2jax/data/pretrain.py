"""Pretraining input pipeline on grain: sources -> shard -> shuffle -> repeat -> mix -> tokenize
-> pack -> batch -> multiprocess prefetch, with an exactly resumable iterator state.

  it = make_pretrain_iter(PretrainDataConfig(), process_index=0, process_count=1)
  batch = next(it)          # dict of int32 [B, T], see packing.py
  state = it.get_state()    # into the training checkpoint (see checkpoint.py)
  it.report.summary()       # bad-input counts so far

Each JAX process reads a disjoint slice of every source (documents i with i % process_count ==
process_index), shuffled with `seed` and reshuffled every epoch; mixtures interleave sources by
weight deterministically (grain's mix). Documents get EOS appended (and BOS prepended if asked).
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from k2jax.data.corpus import BUNDLED_CORPUS
from k2jax.data.packing import pack_and_batch
from k2jax.data.report import Issue
from k2jax.data.sources import HoldoutSplit, SourceSpec, decode_record, open_source, training_records
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer


@dataclasses.dataclass(frozen=True)
class PretrainDataConfig:
  """Pretraining data. `batch_size` is per JAX process; `num_epochs=None` repeats forever
  (a mixture's length is its shortest component's, so mix only infinite streams)."""

  sources: tuple[SourceSpec, ...] = (SourceSpec(BUNDLED_CORPUS),)
  seq_len: int = 1024
  batch_size: int = 8
  seed: int = 0
  tokenizer_path: str = BUNDLED_TOKENIZER
  num_epochs: int | None = None
  num_workers: int = 0  # grain mp_prefetch worker processes (0 = in-process).
  worker_buffer_size: int = 2  # Batches each worker keeps ready.
  read_threads: int = 0  # Threads reading + tokenizing ahead (per process or worker).
  num_packing_bins: int = 256  # Open best-fit bins; more bins = less padding (98.4% at 1024).
  add_bos: bool = False
  append_eos: bool = True
  holdout: HoldoutSplit | None = None  # records set aside for evaluation, never read (sources.HoldoutSplit)


def make_pretrain_iter(
  cfg: PretrainDataConfig, *, process_index: int = 0, process_count: int = 1
) -> grain.DatasetIterator:
  """The pretraining batch iterator for one JAX process (supports get_state/set_state)."""
  return iter(build_pretrain_dataset(cfg, process_index=process_index, process_count=process_count))


def build_pretrain_dataset(cfg: PretrainDataConfig, *, process_index: int, process_count: int) -> grain.IterDataset:
  """The grain IterDataset behind `make_pretrain_iter` (for benchmarks and custom iteration)."""
  if not cfg.sources:
    raise ValueError("PretrainDataConfig.sources is empty")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
  tok = load_tokenizer(cfg.tokenizer_path)  # Fails now, naming the path, if it is bad.
  parts = []
  for i, spec in enumerate(cfg.sources):
    ds = training_records(open_source(spec), cfg.holdout)[process_index::process_count]
    ds = ds.shuffle(seed=cfg.seed + 7919 * i).repeat(cfg.num_epochs)
    parts.append(
      ds.map(TokenizeDocument(cfg.tokenizer_path, spec.text_field, tok.vocab_size, cfg.add_bos, cfg.append_eos))
    )
  weights = [s.weight for s in cfg.sources]
  ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
  it = ds.to_iter_dataset(
    grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=max(64, 4 * cfg.batch_size))
  )
  return pack_and_batch(
    it,
    seq_len=cfg.seq_len,
    batch_size=cfg.batch_size,
    num_packing_bins=cfg.num_packing_bins,
    seed=cfg.seed,
    num_workers=cfg.num_workers,
    worker_buffer_size=cfg.worker_buffer_size,
  )


class TokenizeDocument(grain.transforms.Map):
  """Raw record -> `{"input_ids", "token_mask", "issue"}`; unusable records become empty + issue."""

  def __init__(self, tokenizer_path: str, text_field: str, vocab_size: int, add_bos: bool, append_eos: bool):
    self.tokenizer_path, self.text_field, self.vocab_size = tokenizer_path, text_field, vocab_size
    self.add_bos, self.append_eos = add_bos, append_eos

  def map(self, raw) -> dict:
    obj, issue = decode_record(raw)
    ids = None
    if obj is not None:
      ids, issue = self._ids(obj)
    if ids is None:
      return _dropped(issue)
    tok = load_tokenizer(self.tokenizer_path)  # Cached per process.
    ids = ([tok.bos_id] if self.add_bos else []) + ids + ([tok.eos_id] if self.append_eos else [])
    ids_N = np.asarray(ids, np.int32)
    return {"input_ids": ids_N, "token_mask": np.ones_like(ids_N), "issue": np.int32(Issue.OK)}

  def _ids(self, obj: dict) -> tuple[list[int] | None, Issue]:
    if "input_ids" in obj:
      ids = obj["input_ids"]
      if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        return None, Issue.MISSING_FIELD
      if not ids:
        return None, Issue.EMPTY
      if min(ids) < 0 or max(ids) >= self.vocab_size:
        return None, Issue.BAD_TOKEN_IDS
      return ids, Issue.OK
    text = obj.get(self.text_field)
    if not isinstance(text, str):
      return None, Issue.MISSING_FIELD
    if not text.strip():
      return None, Issue.EMPTY
    return load_tokenizer(self.tokenizer_path).encode(text), Issue.OK


def _dropped(issue: Issue) -> dict:
  empty = np.zeros(0, np.int32)
  return {"input_ids": empty, "token_mask": empty, "issue": np.int32(issue)}
