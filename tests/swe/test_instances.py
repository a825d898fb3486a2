"""SWE-bench conventions: instance rows (JSON-encoded test lists), 3-key predictions, the run summary;
snapshot diffs and test-path rules."""

import json

import pytest

from k2jax.swe import instances as io
from k2jax.swe import snapshot


def _inst(**kw):
  base = dict(
    instance_id="pypi__x.1.0.off_by_one__abcd1234",
    repo="pypi/x",
    base_commit="0" * 40,
    problem_statement="p",
    patch="d",
    FAIL_TO_PASS=("t::a",),
    PASS_TO_PASS=("t::b",),
    snapshot="snapshots/x",
  )
  return io.Instance(**{**base, **kw})


def test_instance_rows_round_trip_in_swe_bench_shape(tmp_path):
  path = str(tmp_path / "i.jsonl")
  io.write_instances(path, [_inst(), _inst(instance_id="b", kind="version_diff", test_patch="tp")])
  row = json.loads(open(path).readline())
  assert json.loads(row["FAIL_TO_PASS"]) == ["t::a"] and isinstance(row["PASS_TO_PASS"], str)
  assert {"instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch", "version"} <= set(row)
  assert io.read_instances(path) == [_inst(), _inst(instance_id="b", kind="version_diff", test_patch="tp")]


def test_bad_rows_name_the_problem(tmp_path):
  p = tmp_path / "i.jsonl"
  p.write_text(json.dumps({"instance_id": "a"}) + "\n")
  with pytest.raises(ValueError, match="lacks"):
    io.read_instances(str(p))
  row = _inst().to_row()
  p.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
  with pytest.raises(ValueError, match="duplicate instance_id"):
    io.read_instances(str(p))
  with pytest.raises(ValueError, match="FAIL_TO_PASS is empty"):
    _inst(FAIL_TO_PASS=())


def test_predictions_are_the_three_key_rows(tmp_path):
  path = str(tmp_path / "p.jsonl")
  io.write_predictions(path, [io.Prediction("a", "diff"), io.Prediction("b", None, "m")])
  assert json.loads(open(path).readline()) == {"instance_id": "a", "model_name_or_path": "k2jax", "model_patch": "diff"}
  assert io.read_predictions(path)[1] == io.Prediction("b", None, "m")


def test_summary_counts_like_swe_bench():
  def rep(i, resolved=False, exists=True, applied=True, infra=False, rate=0.0):
    return io.InstanceReport(i, not exists, exists, applied, resolved, infra, {}, rate, "")

  s = io.summary(
    [
      rep("a", True, rate=1.0),
      rep("b", rate=0.5),
      rep("c", exists=False, applied=False),
      rep("d", applied=False),
      rep("e", infra=True),
    ],
    list("abcdef"),
  )
  assert s["resolved_ids"] == ["a"] and s["empty_patch_ids"] == ["c"] and s["error_ids"] == ["d"]
  assert s["infra_failure_ids"] == ["e"] and s["missing_ids"] == ["f"] and s["resolved_instances"] == 1
  assert s["resolved_rate"] == 0.25 and s["pass_rate_mean"] == pytest.approx(1.5 / 4)  # infra excluded


def test_diff_and_restore(tmp_path):
  a, b = tmp_path / "a", tmp_path / "b"
  for d in (a, b):
    (d / "pkg").mkdir(parents=True)
    (d / "tests").mkdir()
  (a / "pkg" / "m.py").write_text("x = 1\n")
  (b / "pkg" / "m.py").write_text("x = 2")  # no final newline
  (b / "pkg" / "new.py").write_text("y = 1\n")
  (a / "tests" / "test_m.py").write_text("def test(): pass\n")
  (b / "conftest.py").write_text("bad\n")
  (b / "tests" / "test_m.py").write_text("edited\n")
  diff = snapshot.diff_trees(str(a), str(b))
  assert "\\ No newline at end of file" in diff and "new file mode" in diff
  c = tmp_path / "c"
  snapshot.copy_tree(str(a), str(c))
  snapshot.apply_patch(diff, str(c))
  assert snapshot.tree_hash(str(c)) == snapshot.tree_hash(str(b))
  assert snapshot.restore_tests(str(a), str(c)) == ["conftest.py", "tests/test_m.py"]
  assert not (c / "conftest.py").exists() and (c / "tests" / "test_m.py").read_text() == "def test(): pass\n"
  assert (c / "pkg" / "m.py").read_text() == "x = 2"
  for rel, want in (
    ("tests/x.py", True),
    ("pkg/test_y.py", True),
    ("pkg/y_test.py", True),
    ("setup.cfg", True),
    ("a/sitecustomize.py", True),
    ("pkg/m.py", False),
  ):
    assert snapshot.is_test_path(rel) == want, rel
  with pytest.raises(snapshot.PatchError):
    snapshot.apply_patch("diff --git a/z b/z\n--- a/z\n+++ b/z\n@@ -1 +1 @@\n-q\n+r\n", str(c))
