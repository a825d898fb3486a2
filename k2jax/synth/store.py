"""Stage artifacts: one jsonl of accepted records and one of rejected ones per stage, appended as
units finish, so a run can be inspected and resumed stage by stage (a unit already in either file is
not redone; a torn last line from a crash is ignored and that unit redone)."""

from __future__ import annotations

import json
import os
import threading
from typing import Callable, Sequence

from k2jax.data.sources import end_torn_line
from k2jax.synth.llm import InvalidOutput


class StageStore:
  def __init__(self, out_dir: str, stage: str):
    os.makedirs(out_dir, exist_ok=True)
    self.stage = stage
    self.path = os.path.join(out_dir, f"{stage}.jsonl")
    self.rejected_path = os.path.join(out_dir, f"{stage}.rejected.jsonl")
    self._lock = threading.Lock()
    for p in (self.path, self.rejected_path):
      end_torn_line(p)

  def records(self) -> list[dict]:
    return _read(self.path)

  def rejected(self) -> list[dict]:
    return _read(self.rejected_path)

  def done_ids(self) -> set[str]:
    return {r["id"] for r in self.records() + self.rejected() if "id" in r}

  def accept(self, record: dict) -> None:
    self._append(self.path, record)

  def reject(self, unit_id: str, reason: str, **extra) -> None:
    self._append(self.rejected_path, {"id": unit_id, "reason": reason, **extra})

  def _append(self, path: str, record: dict) -> None:
    line = json.dumps(record, ensure_ascii=False) + "\n"
    with self._lock, open(path, "a", encoding="utf-8") as f:
      f.write(line)
      f.flush()


def run_units(units: Sequence[tuple[str, Callable[[], dict]]], store: StageStore, pool, stats: dict) -> None:
  """Runs not-yet-done (unit id, fn) pairs on `pool`; fn returns the record or raises InvalidOutput."""
  done = store.done_ids()
  pending = [(uid, fn) for uid, fn in units if uid not in done]
  stats["skipped_done"] = stats.get("skipped_done", 0) + len(units) - len(pending)
  futures = {pool.submit(fn): uid for uid, fn in pending}
  for fut, uid in futures.items():
    try:
      store.accept({"id": uid, **fut.result()})
      stats["accepted"] = stats.get("accepted", 0) + 1
    except InvalidOutput as e:
      store.reject(uid, str(e)[:500], kind=e.kind)
      stats["rejected"] = stats.get("rejected", 0) + 1
    except Exception as e:  # transport failure after retries: left undone, a rerun resumes it
      stats["errors"] = stats.get("errors", 0) + 1
      stats.setdefault("error_examples", []).append(f"{uid}: {type(e).__name__}: {e}"[:300])


def _read(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        obj = json.loads(line)
      except ValueError:
        continue  # a torn line: its unit is redone
      if isinstance(obj, dict):
        out.append(obj)
  return out
