"""SWE-bench Verified rows graded as the SWE-bench harness grades them, against small repositories that reproduce
the rows' test names and layouts.

- astropy__astropy-12907: the published row (instance_id, repo, version, problem statement, gold patch,
  FAIL_TO_PASS and PASS_TO_PASS, 15 names of `astropy/modeling/tests/test_separable.py`), with base_commit and
  test_patch of a small repository whose `_cstack` has the published bug in the published lines (the gold
  patch applies as published) and whose parametrized `test_separable` has the same ids
  (`compound_model6-result6`, ...). The whole test file runs; another of its tests fails either way.
- a row in the published layout with Verified's parametrized ids cut at a space
  (`astropy/units/tests/test_format.py::test_ogip_grammar_fail[log(photon`): its gold patch fixes the parser
  and `astropy/tests/helper.py`, source the package ships in a tests directory; a FAIL_TO_PASS that xfails
  passes, a PASS_TO_PASS that is skipped is kept, and the sample says so.
- django__django-11099 (the published row): runtests.py's names, left out of the task and counted.
Old rules (every test path restored, names passed to pytest as node ids) leave the gold patch unresolved."""

import json
import os
import subprocess

import pytest

from k2jax.eval import EvalConfig, TaskSpec, load_docs, run
from k2jax.eval.grading import grade
from k2jax.eval.records import read_records
from k2jax.sandbox.code import CodeRewardConfig
from k2jax.sandbox.runner import isolation_error
from k2jax.swe import harness
from k2jax.swe.snapshot import diff_texts

from .conftest import scripted_model, write_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))
VERIFIED = os.path.join(HERE, "swebench_verified_rows.jsonl")
NOT_ISOLATED = isolation_error()
needs_sandbox = pytest.mark.skipif(NOT_ISOLATED is not None, reason=f"no sandbox here: {NOT_ISOLATED}")
CODE = CodeRewardConfig()

SEPARABLE = """import numpy as np


class Model:
    def __init__(self, n_inputs, n_outputs, separable=True):
        self.n_inputs, self.n_outputs, self.separable = n_inputs, n_outputs, separable

    def __and__(self, other):
        return CompoundModel("&", self, other)


class CompoundModel(Model):
    def __init__(self, op, left, right):
        super().__init__(left.n_inputs + right.n_inputs, left.n_outputs + right.n_outputs, False)
        self.op, self.left, self.right = op, left, right


def _compute_n_outputs(left, right):
    lnout = left.n_outputs if isinstance(left, Model) else left.shape[0]
    rnout = right.n_outputs if isinstance(right, Model) else right.shape[0]
    return lnout + rnout


def _coord_matrix(model, pos, noutp):
    mat = np.zeros((noutp, model.n_inputs))
    if model.separable:
        for i in range(model.n_inputs):
            mat[i, i] = 1
    else:
        mat[: model.n_outputs, : model.n_inputs] = 1
    if pos == 'right':
        mat = np.roll(mat, noutp - model.n_outputs, axis=0)
    return mat


def _cstack(left, right):
    noutp = _compute_n_outputs(left, right)

    if isinstance(left, Model):
        cleft = _coord_matrix(left, 'left', noutp)
    else:
        cleft = np.zeros((noutp, left.shape[1]))
        cleft[: left.shape[0], : left.shape[1]] = left
    if isinstance(right, Model):
        cright = _coord_matrix(right, 'right', noutp)
    else:
        cright = np.zeros((noutp, right.shape[1]))
        cright[-right.shape[0]:, -right.shape[1]:] = 1

    return np.hstack([cleft, cright])


def _separable(transform):
    if isinstance(transform, CompoundModel):
        return _cstack(_separable(transform.left), _separable(transform.right))
    return _coord_matrix(transform, 'left', transform.n_outputs)


def separability_matrix(transform):
    return _separable(transform).astype(bool)
"""
SEP_TESTS = """import numpy as np
import pytest

from astropy.modeling.separable import Model, _coord_matrix, _cstack, separability_matrix

sh1, sh2 = Model(1, 1), Model(1, 1)
rot = Model(2, 2, separable=False)


def _blocks(*sizes):
    n = sum(sizes)
    out = np.zeros((n, n), dtype=bool)
    k = 0
    for size in sizes:
        out[k : k + size, k : k + size] = True
        k += size
    return out.tolist()


def test_coord_matrix():
    assert _coord_matrix(sh1, 'left', 2).tolist() == [[1], [0]]


def test_cdot():
    assert separability_matrix(sh1).tolist() == [[True]]


def test_cstack():
    assert _cstack(sh1, sh2).tolist() == [[1, 0], [0, 1]]


def test_arith_oper():
    assert separability_matrix(rot).tolist() == [[True, True], [True, True]]


def test_custom_model_separable():
    assert separability_matrix(sh1 & sh2).tolist() == [[True, False], [False, True]]


def test_unlisted_and_broken():
    assert False, "a test of the file that neither list names"


compound_models = [
CASES
]


@pytest.mark.parametrize(("compound_model", "result"), compound_models)
def test_separable(compound_model, result):
    assert separability_matrix(compound_model).tolist() == result
"""
# Indices 6, 9 and 10 stack a compound model on the right (the published bug's case); 0-5, 7 and 8 do not.
BASE_CASES = [
  "    (sh1 & sh2, _blocks(1, 1)),",
  "    (rot & sh1, _blocks(2, 1)),",
  "    (sh1 & rot, _blocks(1, 2)),",
  "    (rot & sh1 & sh2, _blocks(2, 1, 1)),",
  "    (sh1 & sh2 & sh1, _blocks(1, 1, 1)),",
  "    (rot & rot, _blocks(2, 2)),",
]
NEW_CASES = [
  "    (rot & (sh1 & sh2), _blocks(2, 1, 1)),",
  "    (sh1 & sh2 & rot, _blocks(1, 1, 2)),",
  "    ((rot & sh1) & sh2, _blocks(2, 1, 1)),",
  "    (sh1 & (sh1 & sh2), _blocks(1, 1, 1)),",
  "    (rot & sh1 & (sh1 & sh2), _blocks(2, 1, 1, 1)),",
]

OGIP = """def parse_ogip(text):
    if "(" in text and " " not in text:
        raise ValueError(f"not OGIP: {text}")
    return text
"""
OGIP_FIXED = OGIP.replace(' and " " not in text', "")
HELPER = """def fails(fn, text):
    try:
        fn(text)
    except ValueError:
        return False
    return False
"""
HELPER_FIXED = HELPER.replace(
  "    except ValueError:\n        return False\n", "    except ValueError:\n        return True\n"
)
FORMAT_TESTS = """import pytest

from astropy.tests.helper import fails
from astropy.units.format.ogip import parse_ogip


@pytest.mark.parametrize("string", ["log(photon /cm**2/s/Hz)", "sin( 1 / Hz)", "dB(mW)"])
def test_ogip_grammar_fail(string):
    assert fails(parse_ogip, string)


def test_ogip_plain():
    assert parse_ogip("m") == "m"
"""
FORMAT_TESTS_NEW = (
  FORMAT_TESTS
  + '''

@pytest.mark.xfail(reason="the grammar still takes it", strict=True)
def test_ogip_known_gap():
    assert fails(parse_ogip, "m")


@pytest.mark.skip(reason="needs the full unit registry")
def test_ogip_registry():
    pass
'''
)
OGIP_F2P = [
  "astropy/units/tests/test_format.py::test_ogip_grammar_fail[log(photon",
  "astropy/units/tests/test_format.py::test_ogip_grammar_fail[sin(",
  "astropy/units/tests/test_format.py::test_ogip_grammar_fail[dB(mW)]",
  "astropy/units/tests/test_format.py::test_ogip_known_gap",
]
OGIP_P2P = [
  "astropy/units/tests/test_format.py::test_ogip_plain",
  "astropy/units/tests/test_format.py::test_ogip_registry",
]


def _git(repo, *args):
  env = {"PATH": os.environ["PATH"], "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1"}
  ident = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "-c", "init.defaultBranch=main"]
  return subprocess.run(["git", *ident, *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def astropy(tmp_path_factory):
  """ROOT/astropy__astropy at one commit: modeling/separable.py, units/format/ogip.py, tests/helper.py and their
  tests as the rows' names need them. Returns (ROOT, base_commit)."""
  root = tmp_path_factory.mktemp("repos")
  repo = root / "astropy__astropy"
  files = {
    "astropy/__init__.py": "",
    "astropy/modeling/__init__.py": "",
    "astropy/modeling/separable.py": SEPARABLE,
    "astropy/modeling/tests/__init__.py": "",
    "astropy/modeling/tests/test_separable.py": SEP_TESTS.replace("CASES", "\n".join(BASE_CASES)),
    "astropy/units/__init__.py": "",
    "astropy/units/format/__init__.py": "",
    "astropy/units/format/ogip.py": OGIP,
    "astropy/units/tests/__init__.py": "",
    "astropy/units/tests/test_format.py": FORMAT_TESTS,
    "astropy/tests/__init__.py": "",
    "astropy/tests/helper.py": HELPER,
  }
  for rel, text in files.items():
    (repo / rel).parent.mkdir(parents=True, exist_ok=True)
    (repo / rel).write_text(text)
  _git(repo, "init", "-q")
  _git(repo, "add", "-A")
  _git(repo, "commit", "-q", "-m", "base")
  return str(root), _git(repo, "rev-parse", "HEAD").strip()


def _rows(base):
  """The published astropy__astropy-12907 row (its own gold patch) on the small repository, and the ogip row."""
  (_, _, published), _ = list(read_records(VERIFIED))
  tests_path = "astropy/modeling/tests/test_separable.py"
  old_tests = SEP_TESTS.replace("CASES", "\n".join(BASE_CASES))
  separable = {
    **published,
    "base_commit": base,
    # The published gold patch, as it is: the small repository's _cstack has its context lines.
    "test_patch": diff_texts(tests_path, old_tests, SEP_TESTS.replace("CASES", "\n".join(BASE_CASES + NEW_CASES))),
  }
  ogip = {
    **{k: published[k] for k in ("repo", "version", "created_at", "hints_text", "environment_setup_commit")},
    "instance_id": "astropy__astropy-ogip",
    "problem_statement": "OGIP units with spaces inside a function call are accepted; they should be refused.",
    "base_commit": base,
    "patch": diff_texts("astropy/units/format/ogip.py", OGIP, OGIP_FIXED)
    + diff_texts("astropy/tests/helper.py", HELPER, HELPER_FIXED),
    "test_patch": diff_texts("astropy/units/tests/test_format.py", FORMAT_TESTS, FORMAT_TESTS_NEW),
    "FAIL_TO_PASS": json.dumps(OGIP_F2P),
    "PASS_TO_PASS": json.dumps(OGIP_P2P),
  }
  return separable, ogip


def test_harness_names_and_statuses():
  """The log parser's view of a run: names cut at their first whitespace, the log's last status winning."""
  outcomes = {
    "t.py::f[a b]": "passed",
    "t.py::f[a c]": "failed",  # cut to the same name: FAILED comes later in -rA's summary
    "t.py::g": "xpassed",  # XPASS is no status the parser knows
    "t.py::h": "skipped",
    "t.py::k": "xfailed",
    "t.py::m[x y]": "passed",
  }
  sm = harness.status_map(outcomes, "astropy/astropy")
  assert sm == {"t.py::f[a": "FAILED", "t.py::h": "SKIPPED", "t.py::k": "XFAIL", "t.py::m[x": "PASSED"}
  status = harness.tests_status(["t.py::k", "t.py::h", "t.py::g", "t.py::m[x"], ["t.py::h", "t.py::g"], sm)
  assert status["FAIL_TO_PASS"] == {"success": ["t.py::k", "t.py::m[x"], "failure": ["t.py::h", "t.py::g"]}
  assert status["PASS_TO_PASS"] == {"success": ["t.py::h"], "failure": ["t.py::g"]}
  # A name cut inside its parameters is found by prefix when the candidates agree (swebench 5.0).
  assert harness.lookup("t.py::m[x y", {"t.py::m[x y z]": "PASSED"}) == "t.py::m[x y z]"
  assert harness.lookup("t.py::m[x", {"t.py::m[x1]": "PASSED", "t.py::m[x2]": "FAILED"}) is None
  assert harness.status_map({"t.py::f[/tmp/a/b.dcm]": "passed"}, "pydicom/pydicom") == {"t.py::f[/b.dcm]": "PASSED"}
  assert harness.status_map({"t.py::f": "skipped", "t.py::g": "error"}, "mwaskom/seaborn") == {}
  assert (
    harness.no_results({}, 0) and harness.no_results({"a": "PASSED"}, 2) and not harness.no_results({"a": "FAILED"}, 1)
  )
  assert harness.test_directives("diff --git a/t/x.py b/t/x.py\ndiff --git a/t/d.json b/t/d.json\n") == ["t/x.py"]


@needs_sandbox
def test_verified_rows_gold_resolves_empty_does_not_testing_source_survives(astropy, tmp_path):
  root, base = astropy
  separable, ogip = _rows(base)
  (_, _, django) = list(read_records(VERIFIED))[1]
  path = write_jsonl(tmp_path / "verified.jsonl", [separable, django, ogip])
  fmt = f"swebench@{root}"
  sep_doc, ogip_doc = load_docs(path, fmt)  # the django row is left out, not the file refused
  assert sep_doc.data["FAIL_TO_PASS"] == json.loads(separable["FAIL_TO_PASS"])  # the published names
  v = grade(fmt, "swebench", sep_doc, f"<patch>\n{separable['patch']}</patch>", "stop", CODE)
  assert (v.score, v.extra["verdict"]) == (1.0, "resolved"), v.reason
  assert v.extra["tests_status"]["FAIL_TO_PASS"]["success"] == json.loads(separable["FAIL_TO_PASS"])
  assert len(v.extra["tests_status"]["PASS_TO_PASS"]["success"]) == 13  # test_unlisted_and_broken failed: no matter
  v = grade(fmt, "swebench", sep_doc, "I do not know.", "stop", CODE)
  assert (v.score, v.reason) == (0.0, "no patch")
  wrong = separable["patch"].replace("= right", "= 1 + 0 * right")
  v = grade(fmt, "swebench", sep_doc, f"<patch>\n{wrong}</patch>", "stop", CODE)
  assert v.score == 0.0 and v.extra["tests_status"]["FAIL_TO_PASS"]["failure"] == json.loads(separable["FAIL_TO_PASS"])
  # The ogip row: names cut at a space matched, the helper fix under astropy/tests/ kept, xfail and skip counted.
  v = grade(fmt, "swebench", ogip_doc, f"<patch>\n{ogip['patch']}</patch>", "stop", CODE)
  assert v.score == 1.0, v.reason
  assert v.extra["tests_status"]["FAIL_TO_PASS"]["success"] == OGIP_F2P  # the xfail among them
  assert v.extra["skipped"] == {
    "FAIL_TO_PASS": [],
    "PASS_TO_PASS": ["astropy/units/tests/test_format.py::test_ogip_registry"],
  }
  assert "skipped, as SWE-bench counts them: 0 FAIL_TO_PASS (failed), 1 PASS_TO_PASS (kept)" in v.reason
  only_source = diff_texts("astropy/units/format/ogip.py", OGIP, OGIP_FIXED)  # the helper left broken
  v = grade(fmt, "swebench", ogip_doc, f"<patch>\n{only_source}</patch>", "stop", CODE)
  assert v.score == 0.0 and OGIP_F2P[0] in v.extra["tests_status"]["FAIL_TO_PASS"]["failure"]
  assert grade(fmt, "swebench", ogip_doc, "", "stop", CODE).score == 0.0


@needs_sandbox
def test_old_rules_leave_the_gold_unresolved(astropy):
  """k2jax's offline-task rules on the ogip row: the helper fix is restored away and the cut names are no node
  ids pytest finds, so the gold patch fails; the harness's rules resolve it (above)."""
  from k2jax.eval.formats.swebench import snapshot_of
  from k2jax.sandbox.workspace import WorkspaceRunConfig, default_python_paths
  from k2jax.swe.grade import GradeConfig
  from k2jax.swe.grade import grade as grade_patch
  from k2jax.swe.instances import Instance

  root, base = astropy
  _, ogip = _rows(base)
  git_dir = os.path.join(root, "astropy__astropy", ".git")
  pristine, tree = snapshot_of(git_dir, base)
  instance = Instance(
    ogip["instance_id"], ogip["repo"], tree, ogip["problem_statement"], ogip["patch"], tuple(OGIP_F2P),
    tuple(OGIP_P2P), ogip["test_patch"], snapshot=os.path.basename(pristine), kind="version_diff",
  )  # fmt: skip
  run_config = WorkspaceRunConfig(timeout_s=120.0, python_paths=default_python_paths())
  old = grade_patch(instance, ogip["patch"], os.path.dirname(pristine), GradeConfig(run=run_config))
  assert not old.resolved and "astropy/tests/helper.py" in old.reason  # restored from pristine
  new = grade_patch(instance, ogip["patch"], os.path.dirname(pristine), GradeConfig(run=run_config, rules="swebench"))
  assert new.resolved, new.reason


@needs_sandbox
def test_the_runner_counts_rows_of_other_runners(astropy, tmp_path, tok):
  root, base = astropy
  separable, _ = _rows(base)
  (_, _, django) = list(read_records(VERIFIED))[1]
  other = {**django, "instance_id": "django__django-11099b", "FAIL_TO_PASS": '["test_other (auth_tests.T)"]'}
  path = write_jsonl(tmp_path / "verified.jsonl", [django, separable, other])
  model, _ = scripted_model(tok, lambda prompt, seed: f"<patch>\n{separable['patch']}</patch>")
  spec = TaskSpec("swebench", path, f"swebench@{root}")
  report = run(EvalConfig("scripted", (spec,), str(tmp_path / "out"), max_tokens=2048, progress=False), model)
  task = report["tasks"]["swebench"]
  assert (task["num_docs"], task["metrics"]["pass@1"], task["skipped_records"]) == (1, 1.0, 2)
  assert task["skipped_why"] == {"django/django: tests of its own runner, not pytest's (not run here)": 2}
  with open(os.path.join(tmp_path / "out", "report.md")) as f:
    assert "- swebench: 2 records of the file left out (2: django/django: tests of its own runner" in f.read()
