"""SWE-bench Verified rows (`swebench@ROOT`, `swebench@MAP.json`) graded by k2jax.swe.grade against a checkout the
user provides: a tiny git repository built here (a module and its pytest tests; base_commit and a later commit
whose HEAD the gold patch no longer applies to), rows in the published field layout (JSONL and Parquet). Through
the runner from a local file, the gold patch resolves (1.0) and an empty or a wrong patch does not (0.0); the
user's checkout is left as it was. Bad rows name the file, line and field; a missing checkout names the
instance, the repo and the path looked for; a base_commit the checkout lacks names both.

swebench_verified_rows.jsonl holds two rows of princeton-nlp/SWE-bench_Verified in its published field layout
(astropy__astropy-12907, django__django-11099), copied from public code that embeds them (no field shortened)."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k2jax.eval import EvalConfig, TaskFormatError, TaskSpec, load_docs, run
from k2jax.eval.formats import swebench
from k2jax.eval.grading import grade
from k2jax.eval.records import read_records
from k2jax.sandbox.code import CodeRewardConfig
from k2jax.sandbox.runner import isolation_error
from k2jax.swe.snapshot import diff_texts

from .conftest import scripted_model, write_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))
VERIFIED = os.path.join(HERE, "swebench_verified_rows.jsonl")
NOT_ISOLATED = isolation_error()
needs_sandbox = pytest.mark.skipif(NOT_ISOLATED is not None, reason=f"no sandbox here: {NOT_ISOLATED}")

OPS = "def add(a, b):\n    return a + b\n\n\ndef neg(x):\n    return x\n"
OPS_HEAD = "def add(a, b):\n    return a + b\n\n\ndef neg(x):\n    return +x  # still wrong\n\n\ndef sub(a, b):\n    return a - b\n"
TESTS = "from calc.ops import add, neg\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
TESTS_NEW = TESTS + "\n\ndef test_neg():\n    assert neg(4) == -4\n"
GOLD = diff_texts("calc/ops.py", OPS, OPS.replace("return x\n", "return -x\n"))
WRONG = diff_texts("calc/ops.py", OPS, OPS.replace("return x\n", "return x * 1\n"))
BREAKS_ADD = diff_texts("calc/ops.py", OPS, OPS.replace("return x\n", "return -x\n").replace("a + b", "a - b"))
TEST_PATCH = diff_texts("tests/test_ops.py", TESTS, TESTS_NEW)


def _git(repo, *args):
  env = {"PATH": os.environ["PATH"], "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1"}
  ident = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "-c", "init.defaultBranch=main"]
  return subprocess.run(["git", *ident, *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def checkout(tmp_path):
  """ROOT/toyorg__calc: commit 1 (base_commit: neg() is wrong, test_add only), commit 2 (HEAD: neg rewritten,
  sub added). Returns (ROOT, base_commit)."""
  repo = tmp_path / "repos" / "toyorg__calc"
  (repo / "calc").mkdir(parents=True)
  (repo / "tests").mkdir()
  (repo / "calc" / "__init__.py").write_text("")
  (repo / "calc" / "ops.py").write_text(OPS)
  (repo / "tests" / "test_ops.py").write_text(TESTS)
  _git(repo, "init", "-q")
  _git(repo, "add", "-A")
  _git(repo, "commit", "-q", "-m", "base")
  base = _git(repo, "rev-parse", "HEAD").strip()
  (repo / "calc" / "ops.py").write_text(OPS_HEAD)
  _git(repo, "commit", "-q", "-am", "later")
  return str(tmp_path / "repos"), base


def _row(base, iid="toyorg__calc-1", issue="neg(4) returns 4, expected -4", **over):
  row = {
    "repo": "toyorg/calc",
    "instance_id": iid,
    "base_commit": base,
    "patch": GOLD,
    "test_patch": TEST_PATCH,
    "problem_statement": issue,
    "hints_text": "",
    "created_at": "2024-01-02T03:04:05Z",
    "version": "0.1",
    "FAIL_TO_PASS": json.dumps(["tests/test_ops.py::test_neg"]),
    "PASS_TO_PASS": json.dumps(["tests/test_ops.py::test_add"]),
    "environment_setup_commit": base,
    "difficulty": "<15 min fix",
  }
  return {**row, **over}


def _read(path):
  with open(path, "rb") as f:
    return f.read()


def _state(repo):
  """What grading must leave alone: HEAD, the work tree's status, the index file's bytes, the files."""
  files = {p: _read(os.path.join(repo, p)) for p in ("calc/ops.py", "tests/test_ops.py")}
  index = _read(os.path.join(repo, ".git", "index"))
  return _git(repo, "rev-parse", "HEAD"), _git(repo, "status", "--porcelain"), index, files


@needs_sandbox
def test_gold_resolves_empty_and_wrong_do_not_through_the_runner(checkout, tmp_path, tok):
  root, base = checkout
  rows = [_row(base, f"toyorg__calc-{i}", f"ISSUE-{kind}: neg(4) returns 4") for i, kind in enumerate("GEW", 1)]
  path = write_jsonl(tmp_path / "verified.jsonl", rows)
  answers = {
    "ISSUE-G": f"The sign is dropped.\n<patch>\n{GOLD}</patch>",
    "ISSUE-E": "I could not find the bug.",
    "ISSUE-W": f"```diff\n{WRONG}```",
  }

  def respond(prompt, seed):
    return next(text for key, text in answers.items() if key in prompt)

  model, engine = scripted_model(tok, respond)
  repo = os.path.join(root, "toyorg__calc")
  before = _state(repo)
  spec = TaskSpec("swebench", path, f"swebench@{root}")
  report = run(EvalConfig("scripted", (spec,), str(tmp_path / "out"), max_tokens=1024, progress=False), model)
  task = report["tasks"]["swebench"]
  assert task["metrics"]["pass@1"] == pytest.approx(1 / 3) and task["num_docs"] == 3
  samples = {d["doc_id"]: d["samples"][0] for d in task["docs"]}
  gold, empty, wrong = (samples[f"toyorg__calc-{i}"] for i in (1, 2, 3))
  assert (gold["score"], gold["resolved"], gold["verdict"]) == (1.0, True, "resolved")
  assert gold["tests_status"]["FAIL_TO_PASS"]["success"] == ["tests/test_ops.py::test_neg"]
  assert gold["patch"] == GOLD and gold["pass_rate"] == 1.0
  assert (empty["score"], empty["reason"], empty["patch"]) == (0.0, "no patch", "")
  assert (wrong["score"], wrong["verdict"], wrong["pass_rate"]) == (0.0, "unresolved", 0.0)
  assert wrong["tests_status"]["FAIL_TO_PASS"]["failure"] == ["tests/test_ops.py::test_neg"]
  assert wrong["tests_status"]["PASS_TO_PASS"]["success"] == ["tests/test_ops.py::test_add"]
  # The prompt: SWE-bench's style-3 text, the edited file at base_commit (not HEAD) with line numbers.
  text = tok.decode(list(engine.calls[0].input_ids))
  assert text.startswith(swebench.PROMPT_HEAD) and "[start of calc/ops.py]\n1 def add(a, b):\n" in text
  assert "6     return x\n" in text and "still wrong" not in text
  assert _state(repo) == before  # the user's checkout: same HEAD, status, index and files


@needs_sandbox
def test_mapping_file_with_its_python_and_a_patch_that_breaks_pass_to_pass(checkout, tmp_path):
  root, base = checkout
  mapping = tmp_path / "repos.json"
  mapping.write_text(json.dumps({"toyorg/calc": {"checkout": "repos/toyorg__calc", "python": sys.executable}}))
  path = write_jsonl(tmp_path / "v.jsonl", [_row(base)])
  fmt = f"swebench@{mapping}"
  (doc,) = load_docs(path, fmt)
  site = os.path.dirname(os.path.dirname(pytest.__file__))
  assert doc.data["python"] == os.path.realpath(sys.executable) and site in doc.data["python_paths"]
  assert not any(p.startswith(root) for p in doc.data["python_paths"])
  code = CodeRewardConfig()
  assert grade(fmt, "swebench", doc, f"<patch>\n{GOLD}</patch>", "stop", code).score == 1.0
  broken = grade(fmt, "swebench", doc, f"<patch>\n{BREAKS_ADD}</patch>", "stop", code)
  assert broken.score == 0.0 and broken.extra["tests_status"]["PASS_TO_PASS"]["failure"] == [
    "tests/test_ops.py::test_add"
  ]
  assert broken.extra["tests_status"]["FAIL_TO_PASS"]["success"] == ["tests/test_ops.py::test_neg"]
  # The gold patch is against base_commit: HEAD's file no longer takes it, so grading really used base_commit.
  assert b"still wrong" in _read(os.path.join(root, "toyorg__calc", "calc", "ops.py"))


def test_published_rows_jsonl_and_parquet(checkout, tmp_path):
  root, base = checkout
  rows = [_row(base), _row(base, "toyorg__calc-2")]
  table = pa.Table.from_pylist(rows)
  pq.write_table(table, tmp_path / "test-00000-of-00001.parquet")
  from_parquet = load_docs(str(tmp_path / "test-00000-of-00001.parquet"), f"swebench@{root}")
  from_jsonl = load_docs(write_jsonl(tmp_path / "v.jsonl", rows), f"swebench@{root}")
  assert [d.doc_id for d in from_parquet] == ["toyorg__calc-1", "toyorg__calc-2"]
  assert [(d.prompt, d.target) for d in from_parquet] == [(d.prompt, d.target) for d in from_jsonl]
  assert from_jsonl[0].target == f"<patch>\n{GOLD}</patch>"
  assert from_jsonl[0].data["FAIL_TO_PASS"] == ["tests/test_ops.py::test_neg"]
  # The real rows: every published field read, the test lists decoded.
  (_, _, astropy), (_, _, django) = read_records(VERIFIED)
  row = swebench.check_row(astropy)
  assert (row["version"], row["difficulty"], len(row["FAIL_TO_PASS"]), len(row["PASS_TO_PASS"])) == (
    "4.3",
    "15 min - 1 hour",
    2,
    13,
  )
  assert row["FAIL_TO_PASS"][1] == "astropy/modeling/tests/test_separable.py::test_separable[compound_model9-result9]"
  assert swebench.edited_files(row["patch"]) == ["astropy/modeling/separable.py"]
  assert swebench.edited_files(row["test_patch"]) == ["astropy/modeling/tests/test_separable.py"]
  assert (
    json.loads(django["PASS_TO_PASS"])[0] == "test_help_text (auth_tests.test_validators.MinimumLengthValidatorTest)"
  )


def test_extract_patch():
  assert swebench.extract_patch(f"Fix:\n<patch>\n{GOLD}</patch>\nDone.") == GOLD
  assert swebench.extract_patch(f"<patch>\n{WRONG}</patch>\n<patch>\n{GOLD}</patch>") == GOLD  # the last block
  assert swebench.extract_patch(f"```diff\n{GOLD}```") == GOLD
  assert swebench.extract_patch(f"Here it is:\n{GOLD.rstrip()}") == GOLD  # from its diff line; newline added
  assert swebench.extract_patch("no diff here") == ""


def test_bad_rows_name_file_line_and_field(checkout, tmp_path):
  root, base = checkout
  fmt = f"swebench@{root}"

  def fails(rows, pattern, name="bad.jsonl"):
    with pytest.raises(TaskFormatError, match=pattern):
      load_docs(write_jsonl(tmp_path / name, rows), fmt)

  row = _row(base)
  fails([row, {k: v for k, v in row.items() if k != "test_patch"}], r"bad.jsonl:2: .*missing field 'test_patch'")
  fails(
    [_row(base, FAIL_TO_PASS="tests/test_ops.py::test_neg")], r"bad.jsonl:1: .*field 'FAIL_TO_PASS' is not a JSON list"
  )
  fails([_row(base, PASS_TO_PASS='{"a": 1}')], r"bad.jsonl:1: .*field 'PASS_TO_PASS' must be a JSON string of a list")
  fails([_row(base, FAIL_TO_PASS="[]")], r"bad.jsonl:1: .*field 'FAIL_TO_PASS' is an empty list")
  fails([_row(base, version=None)], r"bad.jsonl:1: .*field 'version' must be a string")
  missing = os.path.join(root, "toyorg__absent")
  fails(
    [row, _row(base, "toyorg__absent-7", repo="toyorg/absent")],
    rf"bad.jsonl:2: .*instance toyorg__absent-7: no checkout of repo 'toyorg/absent': looked for {missing}",
  )
  absent = "0123456789abcdef0123456789abcdef01234567"
  checkout_dir = os.path.join(root, "toyorg__calc")
  fails(
    [_row(absent)],
    rf"bad.jsonl:1: .*instance toyorg__calc-1: field 'base_commit' {absent} is not a commit of {checkout_dir}",
  )
  os.makedirs(os.path.join(root, "toyorg__plain"))
  fails(
    [_row(base, repo="toyorg/plain")],
    r"bad.jsonl:1: .*the checkout .*toyorg__plain of repo 'toyorg/plain' is not a git repository",
  )
  # The real rows: a missing checkout names the instance, repo and path; django's test ids are not pytest's.
  with pytest.raises(
    TaskFormatError,
    match=rf"swebench_verified_rows.jsonl:1: .*instance astropy__astropy-12907: no checkout of repo 'astropy/astropy': looked for {root}/astropy__astropy",
  ):
    load_docs(VERIFIED, fmt)
  (_, _, django) = list(read_records(VERIFIED))[1]
  fails(  # a file of nothing but rows of another test runner: no docs, and why
    [django],
    r"django.jsonl: no records \(1 left out: django/django: tests of its own runner, not pytest's \(not run here\)\)",
    "django.jsonl",
  )
  # A mapping file: a repo it lacks is named with the file; a bad entry and a bad python are named too.
  mapping = tmp_path / "map.json"
  mapping.write_text(json.dumps({"other/repo": "x"}))
  with pytest.raises(
    TaskFormatError, match=rf"no checkout of repo 'toyorg/calc': looked for an entry for it in {mapping}"
  ):
    load_docs(write_jsonl(tmp_path / "m.jsonl", [row]), f"swebench@{mapping}")
  mapping.write_text(json.dumps({"toyorg/calc": {"checkout": "x", "python": "/no/such/python"}}))
  with pytest.raises(
    TaskFormatError, match=r"map.json: repo 'toyorg/calc': python '/no/such/python' is not an executable"
  ):
    load_docs(str(tmp_path / "m.jsonl"), f"swebench@{mapping}")
  with pytest.raises(TaskFormatError, match=r"swebench@/no/such: '/no/such' is neither a directory"):
    load_docs(str(tmp_path / "m.jsonl"), "swebench@/no/such")
