"""launch/plot.py --compare / k2jax.eval.curves.compare: two eval reports as grouped bars with stderr error
bars (two checkpoints at a glance), and the errors a missing file or a missing metric gives."""

import json
import os
import struct
import subprocess
import sys

import pytest

from k2jax.eval import curves

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report(path, model, tasks):
  """A report.json as launch/eval.py writes it: per task metrics, stderr and count."""
  body = {
    "model": {"name": model, "fingerprint": "f" * 64},
    "tasks": {
      name: {"format": "gsm8k", "version": "1", "metrics": m, "stderr": e, "count": {k: 3 for k in m}}
      for name, (m, e) in tasks.items()
    },
  }
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(body))
  return str(path)


def _png_size(path):
  with open(path, "rb") as f:
    data = f.read()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
  return struct.unpack(">II", data[16:24])


def _two(tmp_path):
  a = _report(
    tmp_path / "ev0" / "report.json",
    "/ckpt/step0",
    {"gsm": ({"pass@1": 0.25, "maj@4": 0.5}, {"pass@1": 0.1, "maj@4": None}), "mc": ({"acc": 0.5}, {"acc": 0.2})},
  )
  b = _report(
    tmp_path / "ev40" / "report.json",
    "/ckpt/step40",
    {"gsm": ({"pass@1": 0.75, "maj@4": 1.0}, {"pass@1": 0.05, "maj@4": 0.0}), "mc": ({"acc": 1.0}, {"acc": 0.0})},
  )
  return a, b


def test_two_reports_as_grouped_bars_with_stderr(tmp_path):
  a, b = _two(tmp_path)
  out = str(tmp_path / "cmp.png")
  drawn = curves.compare([(None, a), ("rl", b)], ["*"], out, title="step 0 vs 40")
  assert drawn["groups"] == ["gsm/pass@1", "gsm/maj@4", "mc/acc"]
  assert drawn["labels"] == ["1: step0", "rl"]
  assert drawn["values"] == [[0.25, 0.5, 0.5], [0.75, 1.0, 1.0]]
  assert drawn["stderr"] == [[0.1, 0.0, 0.2], [0.05, 0.0, 0.0]]  # a single-doc metric (None) draws no bar
  width, height = _png_size(out)
  assert width >= 600 and height == 420  # figsize (>= 6, 4.2) inches at 100 dpi
  only = curves.compare([(None, a), (None, b)], ["*/pass@1"], str(tmp_path / "p1.png"))
  assert only["groups"] == ["gsm/pass@1"] and only["labels"] == ["1: step0", "2: step40"]


def test_bad_inputs_name_the_report_and_the_metric(tmp_path):
  a, _ = _two(tmp_path)
  out = str(tmp_path / "x.png")
  with pytest.raises(curves.CurvesError, match=r"missing/report.json: no such file"):
    curves.compare([(None, a), (None, str(tmp_path / "missing" / "report.json"))], ["*"], out)
  lacking = _report(tmp_path / "ev1" / "report.json", "m", {"gsm": ({"pass@1": 0.5}, {"pass@1": 0.1})})
  with pytest.raises(curves.CurvesError, match=r"ev1/report.json: task 'gsm' has no metric 'maj@4'"):
    curves.compare([(None, a), (None, lacking)], ["gsm/*"], out)
  with pytest.raises(curves.CurvesError, match=r"ev1/report.json: no task 'mc' \(another report has mc/acc\)"):
    curves.compare([(None, a), (None, lacking)], ["mc/*"], out)
  with pytest.raises(curves.CurvesError, match=r"no task/metric of the reports matches \['nope/\*'\]"):
    curves.compare([(None, a)], ["nope/*"], out)
  (tmp_path / "bad.json").write_text('{"tasks": [1]}')
  with pytest.raises(curves.CurvesError, match="bad.json: an eval report has a 'tasks' object"):
    curves.compare([(None, str(tmp_path / "bad.json"))], ["*"], out)
  assert not os.path.exists(out)
  assert curves.compare_items(["base=/a/r.json", "/b=c/r.json", "r.json"]) == [
    ("base", "/a/r.json"),
    (None, "/b=c/r.json"),
    (None, "r.json"),
  ]


def test_cli(tmp_path):
  a, b = _two(tmp_path)

  def run(*args):
    cmd = [sys.executable, os.path.join(ROOT, "launch/plot.py"), *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)

  out = tmp_path / "cmp.png"
  r = run(f"--compare=base={a}", f"--compare={b}", "--metrics=*/pass@1,mc/*", f"--out={out}")
  assert r.returncode == 0, r.stderr
  assert f"wrote {out} (2 reports x 2 metrics)" in r.stdout and _png_size(str(out))[0] >= 600
  r = run(f"--compare={a}")  # a usage error, before k2jax is imported
  assert r.returncode != 0 and "with --out" in r.stderr
  r = run(f"--compare={a}", f"--workdir={tmp_path}", f"--out={out}")
  assert r.returncode != 0 and "give --workdir (curves), or --compare" in r.stderr
