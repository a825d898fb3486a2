"""launch/plot.py / k2jax.eval.curves: metrics.jsonl and eval reports drawn to PNG."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from k2jax.eval import curves

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _workdir(tmp_path):
  w = tmp_path / "run"
  w.mkdir()
  lines = [json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "note": "x", "ok": True}) for s in range(1, 11)]
  lines += [json.dumps({"step": 5, "eval/loss": 4.6, "eval/web/loss": 4.5}), json.dumps({"step": 10, "eval/loss": 4.2})]
  (w / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 11, "lo')  # a torn tail
  rep = tmp_path / "report.json"
  rep.write_text(json.dumps({"config": {}, "tasks": {"gsm8k": {"metrics": {"pass@1": 0.25, "maj@1": 0.25}}}}))
  return w, rep


def test_series_reports_and_panels(tmp_path):
  w, rep = _workdir(tmp_path)
  s = curves.read_series(str(w / "metrics.jsonl"))
  assert [v for _, v in s["loss"]] == pytest.approx([5.0 - 0.1 * k for k in range(1, 11)])
  assert "note" not in s and "ok" not in s  # strings and booleans are not curves
  assert s["eval/loss"] == [(5, 4.6), (10, 4.2)]
  curves.add_reports(s, [(10, str(rep)), (0, str(rep))])
  assert s["eval/gsm8k/pass@1"] == [(0, 0.25), (10, 0.25)]
  keys = curves.select(s, curves.DEFAULT_KEYS)
  assert keys == ["eval/gsm8k/maj@1", "eval/gsm8k/pass@1", "eval/loss", "eval/web/loss", "loss"]
  assert curves.panels(keys) == {
    "eval/gsm8k": ["eval/gsm8k/maj@1", "eval/gsm8k/pass@1"],
    "eval": ["eval/loss"],
    "eval/web": ["eval/web/loss"],
    "loss": ["loss"],
  }
  fig = curves.plot(s, keys, str(tmp_path / "c.png"))
  visible = [ax for ax in fig.axes if ax.get_visible()]
  assert [ax.get_title() for ax in visible] == ["eval/gsm8k", "eval", "eval/web", "loss"]
  xs, ys = visible[3].lines[0].get_data()
  np.testing.assert_allclose(ys, [5.0 - 0.1 * k for k in range(1, 11)])
  assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs_name_the_problem(tmp_path):
  with pytest.raises(curves.CurvesError, match="no such file"):
    curves.read_series(str(tmp_path / "missing.jsonl"))
  bad = tmp_path / "m.jsonl"
  bad.write_text('{"step": 1, "loss": 1}\nnot json\n{"step": 2, "loss": 1}\n')
  with pytest.raises(curves.CurvesError, match=r"m.jsonl:2: not a JSON line"):
    curves.read_series(str(bad))
  bad.write_text('{"loss": 1}\n{"step": 2}\n')
  with pytest.raises(curves.CurvesError, match=r"m.jsonl:1: .*integer 'step'"):
    curves.read_series(str(bad))
  with pytest.raises(curves.CurvesError, match="no metric matches"):
    curves.plot({"loss": [(1, 1.0)]}, [], str(tmp_path / "x.png"))
  (tmp_path / "r.json").write_text("[]")
  with pytest.raises(curves.CurvesError, match="'tasks' object"):
    curves.add_reports({}, [(0, str(tmp_path / "r.json"))])


def test_cli(tmp_path):
  w, rep = _workdir(tmp_path)
  run = lambda *a: subprocess.run(
    [sys.executable, os.path.join(ROOT, "launch/plot.py"), *a], capture_output=True, text=True
  )
  r = run(f"--workdir={w}", f"--report=10={rep}", "--keys=loss,eval/gsm8k/*")
  assert r.returncode == 0, r.stderr
  assert "3 curves: eval/gsm8k/maj@1, eval/gsm8k/pass@1, loss" in r.stdout
  assert (w / "curves.png").stat().st_size > 1000
  r = run(f"--workdir={w}", "--report=ten=x")
  assert r.returncode != 0 and "expected STEP=PATH" in r.stderr
  r = run(f"--workdir={tmp_path / 'nope'}")
  assert r.returncode != 0 and "no such file" in r.stderr
