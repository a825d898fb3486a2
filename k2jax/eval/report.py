"""The run's report: metrics per task (and per doc, with every sample) as JSON, and a markdown table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from k2jax.eval import metrics
from k2jax.eval.formats import FORMATS as BENCHMARK_FORMATS
from k2jax.eval.grading import UNGRADABLE


def task_report(
  name: str, fmt: str, kind: str, path: str, doc_records: Sequence[tuple[str, list[dict]]], ks: Sequence[int]
) -> dict[str, Any]:
  """One task's section: `doc_records` is (doc_id, its samples in index order) per doc."""
  docs, rows = [], []
  for doc_id, samples in doc_records:
    if kind == "choice":
      (rec,) = samples
      row = {"acc": rec["acc"], "acc_norm": rec["acc_norm"]}
    else:
      votes = fmt in VOTING_FORMATS or (fmt in BENCHMARK_FORMATS and BENCHMARK_FORMATS[fmt].votes)
      answers = [s["answer"] for s in samples] if votes else None
      row = metrics.problem_metrics([s["score"] for s in samples], answers, ks)
    rows.append(row)
    docs.append({"doc_id": doc_id, "metrics": row, "samples": samples})
  values = metrics.average(rows)
  own = BENCHMARK_FORMATS[fmt].aggregate if fmt in BENCHMARK_FORMATS else None
  if own is not None and doc_records:  # a format's task-level metrics (IFEval's instruction-level accuracy)
    values.update(own([samples for _, samples in doc_records]))
  out = {
    "format": fmt,
    "path": path,
    "num_docs": len(docs),
    "n": len(doc_records[0][1]) if doc_records else 0,
    "metrics": values,
    "stderr": {k: _stderr([r[k] for r in rows if k in r]) for k in values},
    "docs": docs,
  }
  if kind == "generate":
    out["ungradable_samples"] = sum(s["reason"].startswith(UNGRADABLE) for _, ss in doc_records for s in ss)
  return out


# Formats whose samples carry an answer to vote on (maj@k); code is judged by tests, with no answer to compare.
VOTING_FORMATS = ("gsm8k", "math", "answer.exact", "answer.math")


def markdown(report: dict[str, Any]) -> str:
  lines = ["| task | format | docs | n | metric | value | stderr |", "|---|---|---:|---:|---|---:|---:|"]
  for name, t in report["tasks"].items():
    for metric, value in t["metrics"].items():
      err = t["stderr"][metric]
      lines.append(
        f"| {name} | {t['format']} | {t['num_docs']} | {t['n']} | {metric} | {value:.4f} | "
        + ("-" if err is None else f"{err:.4f}")
        + " |"
      )
  return "\n".join(lines) + "\n"


def _stderr(values: Sequence[float]) -> float | None:
  """Standard error of the mean over docs (None for a single doc), as lm-evaluation-harness reports it."""
  if len(values) < 2:
    return None
  return float(np.std(values, ddof=1) / math.sqrt(len(values)))
