"""Training and evaluation curves of a workdir, drawn to PNG (`launch/plot.py`).

Reads `W/metrics.jsonl` (pretraining, SFT and RL all write `{"step": int, key: number, ...}` lines) and,
when given, eval reports (`launch/eval.py`'s `report.json`, placed at the step they name). Keys are chosen
by glob patterns; keys sharing a prefix before their last `/` share a panel (`eval/gsm8k/pass@1` and
`eval/gsm8k/mean@4` in one, `loss` in its own), one line per key against the step.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os

from k2jax.train.metrics import METRICS_FILE

# Pretraining/SFT loss, held-out losses, RL reward and pass rates, and the eval tasks' metrics.
DEFAULT_KEYS = ("loss", "eval/*", "reward*", "rollout_pass_rate/*", "critic_agreement*", "grad_norm")


class CurvesError(ValueError):
  """A workdir without readable metrics, or keys that match nothing."""


def read_series(path: str) -> dict[str, list[tuple[int, float]]]:
  """key -> [(step, value)] over the finite numeric fields of every record of a metrics.jsonl.

  A torn last line (a run killed mid-write) is skipped; any other line that is not a JSON object with an
  integer `step` is an error naming the file and line."""
  if not os.path.exists(path):
    raise CurvesError(f"{path}: no such file (a workdir holds {METRICS_FILE} once a run has logged a step)")
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  if lines and lines[-1] == b"":
    lines.pop()
  series: dict[str, list[tuple[int, float]]] = {}
  for i, raw in enumerate(lines, 1):
    if not raw.strip():
      continue
    try:
      rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
      if i == len(lines):
        continue  # torn tail
      raise CurvesError(f"{path}:{i}: not a JSON line ({raw[:80]!r})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
      raise CurvesError(f"{path}:{i}: a metrics record needs an integer 'step' ({raw[:80]!r})")
    step = rec["step"]
    for k, v in rec.items():
      if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        continue
      series.setdefault(k, []).append((step, float(v)))
  return series


def add_reports(series: dict[str, list[tuple[int, float]]], reports: list[tuple[int, str]]) -> None:
  """Adds `eval/<task>/<metric>` points from `launch/eval.py` report.json files at the given steps."""
  for step, path in reports:
    try:
      with open(path) as f:
        rep = json.load(f)
    except (OSError, ValueError) as e:
      raise CurvesError(f"{path}: not a readable eval report: {e}") from None
    tasks = rep.get("tasks") if isinstance(rep, dict) else None
    if not isinstance(tasks, dict):
      raise CurvesError(f"{path}: an eval report has a 'tasks' object (launch/eval.py's report.json)")
    for task, metrics in tasks.items():
      for name, v in (metrics.get("metrics", metrics) if isinstance(metrics, dict) else {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
          series.setdefault(f"eval/{task}/{name}", []).append((step, float(v)))
  for pts in series.values():
    pts.sort(key=lambda p: p[0])


def select(series: dict[str, list], patterns) -> list[str]:
  """The keys matching any glob in `patterns`, in sorted order."""
  return sorted(k for k in series if any(fnmatch.fnmatchcase(k, p) for p in patterns))


def panels(keys: list[str]) -> dict[str, list[str]]:
  """Panel title -> keys: keys with the same prefix before their last '/' share a panel."""
  out: dict[str, list[str]] = {}
  for k in keys:
    out.setdefault(k.rsplit("/", 1)[0] if "/" in k else k, []).append(k)
  return out


def plot(series: dict[str, list[tuple[int, float]]], keys: list[str], out: str, title: str = ""):
  """Draws `keys` of `series` into a grid of panels and writes the PNG to `out`; returns the figure."""
  import matplotlib

  matplotlib.use("Agg")  # files only: no display on a training host
  import matplotlib.pyplot as plt

  if not keys:
    raise CurvesError("no metric matches the requested keys; available: " + ", ".join(sorted(series)[:40]))
  groups = panels(keys)
  cols = min(3, len(groups))
  rows = math.ceil(len(groups) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
  for ax, (name, ks) in zip(axes.flat, groups.items()):
    for k in ks:
      steps, vals = zip(*series[k])
      ax.plot(steps, vals, marker="o" if len(steps) < 20 else None, markersize=3, label=k.rsplit("/", 1)[-1])
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(ks) > 1 or "/" in ks[0]:
      ax.legend(fontsize=8)
  for ax in list(axes.flat)[len(groups) :]:
    ax.set_visible(False)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return fig
