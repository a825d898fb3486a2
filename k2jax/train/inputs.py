"""Training inputs: the per-host grain iterator for the configured data kind, and host batches ->
globally sharded arrays.

Each JAX process reads its own disjoint slice of the data (`global_batch_size / process_count` rows
per step) and `jax.make_array_from_process_local_data` stitches the slices into one global batch.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.sharding import NamedSharding

from k2jax import distributed
from k2jax.data import PretrainDataConfig, SFTDataConfig, SourceSpec, make_pretrain_iter, make_sft_iter
from k2jax.data.corpus import BUNDLED_CORPUS
from k2jax.data.sources import HoldoutSplit
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer
from k2jax.model.config import ConfigError
from k2jax.train.config import DataSpec
from k2jax.train.step import BATCH_KEYS


def make_iterator(spec: DataSpec, vocab_size: int, *, seed_offset: int = 0, holdout: HoldoutSplit | None = None):
  """This process's batch iterator (grain; supports get_state / set_state). `holdout`: records set aside for
  held-out evaluation (`eval.fraction`), which this iterator never yields."""
  tok_path = spec.tokenizer_path or BUNDLED_TOKENIZER
  tok_vocab = load_tokenizer(tok_path).vocab_size
  if tok_vocab > vocab_size:
    raise ConfigError(
      f"data.tokenizer_path: tokenizer {tok_path} has {tok_vocab} ids but the model's vocab_size is {vocab_size}"
    )
  pc, pi = jax.process_count(), jax.process_index()
  kw = dict(
    seq_len=spec.seq_len,
    batch_size=spec.global_batch_size // pc,
    seed=spec.seed + seed_offset,
    tokenizer_path=tok_path,
    num_workers=spec.num_workers,
    read_threads=spec.read_threads,
    holdout=holdout,
  )
  if spec.kind == "pretrain":
    sources = (SourceSpec(spec.path or BUNDLED_CORPUS),)
    return make_pretrain_iter(PretrainDataConfig(sources=sources, **kw), process_index=pi, process_count=pc)
  if not spec.path:
    raise ConfigError("data.path: data.kind='sft' needs a chat dataset (jsonl of {\"messages\": [...]})")
  return make_sft_iter(SFTDataConfig(sources=(SourceSpec(spec.path),), **kw), process_index=pi, process_count=pc)


def to_global(batch: dict, sharding: NamedSharding, global_batch_size: int) -> dict:
  """Host-local numpy rows -> global jax arrays sharded over the batch axes."""
  return distributed.global_batch({k: np.asarray(batch[k], np.int32) for k in BATCH_KEYS}, sharding, global_batch_size)


def fingerprint(batch: dict) -> str:
  """Short content hash of this host's rows: names a batch in spike reports."""
  return hashlib.sha1(np.ascontiguousarray(batch["input_ids"]).tobytes()).hexdigest()[:12]
