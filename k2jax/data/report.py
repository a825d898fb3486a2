"""Bad-input accounting: every record the pipelines skip or alter is counted, none vanishes silently.

Each document flows through the grain pipeline with an `issue` code (a packing meta-feature), even
when it is dropped (as a zero-length element), so the counts survive multiprocess prefetch: they
travel inside each batch as `issue_counts` [B, NUM_ISSUES] and `ReportingIterDataset` sums them in
the main process and keeps the totals in its checkpointable state.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import grain
import numpy as np


class Issue(enum.IntEnum):
  """Per-record outcome codes."""

  OK = 0  # A document used whole.
  CONTINUATION = 1  # A later piece of an over-long document (not a new document).
  OVERLONG_SPLIT = 2  # First piece of a document longer than seq_len, split into pieces.
  MALFORMED_JSON = 3  # Not valid JSON, or not a JSON object (dropped).
  NOT_UTF8 = 4  # Bytes that are not UTF-8 (dropped).
  EMPTY = 5  # Empty or whitespace-only text / empty ids / blank line (dropped).
  MISSING_FIELD = 6  # No text/input_ids/messages field of the right type (dropped).
  BAD_TOKEN_IDS = 7  # Pre-tokenized ids outside [0, vocab_size) (dropped).
  UNKNOWN_ROLE = 8  # SFT: a message role outside system/user/assistant/tool (dropped).
  BAD_MESSAGES = 9  # SFT: malformed messages/tools/tool_calls (dropped).
  NO_ASSISTANT = 10  # SFT: no assistant tokens, nothing to learn (dropped).


NUM_ISSUES = len(Issue)
DROPPED = frozenset(i for i in Issue if i >= Issue.MALFORMED_JSON)


class DataReport:
  """Totals of `Issue` codes; `summary()` is the human-readable end-of-run report."""

  def __init__(self, counts=None):
    self.counts = np.zeros(NUM_ISSUES, np.int64) if counts is None else np.asarray(counts, np.int64)

  def add(self, counts) -> None:
    self.counts += np.asarray(counts, np.int64)

  def __getitem__(self, issue: Issue) -> int:
    return int(self.counts[issue])

  @property
  def documents(self) -> int:
    """Documents read, used or not (continuation pieces are not documents)."""
    return int(self.counts.sum() - self.counts[Issue.CONTINUATION])

  @property
  def dropped(self) -> int:
    return int(sum(self.counts[i] for i in DROPPED))

  def as_dict(self) -> dict[str, int]:
    return {i.name.lower(): int(self.counts[i]) for i in Issue}

  def summary(self) -> str:
    bad = ", ".join(
      f"{i.name.lower()}={int(self.counts[i])}"
      for i in Issue
      if i not in (Issue.OK, Issue.CONTINUATION) and self.counts[i]
    )
    return (
      f"data report: documents={self.documents} used={self.documents - self.dropped} "
      f"dropped={self.dropped} split_overlong={self[Issue.OVERLONG_SPLIT]}"
      + (f" ({bad})" if bad else " (no bad input)")
    )


def issue_counts(packed: dict) -> dict:
  """Packing output -> fixed-size counts: the `issue` meta-feature list becomes [NUM_ISSUES]."""
  packed = dict(packed)
  codes = np.asarray(packed.pop("issue"), np.int64).reshape(-1)
  packed["issue_counts"] = np.bincount(codes, minlength=NUM_ISSUES).astype(np.int32)
  return packed


class ReportingIterDataset(grain.IterDataset):
  """Last pipeline stage (main process): strips `issue_counts` from batches and totals them."""

  def __iter__(self) -> "ReportingIterator":
    return ReportingIterator(self._parent.__iter__())


class ReportingIterator(grain.DatasetIterator):
  """Yields the model batch dict; `.report` holds the running `DataReport` (checkpointed too)."""

  def __init__(self, parent: grain.DatasetIterator):
    super().__init__(parent)
    self.report = DataReport()
    self._summary_logged = False

  def __next__(self) -> dict:
    try:
      batch = dict(next(self._parent))
    except StopIteration:
      if not self._summary_logged:
        logging.info(self.report.summary())
        self._summary_logged = True
      raise
    self.report.add(np.asarray(batch.pop("issue_counts")).sum(axis=0))
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"parent": self._parent.get_state(), "issue_counts": [int(c) for c in self.report.counts]}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self.report = DataReport(state["issue_counts"])
