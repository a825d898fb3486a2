"""The run's report: metrics per task (and per doc, with every sample) as JSON, and a markdown table."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from k2jax.eval import metrics
from k2jax.eval.records import TaskFormat
from k2jax.eval.verdict import UNGRADABLE


def task_report(
  name: str,
  fmt: TaskFormat,
  path: str,
  doc_records: Sequence[tuple[str, list[dict]]],
  ks: Sequence[int],
  skipped: Mapping[str, int] | None = None,
) -> dict[str, Any]:
  """One task's section: `doc_records` is (doc_id, its samples in index order) per doc. Each metric comes with
  its standard error over problems and the number of problems behind it (`count`). `skipped`: the records
  of the file the format left out, {why: how many} (`skipped_records`, with their total); a generated task
  counts its samples whose grading timed out (`timed_out_samples`: graded again by the next run on the
  same output dir)."""
  docs, rows = [], []
  votes = fmt.name in VOTING_FORMATS or fmt.votes
  for doc_id, samples in doc_records:
    if fmt.kind == "choice":
      (rec,) = samples
      row = {"acc": rec["acc"], "acc_norm": rec["acc_norm"]}
    else:
      answers = [s["answer"] for s in samples] if votes else None
      try:
        row = metrics.problem_metrics([s["score"] for s in samples], answers, ks, fmt.same)
      except ValueError as e:
        raise ValueError(f"task {name!r}: {e}") from None
    rows.append(row)
    docs.append({"doc_id": doc_id, "metrics": row, "samples": samples})
  values = metrics.average(rows)
  count = {k: sum(k in r for r in rows) for k in values}
  if fmt.aggregate is not None and doc_records:  # a format's task-level metrics (IFEval's instruction-level accuracy)
    own = fmt.aggregate([samples for _, samples in doc_records])
    values.update(own)
    count.update({k: len(doc_records) for k in own})
  out = {
    "format": fmt.name,
    "version": fmt.version,
    "path": path,
    "num_docs": len(docs),
    "n": len(doc_records[0][1]) if doc_records else 0,
    "num_samples": sum(len(ss) for _, ss in doc_records),
    "metrics": values,
    "stderr": {k: _stderr([r[k] for r in rows if k in r]) for k in values},
    "count": count,
    "skipped_records": sum((skipped or {}).values()),
    "skipped_why": dict(skipped or {}),
    "docs": docs,
  }
  if fmt.kind == "generate":
    out["ungradable_samples"] = sum(s["reason"].startswith(UNGRADABLE) for _, ss in doc_records for s in ss)
    out["timed_out_samples"] = sum(bool(s.get("timed_out")) for _, ss in doc_records for s in ss)
  return out


# Formats whose samples carry an answer to vote on (maj@k); code is judged by tests, with no answer to compare.
VOTING_FORMATS = ("gsm8k", "math", "answer.exact", "answer.math")


def markdown(report: dict[str, Any]) -> str:
  """The metrics table: a row per task and metric, with its stderr, the problems behind it and the grader's
  version; the model and its content fingerprint above it."""
  model = report.get("model")
  lines = [f"model: {model['name']} (fingerprint {model['fingerprint']})", ""] if model else []
  lines += [
    "| task | format | docs | n | metric | value | stderr | count | version |",
    "|---|---|---:|---:|---|---:|---:|---:|---|",
  ]
  for name, t in report["tasks"].items():
    for metric, value in t["metrics"].items():
      err = t["stderr"][metric]
      lines.append(
        f"| {name} | {t['format']} | {t['num_docs']} | {t['n']} | {metric} | {value:.4f} | "
        + ("-" if err is None else f"{err:.4f}")
        + f" | {t['count'][metric]} | {t['version']} |"
      )
  notes = []
  for name, t in report["tasks"].items():
    left, slow = t.get("skipped_records", 0), t.get("timed_out_samples", 0)
    if left:
      why = "; ".join(f"{n}: {w}" for w, n in t.get("skipped_why", {}).items())
      notes.append(f"- {name}: {left} records of the file left out ({why})")
    if slow:
      notes.append(f"- {name}: {slow} samples timed out in grading (scored 0 here; graded again by a rerun)")
  return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _stderr(values: Sequence[float]) -> float | None:
  """Standard error of the mean over docs (None for a single doc), as lm-evaluation-harness reports it."""
  if len(values) < 2:
    return None
  return float(np.std(values, ddof=1) / math.sqrt(len(values)))
