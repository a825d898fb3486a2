"""SWE task instances, predictions and reports in the SWE-bench conventions (JSONL, one object a line).

An instance has SWE-bench's fields: `instance_id, repo, base_commit, problem_statement, patch` (the gold
fix, non-test files), `test_patch` (hidden test changes applied at grading; "" for injected bugs),
`FAIL_TO_PASS, PASS_TO_PASS` (pytest node ids; written JSON-encoded as SWE-bench rows do), `version`,
`hints_text`, `created_at`, plus what k2jax needs to run it offline: `snapshot` (the repository as the agent
sees it, a directory relative to the task set's root; no .git), `test_cmd` (informational: how the tests
are run), `kind` (procedural | combo | version_diff) and `mutations` (what was injected). `base_commit` is
the content hash of the snapshot (`snapshot.tree_hash`), so a changed snapshot is caught before grading.

Predictions are SWE-bench's 3-key rows `{instance_id, model_name_or_path, model_patch}`; reports follow
`swebench/harness/grading.py` (per instance `patch_is_None, patch_exists, patch_successfully_applied,
resolved, infra_failure, tests_status.{FAIL_TO_PASS,PASS_TO_PASS}.{success,failure}`) plus K2's pass rate.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Sequence

KINDS = ("procedural", "combo", "version_diff")
_REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "FAIL_TO_PASS", "PASS_TO_PASS")


@dataclasses.dataclass(frozen=True)
class Instance:
  instance_id: str
  repo: str
  base_commit: str
  problem_statement: str
  patch: str
  FAIL_TO_PASS: tuple[str, ...]
  PASS_TO_PASS: tuple[str, ...]
  test_patch: str = ""
  version: str = ""
  hints_text: str = ""
  created_at: str = ""
  snapshot: str = ""  # relative to the task set root
  test_cmd: str = "pytest -p no:cacheprovider -rA"
  kind: str = "procedural"
  mutations: tuple[str, ...] = ()

  def __post_init__(self):
    if not self.FAIL_TO_PASS:
      raise ValueError(f"instance {self.instance_id}: FAIL_TO_PASS is empty")
    if self.kind not in KINDS:
      raise ValueError(f"instance {self.instance_id}: kind {self.kind!r} is not one of {KINDS}")

  def snapshot_dir(self, root: str) -> str:
    if not self.snapshot:
      raise ValueError(f"instance {self.instance_id}: no snapshot directory (not a k2jax-built instance)")
    return os.path.join(root, self.snapshot)

  def to_row(self) -> dict:
    """The SWE-bench row: test lists JSON-encoded strings, like the published datasets."""
    row = dataclasses.asdict(self)
    row["FAIL_TO_PASS"], row["PASS_TO_PASS"] = json.dumps(list(self.FAIL_TO_PASS)), json.dumps(list(self.PASS_TO_PASS))
    row["mutations"] = list(self.mutations)
    return row

  @classmethod
  def from_row(cls, row: dict, where: str = "") -> "Instance":
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
      raise ValueError(f"{where}: SWE instance row lacks {missing}")
    known = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in row.items() if k in known}
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
      kw[key] = tuple(_test_list(row[key], f"{where}: {key}"))
    kw["mutations"] = tuple(row.get("mutations") or ())
    return cls(**kw)


@dataclasses.dataclass(frozen=True)
class Prediction:
  instance_id: str
  model_patch: str | None
  model_name_or_path: str = "k2jax"

  def to_row(self) -> dict:
    return {
      "instance_id": self.instance_id,
      "model_name_or_path": self.model_name_or_path,
      "model_patch": self.model_patch,
    }


@dataclasses.dataclass(frozen=True)
class InstanceReport:
  """One graded instance, SWE-bench's per-instance report plus K2's pass rate and the evidence."""

  instance_id: str
  patch_is_None: bool
  patch_exists: bool
  patch_successfully_applied: bool
  resolved: bool
  infra_failure: bool
  tests_status: dict  # {FAIL_TO_PASS|PASS_TO_PASS: {"success": [...], "failure": [...]}}
  pass_rate: float  # K2: share of FAIL_TO_PASS passing, times [every PASS_TO_PASS passes]
  reason: str  # why it is (un)resolved, in words
  exit_code: int | None = None
  grade_s: float = 0.0
  hack_check: list = dataclasses.field(default_factory=list)  # hackcheck findings on the patch's added lines
  tampering: list = dataclasses.field(default_factory=list)  # what the run's checks caught (testrun, grade)
  skipped: dict = dataclasses.field(default_factory=dict)  # {FAIL_TO_PASS|PASS_TO_PASS: tests the run skipped}
  timed_out: bool = False  # the test run ran past its deadline

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def read_jsonl(path: str) -> list[dict]:
  rows = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not JSON ({e})") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{n}: a row must be a JSON object")
      rows.append(row)
  return rows


def write_jsonl(path: str, rows: Iterable[dict]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  os.replace(tmp, path)  # a reader never sees half a file; an old file is kept until the new one is whole


def read_instances(path: str) -> list[Instance]:
  out = [Instance.from_row(r, f"{path} row {i + 1}") for i, r in enumerate(read_jsonl(path))]
  ids = [i.instance_id for i in out]
  if len(set(ids)) != len(ids):
    raise ValueError(f"{path}: duplicate instance_id {sorted({x for x in ids if ids.count(x) > 1})}")
  return out


def write_instances(path: str, instances: Sequence[Instance]) -> None:
  write_jsonl(path, [i.to_row() for i in instances])


def read_predictions(path: str) -> list[Prediction]:
  out = []
  for i, r in enumerate(read_jsonl(path)):
    if "instance_id" not in r or "model_patch" not in r:
      raise ValueError(f"{path} row {i + 1}: a prediction needs instance_id and model_patch")
    patch = r["model_patch"]
    if patch is not None and not isinstance(patch, str):
      raise ValueError(f"{path} row {i + 1}: model_patch must be a string or null")
    out.append(Prediction(str(r["instance_id"]), patch, str(r.get("model_name_or_path", "k2jax"))))
  return out


def write_predictions(path: str, predictions: Sequence[Prediction]) -> None:
  write_jsonl(path, [p.to_row() for p in predictions])


def summary(reports: Sequence[InstanceReport], instance_ids: Sequence[str]) -> dict[str, Any]:
  """SWE-bench's run summary (`resolved_ids`, `unresolved_ids`, ... with counts) plus the mean pass rate."""
  by_id = {r.instance_id: r for r in reports}
  out: dict[str, Any] = {
    "total_instances": len(instance_ids),
    "submitted_instances": len(reports),
    "resolved_ids": sorted(i for i, r in by_id.items() if r.resolved),
    "unresolved_ids": sorted(i for i, r in by_id.items() if not r.resolved and r.patch_exists and not r.infra_failure),
    "empty_patch_ids": sorted(i for i, r in by_id.items() if not r.patch_exists),
    "error_ids": sorted(i for i, r in by_id.items() if r.patch_exists and not r.patch_successfully_applied),
    "infra_failure_ids": sorted(i for i, r in by_id.items() if r.infra_failure),
    "missing_ids": sorted(set(instance_ids) - set(by_id)),
    "hack_check_ids": sorted(i for i, r in by_id.items() if r.hack_check),  # unresolved by the static check
    "tampered_ids": sorted(i for i, r in by_id.items() if r.tampering),  # unresolved by the run's checks
  }
  for key in list(out):
    if key.endswith("_ids"):
      out[key.replace("_ids", "_instances")] = len(out[key])
  graded = [r for r in reports if not r.infra_failure]
  out["resolved_rate"] = len(out["resolved_ids"]) / len(graded) if graded else 0.0
  out["pass_rate_mean"] = sum(r.pass_rate for r in graded) / len(graded) if graded else 0.0
  out["instances"] = {i: r.to_json() for i, r in sorted(by_id.items())}
  return out


def _test_list(value, where: str) -> list[str]:
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError:
      raise ValueError(f"{where}: not a JSON list of test ids: {value[:100]!r}") from None
  if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
    raise ValueError(f"{where}: expected a list of test id strings")
  return value
