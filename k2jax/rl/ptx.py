"""The curated PTX set (K2 §3.2.3): a fixed list of hand-picked samples cycled in fixed-shape batches.

Sources: a jsonl file of chat records (`{"messages": [...]}`, rendered with K2's chat template, loss on
assistant tokens only) or of text records (`{"text": ...}`, loss on every token); `bundled` is the
repository's offline corpus. The first `num_samples` usable records are kept, truncated to `seq_len`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from k2jax.data.chat import render_chat
from k2jax.data.corpus import BUNDLED_CORPUS
from k2jax.data.sources import iter_jsonl_strict
from k2jax.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class PTXConfig:
  source: str = "bundled"  # jsonl path, or "bundled" for the offline corpus
  num_samples: int = 64  # curated records kept
  batch_size: int = 8  # rows per PTX batch (one batch per RL update)
  seq_len: int = 64  # tokens per row (longer records are truncated)

  def __post_init__(self):
    if min(self.num_samples, self.batch_size) < 1 or self.seq_len < 2:
      raise ValueError(f"PTXConfig: need num_samples, batch_size >= 1 and seq_len >= 2, got {self}")


class PTXSet:
  """`batch(i)` -> {'tokens_BT', 'segment_ids_BT', 'loss_mask_BT'} numpy arrays, rows i*B.. mod N."""

  def __init__(self, config: PTXConfig, tokenizer: Tokenizer, pad_id: int = 0):
    self.config = config
    path = BUNDLED_CORPUS if config.source == "bundled" else config.source
    rows = list(_read_rows(path, tokenizer, config))
    if not rows:
      raise ValueError(
        f"PTX source {path}: no usable record (need 'messages' or 'text' with >= 2 tokens and at least one loss token)"
      )
    T = config.seq_len
    self.tokens_NT = np.full((len(rows), T), pad_id, np.int32)
    self.mask_NT = np.zeros((len(rows), T), np.float32)
    self.segments_NT = np.zeros((len(rows), T), np.int32)
    for n, (ids, mask) in enumerate(rows):
      self.tokens_NT[n, : len(ids)] = ids
      self.mask_NT[n, : len(ids)] = mask
      self.segments_NT[n, : len(ids)] = 1
    self.mask_NT[:, 0] = 0.0  # nothing predicts the first token

  def __len__(self) -> int:
    return len(self.tokens_NT)

  def batch(self, i: int) -> dict[str, np.ndarray]:
    B = self.config.batch_size
    rows = (np.arange(B) + i * B) % len(self)
    return {
      "tokens_BT": self.tokens_NT[rows],
      "segment_ids_BT": self.segments_NT[rows],
      "loss_mask_BT": self.mask_NT[rows],
    }


def _read_rows(path: str, tok: Tokenizer, config: PTXConfig):
  kept = 0
  for line_no, record in iter_jsonl_strict(path):
    if kept == config.num_samples:
      return
    if "messages" in record:
      ids, mask = render_chat(record["messages"], record.get("tools"), tokenizer=tok)
    elif isinstance(record.get("text"), str):
      ids = tok.encode(record["text"])
      mask = [1] * len(ids)
    else:
      raise ValueError(f"PTX source {path}:{line_no}: record has neither 'messages' nor 'text'")
    ids, mask = ids[: config.seq_len], mask[: config.seq_len]
    if len(ids) >= 2 and any(mask[1:]):
      kept += 1
      yield ids, mask
