"""Shared tail of the pretraining and SFT pipelines: split, pack (grain best-fit), batch, shift.

Input elements are `{"input_ids": int32 [n], "token_mask": int32 [n], "issue": int32}`; a dropped
record is a zero-length element that only carries its `issue` code. Output batches are the model
contract, every array int32 [B, T]:
  input_ids, targets (next token in the same segment, else 0), segment_ids (1.. per row, 0 = pad),
  positions (restart at 0 per segment), loss_mask (1 where the target is a real next token of the
  same segment and that target token is trainable: all tokens in pretraining, assistant tokens in
  SFT); plus `issue_counts` [B, NUM_ISSUES], removed by report.ReportingIterDataset.
"""

from __future__ import annotations

import functools

import grain
from absl import flags
import numpy as np

from k2jax.data.report import Issue, ReportingIterDataset, issue_counts

BATCH_KEYS = ("input_ids", "targets", "segment_ids", "positions", "loss_mask")


class SplitLongDocuments(grain.experimental.FlatMapTransform):
  """Cuts a document longer than `seq_len` into seq_len pieces (each its own segment) so no token
  is dropped; the first piece is tagged OVERLONG_SPLIT, later ones CONTINUATION."""

  max_fan_out = 1 << 20  # FlatMapIterDataset does not bound fan-out; documented upper bound.

  def __init__(self, seq_len: int):
    self.seq_len = seq_len

  def flat_map(self, element: dict) -> list[dict]:
    n = len(element["input_ids"])
    if n <= self.seq_len:
      return [element]
    pieces = []
    for start in range(0, n, self.seq_len):
      issue = Issue.OVERLONG_SPLIT if start == 0 else Issue.CONTINUATION
      pieces.append(
        {
          "input_ids": element["input_ids"][start : start + self.seq_len],
          "token_mask": element["token_mask"][start : start + self.seq_len],
          "issue": np.int32(issue),
        }
      )
    return pieces


def pack_and_batch(
  ds: grain.IterDataset,
  *,
  seq_len: int,
  batch_size: int,
  num_packing_bins: int,
  seed: int,
  num_workers: int,
  worker_buffer_size: int,
) -> grain.IterDataset:
  """Variable-length elements -> packed, batched model batches (see module docstring)."""
  ds = grain.experimental.FlatMapIterDataset(ds, SplitLongDocuments(seq_len))
  ds = grain.experimental.BestFitPackIterDataset(
    ds,
    length_struct={"input_ids": seq_len, "token_mask": seq_len},
    num_packing_bins=num_packing_bins,
    seed=seed,
    meta_features=("issue",),
  )
  ds = ds.map(issue_counts)
  # batch_and_pad pads the last partial batch with all-padding rows instead of dropping its data.
  ds = ds.batch(batch_size, batch_fn=functools.partial(grain.experimental.batch_and_pad, batch_size=batch_size))
  ds = ds.map(to_model_batch)
  if num_workers > 0:
    if not flags.FLAGS.is_parsed():
      # grain's worker processes read absl flags; outside an absl app (tests, notebooks) nothing
      # parsed them, so take their defaults instead of failing in the first worker.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(
      grain.MultiprocessingOptions(num_workers=num_workers, per_worker_buffer_size=worker_buffer_size)
    )
  return ReportingIterDataset(ds)


def to_model_batch(packed: dict) -> dict:
  """grain packing features [B, T] -> the model batch contract (targets shifted within segments)."""
  ids_BT = packed["input_ids"].astype(np.int32)
  seg_BT = _renumber_segments(packed["input_ids_segment_ids"])
  trainable_BT = packed["token_mask"].astype(bool) & (seg_BT > 0)
  same_next_BT = np.zeros_like(trainable_BT)
  same_next_BT[:, :-1] = (seg_BT[:, 1:] == seg_BT[:, :-1]) & (seg_BT[:, :-1] > 0)
  targets_BT = np.zeros_like(ids_BT)
  targets_BT[:, :-1] = np.where(same_next_BT[:, :-1], ids_BT[:, 1:], 0)
  loss_BT = np.zeros_like(ids_BT)
  loss_BT[:, :-1] = same_next_BT[:, :-1] & trainable_BT[:, 1:]
  return {
    "input_ids": ids_BT,
    "targets": targets_BT,
    "segment_ids": seg_BT,
    "positions": packed["input_ids_positions"].astype(np.int32),
    "loss_mask": loss_BT,
    "issue_counts": packed["issue_counts"],
  }


def _renumber_segments(seg_BT: np.ndarray) -> np.ndarray:
  """Segment ids 1..k per row in order; grain leaves gaps where zero-length (dropped) records sat."""
  seg_BT = seg_BT.astype(np.int32)
  prev_BT = np.pad(seg_BT[:, :-1], ((0, 0), (1, 0)))
  starts_BT = (seg_BT != prev_BT) & (seg_BT > 0)
  return (np.cumsum(starts_BT, axis=1) * (seg_BT > 0)).astype(np.int32)
