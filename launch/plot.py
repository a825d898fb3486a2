"""Training and eval curves of a workdir to PNG, or eval reports compared as bars.

  python launch/plot.py --workdir=/tmp/k2tiny
  python launch/plot.py --workdir=/tmp/rl --keys='reward*,eval/*' --report=0=/tmp/ev0/report.json \
      --report=40=/tmp/ev40/report.json
  python launch/plot.py --compare=base=/tmp/ev0/report.json --compare=rl=/tmp/ev40/report.json \
      --metrics='*/pass@1,*/acc' --out=/tmp/compare.png

--keys: glob patterns over metrics.jsonl's fields (default: loss, eval/*, reward*, rollout_pass_rate/*,
critic_agreement*, grad_norm); keys sharing a prefix before their last '/' share a panel.
--report: STEP=PATH of a `launch/eval.py` report.json, drawn as eval/<task>/<metric> points at STEP.
--compare: [LABEL=]PATH of a report.json (LABEL: its model), repeated: a group of bars per TASK/METRIC matching
--metrics, a bar per report, error bars its stderr over problems; every report must hold every drawn metric.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding metrics.jsonl.")
_OUT = flags.DEFINE_string("out", None, "PNG path (default: WORKDIR/curves.png; required with --compare).")
_KEYS = flags.DEFINE_list("keys", [], "Glob patterns of the metrics to draw (default: the curves.DEFAULT_KEYS).")
_REPORT = flags.DEFINE_multi_string("report", [], "STEP=PATH of an eval report.json to add at STEP.")
_COMPARE = flags.DEFINE_multi_string("compare", [], "[LABEL=]PATH of an eval report.json to compare.")
_METRICS = flags.DEFINE_list("metrics", ["*"], "--compare: glob patterns over TASK/METRIC.")


def main(argv):
  del argv
  if bool(_COMPARE.value) == bool(_WORKDIR.value) or (_COMPARE.value and not _OUT.value):
    raise app.UsageError("give --workdir (curves), or --compare (repeated) with --out (bars)")
  from k2jax.eval import curves
  from k2jax.train.metrics import METRICS_FILE

  try:
    if _COMPARE.value:
      drawn = curves.compare(curves.compare_items(_COMPARE.value), _METRICS.value, _OUT.value)
      print(f"wrote {_OUT.value} ({len(drawn['labels'])} reports x {len(drawn['groups'])} metrics)")
      return
    reports = []
    for item in _REPORT.value:
      step, sep, path = item.partition("=")
      if not sep or not step.strip().lstrip("-").isdigit():
        raise app.UsageError(f"--report={item!r}: expected STEP=PATH with an integer STEP")
      reports.append((int(step), path))
    series = curves.read_series(os.path.join(_WORKDIR.value, METRICS_FILE))
    curves.add_reports(series, reports)
    keys = curves.select(series, _KEYS.value or curves.DEFAULT_KEYS)
    out = _OUT.value or os.path.join(_WORKDIR.value, "curves.png")
    curves.plot(series, keys, out, title=os.path.basename(os.path.normpath(_WORKDIR.value)))
  except curves.CurvesError as e:
    sys.exit(f"plot: {e}")
  print(f"wrote {out} ({len(keys)} curves: {', '.join(keys)})")


if __name__ == "__main__":
  app.run(main)
