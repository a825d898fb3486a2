"""Training and evaluation curves of a workdir, drawn to PNG (`launch/plot.py`), and eval reports compared.

Reads `W/metrics.jsonl` (pretraining, SFT and RL all write `{"step": int, key: number, ...}` lines) and,
when given, eval reports (`launch/eval.py`'s `report.json`, placed at the step they name). Keys are chosen
by glob patterns; keys sharing a prefix before their last `/` share a panel (`eval/gsm8k/pass@1` and
`eval/gsm8k/mean@4` in one, `loss` in its own), one line per key against the step.

`compare` draws several reports side by side (two checkpoints at a glance): a group of bars per task
metric, one bar per report, each with its standard error over problems as the error bar.
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
    for task, metrics in read_report(path)["tasks"].items():
      for name, v in (metrics.get("metrics", metrics) if isinstance(metrics, dict) else {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
          series.setdefault(f"eval/{task}/{name}", []).append((step, float(v)))
  for pts in series.values():
    pts.sort(key=lambda p: p[0])


def read_report(path: str) -> dict:
  """A `launch/eval.py` report.json; CurvesError naming the file when it is missing or not one."""
  if not os.path.isfile(path):
    raise CurvesError(f"{path}: no such file (launch/eval.py writes OUT/report.json)")
  try:
    with open(path, encoding="utf-8") as f:
      rep = json.load(f)
  except (OSError, ValueError) as e:
    raise CurvesError(f"{path}: not a readable eval report: {e}") from None
  tasks = rep.get("tasks") if isinstance(rep, dict) else None
  if not isinstance(tasks, dict):
    raise CurvesError(f"{path}: an eval report has a 'tasks' object (launch/eval.py's report.json)")
  return rep


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


def compare_items(items: list[str]) -> list[tuple[str | None, str]]:
  """`--compare` items, `[LABEL=]PATH`, as (label or None, path); a '=' after a path separator is the path's."""
  out = []
  for item in items:
    label, sep, path = item.partition("=")
    if not sep or os.sep in label or not label:
      label, path = None, item
    out.append((label, path))
  return out


def compare(reports: list[tuple[str | None, str]], patterns, out: str, title: str = "") -> dict:
  """Draws `reports` ((label, report.json path) each; label None: the report's model, else its directory)
  as grouped bars to the PNG `out`: a group per
  `task/metric` matching a glob of `patterns` in any report, a bar per report, error bars its stderr.

  Every report must hold every drawn metric (a CurvesError names the report, the task and the metric: a
  missing bar would read as a zero). Returns what was drawn: {"groups": [task/metric], "labels": [...],
  "values": [[per group] per report], "stderr": [[...] per report] (0 where a report has none)}."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  if not reports:
    raise CurvesError("compare: no reports given")
  loaded = [(label, path, read_report(path)) for label, path in reports]
  loaded = [(label or _default_label(path, rep, i), path, rep) for i, (label, path, rep) in enumerate(loaded)]
  groups = list(
    dict.fromkeys(
      f"{task}/{m}"
      for _, _, rep in loaded
      for task, section in rep["tasks"].items()
      for m in _section_metrics(section)
      if any(fnmatch.fnmatchcase(f"{task}/{m}", p) for p in patterns)
    )
  )
  if not groups:
    raise CurvesError(f"compare: no task/metric of the reports matches {list(patterns)}")
  values, errors = [], []
  for label, path, rep in loaded:
    row, err = [], []
    for g in groups:
      task, metric = g.split("/", 1)
      section = rep["tasks"].get(task)
      if section is None:
        raise CurvesError(f"{path}: no task {task!r} (another report has {g}); tasks here: {sorted(rep['tasks'])}")
      got = _section_metrics(section)
      if metric not in got:
        raise CurvesError(
          f"{path}: task {task!r} has no metric {metric!r} (another report has it); it has {sorted(got)}"
        )
      e = (section.get("stderr") or {}).get(metric)
      row.append(got[metric])
      err.append(float(e) if isinstance(e, (int, float)) and math.isfinite(e) else 0.0)
    values.append(row)
    errors.append(err)
  width = 0.8 / len(loaded)
  x = np.arange(len(groups))
  fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(groups) * len(loaded) + 2), 4.2))
  for i, (label, _, _) in enumerate(loaded):
    ax.bar(x + (i - (len(loaded) - 1) / 2) * width, values[i], width, yerr=errors[i], capsize=3, label=label)
  ax.set_xticks(x, groups, rotation=30 if len(groups) > 4 else 0, ha="right" if len(groups) > 4 else "center")
  ax.set_ylabel("value (error bar: stderr over problems)")
  ax.grid(axis="y", alpha=0.3)
  ax.legend(fontsize=8)
  if title:
    ax.set_title(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return {"groups": groups, "labels": [label for label, _, _ in loaded], "values": values, "stderr": errors}


def _default_label(path: str, rep: dict, i: int) -> str:
  """The report's model (a dir's base name, or a URL) and the report's place in the list (two reports of one
  model stay apart)."""
  model = rep.get("model")
  name = model.get("name") if isinstance(model, dict) else None
  if not isinstance(name, str) or not name:
    name = os.path.basename(os.path.dirname(os.path.abspath(path)))
  elif not name.startswith(("http://", "https://")):
    name = os.path.basename(os.path.normpath(name))
  return f"{i + 1}: {name}"


def _section_metrics(section) -> dict[str, float]:
  """A report task section's finite numeric metrics."""
  metrics = section.get("metrics") if isinstance(section, dict) else None
  if not isinstance(metrics, dict):
    return {}
  return {
    k: float(v)
    for k, v in metrics.items()
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  }
