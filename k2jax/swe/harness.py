"""The SWE-bench harness's rules (swebench 5.0: `harness/grading.py`, `harness/log_parsers/python.py`, the eval
script of `test_spec/python.py`), applied to the outcomes k2jax's own test run reads (`testrun.py`), for rows
that must be graded as SWE-bench grades them (`GradeConfig(rules="swebench")`, the `swebench@` eval format).

What the harness does, and what this module does with it:
- Before the tests: `git checkout <base_commit>` of the files `test_patch` edits, then `git apply test_patch`.
  Nothing else is restored: a package's own `testing/` module or `tests/helper.py` is source the model may fix
  (`restore_test_patch_files`; a file `test_patch` creates is removed first, so that it applies).
- The tests: the test command plus every file `test_patch` names (its "directives", data files left out):
  whole files, never node ids (`test_directives`).
- The report: its log parser reads pytest's `-rA` lines `STATUS node-id` (and `-v` lines `node-id STATUS`);
  the name is what precedes the first whitespace, so a parametrized id whose parameters hold a space is cut
  there (`test_ogip_grammar_fail[log(photon`: hundreds of Verified's ids are such), and names cut alike share
  one entry, the last line of the log winning (pytest's summary order: passed, xfailed, error, failed after
  the skips its verbose lines name). XPASS is no status it knows: an xpassed test is absent. `status_map`
  builds that map from the run's outcomes, with the per-repository parsers' own rewrites (matplotlib's mouse
  buttons, the option paths of requests, pydicom and pylint, seaborn's parser that reads PASSED and FAILED
  only).
- Grading (`tests_status`): a name is looked up as it is, else, when it has more `[` than `]` (cut inside its
  parameters), by prefix over the map's names when they agree on passing; FAIL_TO_PASS passes on PASSED or
  XFAIL (a SKIPPED or absent one fails: a skip is no resolution); PASS_TO_PASS is kept on PASSED, XFAIL or
  SKIPPED. Resolved: every FAIL_TO_PASS passes and every PASS_TO_PASS is kept. A run whose map is empty (the
  suite did not run), or that exited non-zero with no FAILED or ERROR in it, has no results (`no_results`).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
# The harness's NON_TEST_EXTS: test_patch files that are data, not test directives ("csv" has no dot there).
NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")
# testrun's outcome -> the status the harness's parser reads from pytest's output (xpassed: none, absent).
_STATUS = {"passed": PASSED, "failed": FAILED, "error": ERROR, "skipped": SKIPPED, "xfailed": XFAIL}
# The order those lines reach the log (verbose skip lines, then the -rA summary): a later one wins a name.
_LOG_ORDER = ("skipped", "passed", "xfailed", "error", "failed")
_OPTIONS = re.compile(r"(.*?)\[(.*)\]")
_DIFF = re.compile(r"^diff --git a/.* b/(.*)$", re.MULTILINE)
OPTION_REPOS = frozenset({"psf/requests", "pydicom/pydicom", "pylint-dev/pylint"})


def test_directives(test_patch: str) -> list[str]:
  """The files the harness passes to the test command: every file of `test_patch` but data files."""
  files = dict.fromkeys(_DIFF.findall(test_patch))
  return [f for f in files if not f.endswith(NON_TEST_EXTS)]


def patch_files(patch: str) -> tuple[list[str], list[str]]:
  """(files the patch edits or deletes: they exist before it, files it creates)."""
  edited, created, current = [], [], None
  for line in patch.splitlines():
    if line.startswith("diff --git "):
      m = re.match(r"diff --git a/(\S+) b/(\S+)", line)
      current = m.group(2) if m else None
    elif line.startswith("--- ") and current is not None:
      (created if line[4:].split("\t")[0].strip() == "/dev/null" else edited).append(current)
      current = None
  return list(dict.fromkeys(edited)), list(dict.fromkeys(created))


def restore_test_patch_files(pristine: str, work: str, test_patch: str) -> list[str]:
  """The harness's `git checkout <base_commit> <files test_patch edits>`: those files as `pristine` has them,
  and the files it creates removed (else it would not apply). Returns the paths that changed."""
  edited, created = patch_files(test_patch)
  changed = []
  for rel in edited + created:
    src, dst = os.path.join(pristine, rel), os.path.join(work, rel)
    inside = os.path.normpath(os.path.join(os.path.realpath(work), os.path.dirname(rel)))
    if rel.startswith("/") or ".." in rel.split("/") or os.path.realpath(os.path.dirname(dst)) != inside:
      raise ValueError(f"the test file {rel!r} is not inside the repository (a directory on its path is a link)")
    same = os.path.lexists(src) and os.path.lexists(dst) and not os.path.islink(dst) and _same(src, dst)
    if same or (not os.path.lexists(src) and not os.path.lexists(dst)):
      continue
    changed.append(rel)
    if os.path.lexists(dst):
      if os.path.isdir(dst) and not os.path.islink(dst):
        shutil.rmtree(dst)
      else:
        os.unlink(dst)
    if os.path.lexists(src):
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      shutil.copy2(src, dst, follow_symlinks=False)
  return changed


def status_map(outcomes: Mapping[str, str], repo: str) -> dict[str, str]:
  """{name as the harness's log parser reads it: status} from testrun's {node id: outcome}."""
  out: dict[str, str] = {}
  for outcome in _LOG_ORDER:
    for node, got in outcomes.items():
      if got != outcome:
        continue
      words = node.split()
      if not words:
        continue
      name, status = _rewrite(words[0], repo), _STATUS[outcome]
      if repo == "mwaskom/seaborn" and status not in (PASSED, FAILED):
        continue  # seaborn's parser reads no other status: such a test is absent
      out[name] = status
  return out


def _rewrite(name: str, repo: str) -> str:
  if repo == "matplotlib/matplotlib":
    name = name.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3")
  if repo in OPTION_REPOS:  # parse_log_pytest_options: an option that is an absolute path keeps its last part
    m = _OPTIONS.search(name)
    if m:
      main, option = m.groups()
      if option.startswith("/") and not option.startswith("//") and "*" not in option:
        option = "/" + option.split("/")[-1]
      name = f"{main}[{option}]"
  return name


def lookup(name: str, sm: Mapping[str, str]) -> str | None:
  """The map's entry for a dataset's name: itself, else (a name cut inside its parameters) the entries it
  prefixes when they agree on passing."""
  if name in sm:
    return name
  if name.count("[") > name.count("]"):
    matches = [k for k in sm if k.startswith(name)]
    if matches and len({sm[k] in (PASSED, XFAIL) for k in matches}) == 1:
      return matches[0]
  return None


def tests_status(f2p: Sequence[str], p2p: Sequence[str], sm: Mapping[str, str]) -> dict[str, dict[str, list]]:
  """SWE-bench's tests_status: FAIL_TO_PASS succeeds on PASSED / XFAIL; PASS_TO_PASS also on SKIPPED."""
  out = {}
  for key, tests, ok in (("FAIL_TO_PASS", f2p, (PASSED, XFAIL)), ("PASS_TO_PASS", p2p, (PASSED, XFAIL, SKIPPED))):
    status = [sm.get(lookup(t, sm) or "", None) for t in tests]
    out[key] = {
      "success": [t for t, s in zip(tests, status) if s in ok],
      "failure": [t for t, s in zip(tests, status) if s not in ok],
    }
  return out


def skipped(f2p: Sequence[str], p2p: Sequence[str], sm: Mapping[str, str]) -> dict[str, list[str]]:
  """The FAIL_TO_PASS and PASS_TO_PASS tests the run skipped (counted failed, and kept, respectively)."""
  return {
    key: [t for t in tests if sm.get(lookup(t, sm) or "") == SKIPPED]
    for key, tests in (("FAIL_TO_PASS", f2p), ("PASS_TO_PASS", p2p))
  }


def no_results(sm: Mapping[str, str], exit_code: int) -> str:
  """Why the harness would find no results in this run ("" when it has them)."""
  if not sm:
    return "the test run reported no test (the suite did not run)"
  if exit_code != 0 and not any(s in (FAILED, ERROR) for s in sm.values()):
    return f"the test command exited {exit_code} with no failing test reported"
  return ""


def _same(a: str, b: str) -> bool:
  if os.path.islink(a) or not os.path.isfile(a) or not os.path.isfile(b):
    return False
  with open(a, "rb") as fa, open(b, "rb") as fb:
    return fa.read() == fb.read()
