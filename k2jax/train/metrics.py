"""What a run shows: `W/metrics.jsonl`, TensorBoard events (`W/tb`), a live progress line with ETA,
MFU, and the loss-spike detector.

MFU = tokens/s x training FLOPs per token (counting.flops_per_token) / (peak FLOP/s per device x
devices). The peak is `log.peak_flops` when set, else the matmul rate of one device measured at start
in the model's compute dtype (the machine's practical limit); `mfu_peak_source` in the first
metrics line says which.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

METRICS_FILE = "metrics.jsonl"


def say(msg: str) -> None:
  """A run-status line on stdout from the primary process (library INFO logs stay quiet)."""
  if jax.process_index() == 0:
    print(msg, flush=True)


def measure_peak_flops(dtype: str, n: int | None = None, repeats: int = 5) -> float:
  """Best-of-`repeats` FLOP/s of an n x n matmul on one device (fp32 or bf16)."""
  dev = jax.devices()[0]
  n = n or (1024 if dev.platform == "cpu" else 8192)
  a = jax.device_put(jnp.ones((n, n), dtype), dev)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2.0 * n**3 / best


class SpikeDetector:
  """Flags a step whose loss exceeds `factor` x the mean of the previous `window` finite losses."""

  def __init__(self, factor: float, window: int, history: list[float] | None = None):
    self.factor = factor
    self.history = collections.deque(history or [], maxlen=window)

  def check(self, loss: float) -> bool:
    full = len(self.history) == self.history.maxlen
    spike = bool(full and np.isfinite(loss) and loss > self.factor * float(np.mean(self.history)))
    if np.isfinite(loss) and not spike:  # A spike does not raise the baseline it is judged against.
      self.history.append(float(loss))
    return spike

  def state(self) -> list[float]:
    return list(self.history)


class MetricsLogger:
  """Writes one JSON line (and TensorBoard scalars) per logged step; primary process only."""

  def __init__(
    self, workdir: str, *, total_steps: int, start_step: int, tensorboard: bool, progress: bool, enabled: bool
  ):
    self.enabled = enabled
    self.path = os.path.join(workdir, METRICS_FILE)
    self._tb = self._progress = None
    self._total = total_steps
    if not enabled:
      return
    truncate_after(self.path, start_step)
    self._file = open(self.path, "a")
    if tensorboard:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(os.path.join(workdir, "tb"))
    if progress and sys.stderr.isatty():
      from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
      )

      self._progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
      )
      self._progress.start()
      self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    self._file.write(json.dumps(record, sort_keys=True) + "\n")
    self._file.flush()
    step = record["step"]
    if self._tb is not None:
      for k, v in record.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
          self._tb.add_scalar(k, v, step)
        elif isinstance(v, list):
          for i, x in enumerate(v):
            self._tb.add_scalar(f"{k}/{i}", x, step)
      self._tb.flush()
    info = (
      f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_sec']:.0f} tok/s "
      f"mfu {100 * record['mfu']:.2f}%"
    )
    if self._progress is not None:
      self._progress.update(self._task, completed=step, info=info)
    else:
      say(f"step {step}/{self._total} {info}")

  def write_eval(self, record: dict) -> None:
    """One evaluation (`step` and `eval/...` keys: held-out loss, `k2jax.train.heldout`, and/or `eval.tasks`'
    `eval/<task>/<metric>`) as its own metrics line, TensorBoard scalars and a console line."""
    if not self.enabled:
      return
    self._file.write(json.dumps(record, sort_keys=True) + "\n")
    self._file.flush()
    step = record["step"]
    if self._tb is not None:
      for k, v in record.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
          self._tb.add_scalar(k, v, step)
      self._tb.flush()
    groups = sorted({k.split("/")[1] for k in record if k.count("/") == 2})
    per_source = [g for g in groups if f"eval/{g}/loss" in record]
    tasks = [g for g in groups if g not in per_source]  # eval.tasks: eval/<task>/<metric>
    parts = [_eval_summary(record, "eval")] if "eval/loss" in record else []
    if len(per_source) > 1:
      parts[-1] += "; " + ", ".join(f"{s}: " + _eval_summary(record, f"eval/{s}") for s in per_source)
    for t in tasks:
      values = sorted((k.split("/")[2], v) for k, v in record.items() if k.startswith(f"eval/{t}/"))
      parts.append(f"{t}: " + " ".join(f"{m} {v:.4f}" for m, v in values))
    line = f"eval step {step}/{self._total} " + "; ".join(parts)
    if self._progress is not None:
      self._progress.console.print(line)
    else:
      say(line)

  def advance(self, step: int) -> None:
    if self._progress is not None:
      self._progress.update(self._task, completed=step)

  def close(self) -> None:
    if not self.enabled:
      return
    if self._progress is not None:
      self._progress.stop()
    if self._tb is not None:
      self._tb.close()
    self._file.close()


def _eval_summary(record: dict, prefix: str) -> str:
  return (
    f"loss {record[prefix + '/loss']:.4f} ppl {record[prefix + '/perplexity']:.2f} "
    f"bpb {record[prefix + '/bpb']:.4f} ({record[prefix + '/tokens']} tokens)"
  )


class MetricsFileError(ValueError):
  """A metrics.jsonl line that is not a record, among the records a resume keeps."""


def truncate_after(path: str, step: int) -> None:
  """Drop lines logged after `step` (a run killed past its last checkpoint re-runs those steps).

  A crash while a line is written (full disk, power loss) leaves the last line torn: partial JSON, no
  newline, or NUL bytes where the filesystem grew the file but never wrote its data. Such a last line is
  dropped with a warning. A damaged line with records after it cannot come from a crash of this writer
  (whole lines are appended, and the tail is repaired here before every append), except a filesystem losing
  a block of unsynced appends; so a damaged line after a record past `step` (it would be dropped anyway)
  goes with the dropped lines, with a warning, and any other is an error naming the file and line:
  dropping it could silently lose the record of a step that is not re-run. Kept lines are copied
  byte for byte; the file is replaced atomically.
  """
  if not os.path.exists(path):
    return
  with open(path, "rb") as f:
    data = f.read()
  lines = data.split(b"\n")
  if lines[-1] == b"":  # the file ended with a newline
    lines.pop()
  # Steps never decrease down the file, so a line after a record past `step` would be dropped as well.
  keep, prev = [], None  # prev: the step of the last record read
  for i, line in enumerate(lines, 1):
    rec = _record(line)
    if rec is not None:
      prev = rec["step"]
      if prev <= step:
        keep.append(line + b"\n")
      continue
    if not line.strip():
      continue  # a blank line holds no record
    if i == len(lines):
      logging.warning("%s:%d: dropped a torn last line (a crash mid-write): %r", path, i, line[:120])
    elif prev is not None and prev > step:
      logging.warning("%s:%d: dropped a damaged line among those logged after step %d: %r", path, i, step, line[:120])
    else:
      raise MetricsFileError(
        f"{path}:{i}: not a metrics record ({line[:120]!r}); not the last line, so not a torn tail, and it may "
        f"hold a step up to {step}, which this resume keeps; fix or delete that line (or move the file aside)"
      )
  out = b"".join(keep)
  if out != data:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(out)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)


def _record(line: bytes) -> dict | None:
  """The metrics record on `line`, or None when it is not one (torn, NUL-filled, not JSON, no int step)."""
  try:
    rec = json.loads(line.decode("utf-8"))
  except (UnicodeDecodeError, ValueError):
    return None
  ok = isinstance(rec, dict) and isinstance(rec.get("step"), int) and not isinstance(rec["step"], bool)
  return rec if ok else None


def to_record(step: int, fetched: dict, *, tokens_per_sec: float, mfu: float) -> dict:
  """Device metrics (already on host) -> one JSON-able metrics line."""
  rec = {"step": step, "tokens_per_sec": tokens_per_sec, "mfu": mfu}
  for k, v in fetched.items():
    v = np.asarray(v)
    if k == "finite":
      continue
    rec[k] = v.tolist() if v.ndim else (int(v) if v.dtype.kind in "iu" else float(v))
  return rec
