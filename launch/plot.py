"""Training and eval curves of a workdir to PNG: `python launch/plot.py --workdir=W [--out=W/curves.png]`.

  python launch/plot.py --workdir=/tmp/k2tiny
  python launch/plot.py --workdir=/tmp/rl --keys='reward*,eval/*' --report=0=/tmp/ev0/report.json \
      --report=40=/tmp/ev40/report.json

--keys: glob patterns over metrics.jsonl's fields (default: loss, eval/*, reward*, rollout_pass_rate/*,
critic_agreement*, grad_norm); keys sharing a prefix before their last '/' share a panel.
--report: STEP=PATH of a `launch/eval.py` report.json, drawn as eval/<task>/<metric> points at STEP.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding metrics.jsonl.", required=True)
_OUT = flags.DEFINE_string("out", None, "PNG path (default: WORKDIR/curves.png).")
_KEYS = flags.DEFINE_list("keys", [], "Glob patterns of the metrics to draw (default: the curves.DEFAULT_KEYS).")
_REPORT = flags.DEFINE_multi_string("report", [], "STEP=PATH of an eval report.json to add at STEP.")


def main(argv):
  del argv
  from k2jax.eval import curves
  from k2jax.train.metrics import METRICS_FILE

  reports = []
  for item in _REPORT.value:
    step, sep, path = item.partition("=")
    if not sep or not step.strip().lstrip("-").isdigit():
      raise app.UsageError(f"--report={item!r}: expected STEP=PATH with an integer STEP")
    reports.append((int(step), path))
  try:
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
