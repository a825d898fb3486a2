"""SWE-bench Verified rows (princeton-nlp/SWE-bench_Verified's Parquet, or the same rows as JSONL) graded against
repository checkouts and Python environments the user provides, as the SWE-bench harness grades them
(`k2jax.swe.grade` with `rules="swebench"`, `k2jax.swe.harness`): a fresh copy, the patch, the files
`test_patch` touches restored and `test_patch` applied, the whole test files it names run in the sandbox, the
FAIL_TO_PASS / PASS_TO_PASS names matched in the report as the harness's log parser reads them (a
parametrized id cut at a space included), SWE-bench's resolved rule (a skipped FAIL_TO_PASS fails, a skipped
PASS_TO_PASS is kept; the sample's `skipped` lists them).

  swebench@ROOT        checkouts at ROOT/<owner>__<name> (`astropy/astropy` -> ROOT/astropy__astropy, SWE-bench's
                       instance-id prefix); the tests run with this interpreter and its pytest
  swebench@MAP.json    a mapping file {"owner/name": "DIR"} or {"owner/name": {"checkout": "DIR", "python":
                       "PYTHON"}} (relative paths: from the file's dir); PYTHON's environment (its site-packages,
                       the ones `python -I` adds to `python -I -S`) and interpreter run the tests

A row needs instance_id, repo, base_commit, patch, test_patch, problem_statement, version and FAIL_TO_PASS /
PASS_TO_PASS, JSON strings of pytest node ids as published (lists of strings are taken too); hints_text,
created_at, environment_setup_commit and difficulty are read when present (the environment is the user's, so
environment_setup_commit is informational). When the file is read, each row's checkout must exist, be a git
repository and hold base_commit; else the error names the file, line, instance_id, repo and the path looked
for. Rows whose tests are not pytest's (django's `test_x (module.Class)` of runtests.py, sympy's bare names
of bin/test) are left out one by one, and the report counts them (`skipped_records`, with the reason): this
grader runs pytest only.

The prompt is SWE-bench's text-dataset prompt (`style-3`, the oracle retrieval of SWE-bench_oracle): the issue,
the files the gold patch edits at base_commit with line numbers, an example patch, and the instruction to
answer with one patch for `git apply`. The graded patch is the response's last <patch>...</patch> block, else
its last ```diff fence, else the text from its first `diff --git` / `--- a/` line; none is "no patch".

Grading never touches the user's checkout: base_commit is read out of its object store into a private snapshot
(a temporary index, `git read-tree` + `checkout-index` into a fresh directory; no .git, no submodules), made
once per (checkout, commit) in this process and deleted at exit; every sample is graded in its own copy of it.
A grading infrastructure failure (no sandbox, pytest missing in the environment) is `infra_failure`: the
runner stores no score for it and fails the run naming the sample.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

from k2jax.eval.records import Doc, SkipRecord, TaskFormat, str_field
from k2jax.eval.verdict import Verdict

REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "version")
OPTIONAL_STR = ("hints_text", "environment_setup_commit", "difficulty")
TEST_LISTS = ("FAIL_TO_PASS", "PASS_TO_PASS")
TIMEOUT_S = 1800.0  # the SWE-bench harness's test deadline per instance (whole test files run)

PROMPT_HEAD = "You will be provided with a partial code base and an issue statement explaining a problem to resolve."
EXAMPLE_PATCH = """<patch>
--- a/file.py
+++ b/file.py
@@ -1,27 +1,35 @@
 def euclidean(a, b):
-    while b:
-        a, b = b, a % b
-    return a
+    if b == 0:
+        return a
+    return euclidean(b, a % b)
</patch>"""
PROMPT_TAIL = (
  "I need you to solve this issue by generating a single patch file that I can apply directly to this repository "
  "using git apply. Please respond with a single patch file in the following format."
)
_GIT_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"}
_SHA = re.compile(r"[0-9a-f]{7,40}")


def swebench(arg: str) -> TaskFormat:
  """The format `swebench@ROOT` or `swebench@MAP.json`; ValueError naming the argument or the mapping's entry.
  Version "2": the harness's rules (test_patch's files restored and run whole, names as its parser reads them)."""
  parse_row = functools.partial(parse, repos=Repos.from_arg(arg))
  return TaskFormat(f"swebench@{arg}", "generate", parse_row, grade=grade, version="2")


class Repos:
  """repo ("owner/name") -> (checkout dir, python executable or None: this interpreter)."""

  def __init__(self, root: str | None, mapping: Mapping[str, tuple[str, str | None]], where: str):
    self.root, self.mapping, self.where = root, mapping, where

  @classmethod
  def from_arg(cls, arg: str) -> Repos:
    if not arg:
      raise ValueError("swebench@: give the checkouts, swebench@ROOT (ROOT/<owner>__<name>) or swebench@MAP.json")
    if os.path.isdir(arg):
      return cls(os.path.abspath(arg), {}, arg)
    if not (os.path.isfile(arg) and arg.endswith(".json")):
      raise ValueError(f"swebench@{arg}: {arg!r} is neither a directory of checkouts nor a .json mapping file")
    try:
      with open(arg, encoding="utf-8") as f:
        raw = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{arg}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict) or not raw:
      raise ValueError(
        f"{arg}: expected a JSON object {{\"owner/name\": DIR or {{\"checkout\": DIR, \"python\": EXE}}}}"
      )
    base, mapping = os.path.dirname(os.path.abspath(arg)), {}
    for repo, entry in raw.items():
      entry = {"checkout": entry} if isinstance(entry, str) else entry
      if (
        not isinstance(entry, dict) or not isinstance(entry.get("checkout"), str) or set(entry) - {"checkout", "python"}
      ):
        raise ValueError(
          f"{arg}: repo {repo!r}: expected DIR or {{\"checkout\": DIR, \"python\": EXE}}, got {entry!r:.100}"
        )
      python = entry.get("python")
      if python is not None:
        python = os.path.join(base, python) if os.sep in python else (shutil.which(python) or python)
        if not (isinstance(python, str) and os.path.isfile(python) and os.access(python, os.X_OK)):
          raise ValueError(f"{arg}: repo {repo!r}: python {entry['python']!r} is not an executable file")
      mapping[repo] = (os.path.join(base, entry["checkout"]), python)
    return cls(None, mapping, arg)

  def lookup(self, repo: str) -> tuple[str, str | None, str]:
    """(checkout dir, python or None, where it was looked for, in words)."""
    if self.root is not None:
      path = os.path.join(self.root, repo.replace("/", "__"))
      return path, None, path
    if repo not in self.mapping:
      return "", None, f"an entry for it in {self.where} (it has {sorted(self.mapping)[:5]})"
    path, python = self.mapping[repo]
    return path, python, path


def parse(r: Mapping[str, Any], i: int, repos: Repos) -> Doc:
  """A doc from one row; KeyError / TypeError / ValueError name the field (load_docs adds file and line)."""
  row = check_row(r)
  iid, repo = row["instance_id"], row["repo"]
  checkout, python, looked = repos.lookup(repo)
  if not checkout or not os.path.isdir(checkout):
    raise ValueError(f"instance {iid}: no checkout of repo {repo!r}: looked for {looked}")
  git_dir = _git_dir(checkout)
  if git_dir is None:
    raise ValueError(f"instance {iid}: the checkout {checkout} of repo {repo!r} is not a git repository")
  commit = _commit(git_dir, row["base_commit"])
  if commit is None:
    raise ValueError(f"instance {iid}: field 'base_commit' {row['base_commit']} is not a commit of {checkout}")
  files = {rel: _show(git_dir, commit, rel, iid) for rel in edited_files(row["patch"])}
  data = {
    **row,
    "base_commit": commit,
    "checkout": os.path.realpath(checkout),
    "git_dir": git_dir,
    # The interpreter itself (a venv's python is a link to its base one): the sandbox mounts that one's prefix, and
    # the environment's packages come as python_paths (`-I -S` reads no site-packages of its own).
    "python": os.path.realpath(python) if python else None,
    "python_paths": list(_env_paths(python, checkout, repo)),
  }
  return Doc(iid, prompt(row["problem_statement"], files), f"<patch>\n{row['patch']}</patch>", data)


def check_row(r: Mapping[str, Any]) -> dict[str, Any]:
  """The row's fields, checked and typed (test lists decoded); KeyError / TypeError / ValueError name the field."""
  row: dict[str, Any] = {k: str_field(r, k) for k in REQUIRED if k != "version"}
  if isinstance(r["version"], bool) or not isinstance(r["version"], (str, int, float)):
    raise TypeError(f"field 'version' must be a string, got {type(r['version']).__name__}")
  row["version"] = str(r["version"])
  for key in OPTIONAL_STR:
    if r.get(key) is not None:
      row[key] = str_field(r, key)
  if r.get("created_at") is not None:
    row["created_at"] = str(r["created_at"])  # a string in the published files; a timestamp read back is fine
  if not _SHA.fullmatch(row["base_commit"]):
    raise ValueError(f"field 'base_commit': {row['base_commit']!r:.60} is not a commit hash")
  if not row["patch"].strip():
    raise ValueError("field 'patch' (the gold fix) is empty")
  for key in TEST_LISTS:
    row[key] = test_list(r, key)
  if not row["FAIL_TO_PASS"]:
    raise ValueError("field 'FAIL_TO_PASS' is an empty list: nothing would show the fix")
  for key in TEST_LISTS:
    bad = next((t for t in row[key] if not t.split("::", 1)[0].endswith(".py")), None)
    if bad is not None:
      # One reason per repository (the report counts rows per reason), not per row's first such id.
      raise SkipRecord(f"{row['repo']}: tests of its own runner, not pytest's (not run here)")
  return row


def test_list(r: Mapping[str, Any], key: str) -> list[str]:
  """A JSON string of a list of test ids, as published (a list of strings is taken too)."""
  value = r[key]
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError:
      raise ValueError(f"field '{key}' is not a JSON list of test ids: {r[key]!r:.80}") from None
  if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
    raise TypeError(f"field '{key}' must be a JSON string of a list of test id strings, got {r[key]!r:.80}")
  return value


def edited_files(patch: str) -> list[str]:
  """The files a diff edits that exist before it (new files left out), in order."""
  out, current, new = [], None, False
  for line in patch.splitlines() + ["diff --git end"]:
    if line.startswith("diff --git "):
      if current and not new and current not in out:
        out.append(current)
      m = re.match(r"diff --git a/(\S+) b/", line)
      current, new = (m.group(1) if m else None), False
    elif line.startswith(("new file mode", "--- /dev/null")):
      new = True
  return out


def prompt(problem_statement: str, files: Mapping[str, str]) -> str:
  """SWE-bench's style-3 prompt: the issue, the code (numbered lines), an example patch, the instruction."""
  code = "".join(
    f"[start of {rel}]\n" + "".join(f"{n} {line}\n" for n, line in enumerate(text.split("\n"), 1)) + f"[end of {rel}]\n"
    for rel, text in files.items()
  )
  return (
    f"{PROMPT_HEAD}\n<issue>\n{problem_statement}\n</issue>\n\n<code>\n{code}</code>\n\n{PROMPT_TAIL}\n"
    f"{EXAMPLE_PATCH}\n\nRespond below:\n"
  )


def extract_patch(text: str) -> str:
  """The patch of a response: its last <patch> block, else its last ```diff fence, else the diff it starts."""
  blocks = re.findall(r"<patch>\n?(.*?)(?:</patch>|\Z)", text, re.DOTALL)
  if not blocks:
    blocks = re.findall(r"```(?:diff|patch)\n(.*?)(?:```|\Z)", text, re.DOTALL)
  if not blocks:
    m = re.search(r"^(?:diff --git |--- a/)", text, re.MULTILINE)
    blocks = [text[m.start() :]] if m else []
  patch = blocks[-1] if blocks else ""
  return patch if not patch.strip() or patch.endswith("\n") else patch + "\n"


def grade(doc: Doc, text: str, code: Any = None) -> Verdict:
  """1.0 iff the response's patch resolves the instance (k2jax.swe.grade in the sandbox)."""
  from k2jax.sandbox.workspace import WorkspaceRunConfig
  from k2jax.swe.grade import GradeConfig
  from k2jax.swe.grade import grade as grade_patch
  from k2jax.swe.instances import Instance

  d = doc.data
  patch = extract_patch(text)
  pristine, tree = snapshot_of(d["git_dir"], d["base_commit"])
  instance = Instance(
    d["instance_id"], d["repo"], tree, d["problem_statement"], d["patch"], tuple(d["FAIL_TO_PASS"]),
    tuple(d["PASS_TO_PASS"]), d["test_patch"], d["version"], d.get("hints_text", ""), d.get("created_at", ""),
    snapshot=os.path.basename(pristine), kind="version_diff",
  )  # fmt: skip
  run = WorkspaceRunConfig(timeout_s=TIMEOUT_S, python_paths=tuple(d["python_paths"]), python=d["python"])
  report = grade_patch(instance, patch, os.path.dirname(pristine), GradeConfig(run=run, rules="swebench"))
  extra = {
    "instance_id": d["instance_id"],
    "patch": patch,
    "resolved": bool(report.resolved),
    "pass_rate": float(report.pass_rate),
    "verdict": "infra_failure" if report.infra_failure else ("resolved" if report.resolved else "unresolved"),
    "tests_status": report.tests_status,
    "skipped": report.skipped,
    "infra_failure": bool(report.infra_failure),
  }
  timed_out = report.timed_out and not report.resolved  # the machine's load, maybe: graded again on resume
  return Verdict(float(report.resolved and not report.infra_failure), None, report.reason, extra, timed_out)


# ---- the private snapshot of base_commit -----------------------------------------------------------------
_SNAPSHOTS: dict[tuple[str, str], tuple[str, str]] = {}
_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_GUARD = threading.Lock()
_ROOT: list[str] = []


def snapshot_of(git_dir: str, commit: str) -> tuple[str, str]:
  """(directory holding `commit`'s tree, its k2jax tree hash), made once per process; the repository is read,
  never written (the index is a temporary file of ours)."""
  from k2jax.swe import snapshot

  key = (git_dir, commit)
  with _GUARD:
    if key in _SNAPSHOTS:
      return _SNAPSHOTS[key]
    lock = _LOCKS.setdefault(key, threading.Lock())
    if not _ROOT:
      _ROOT.append(tempfile.mkdtemp(prefix="k2jax-swebench-"))
      atexit.register(shutil.rmtree, _ROOT[0], True)
  with lock:
    if key in _SNAPSHOTS:
      return _SNAPSHOTS[key]
    dest = tempfile.mkdtemp(prefix=f"{commit[:12]}-", dir=_ROOT[0])
    index = os.path.join(_ROOT[0], f"{os.path.basename(dest)}.index")
    env = {**_GIT_ENV, "GIT_INDEX_FILE": index}
    try:
      _git(git_dir, ["read-tree", commit], env)
      _git(git_dir, ["--work-tree", dest, "checkout-index", "--all", "--force"], env)
    finally:
      if os.path.exists(index):
        os.unlink(index)
    _SNAPSHOTS[key] = (dest, snapshot.tree_hash(dest))
    return _SNAPSHOTS[key]


def _git(git_dir: str, args: list[str], env: Mapping[str, str] | None = None) -> str:
  argv = ["git", "-c", "safe.directory=*", "--git-dir", git_dir, *args]
  r = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=600, env=dict(env or _GIT_ENV))
  if r.returncode != 0:
    raise RuntimeError(f"{' '.join(argv)}: {(r.stderr or r.stdout).strip()[:300]}")
  return r.stdout


@functools.cache
def _git_dir(checkout: str) -> str | None:
  """The checkout's own git dir (None: not a repository; no search above the checkout)."""
  env = {**_GIT_ENV, "GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.abspath(checkout))}
  argv = ["git", "-c", "safe.directory=*", "-C", checkout, "rev-parse", "--absolute-git-dir"]
  r = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, env=env)
  return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


@functools.cache
def _commit(git_dir: str, rev: str) -> str | None:
  try:
    return _git(git_dir, ["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"]).strip() or None
  except RuntimeError:
    return None


def _show(git_dir: str, commit: str, rel: str, iid: str) -> str:
  argv = ["git", "-c", "safe.directory=*", "--git-dir", git_dir, "show", f"{commit}:{rel}"]
  r = subprocess.run(argv, check=False, capture_output=True, timeout=600, env=_GIT_ENV)
  if r.returncode != 0:
    raise ValueError(f"instance {iid}: field 'patch' edits {rel}, which base_commit {commit[:12]} lacks")
  return r.stdout.decode("utf-8", errors="replace")


@functools.cache
def _env_paths(python: str | None, checkout: str, repo: str) -> tuple[str, ...]:
  """The dirs on the tests' PYTHONPATH: `python`'s site-packages (what `-I` adds to `-I -S`, the checkout itself
  left out: the tests import the graded copy), or this interpreter's pytest's."""
  if python is None:
    from k2jax.sandbox.workspace import default_python_paths

    return default_python_paths()
  probe = "import json, sys; print(json.dumps(sys.path))"
  try:
    full, bare = (json.loads(_run([python, "-I", *flag, "-c", probe])) for flag in ([], ["-S"]))
    _run([python, "-I", "-c", "import pytest"])
  except (OSError, RuntimeError, ValueError) as e:
    raise ValueError(f"repo {repo!r}: the python {python} cannot run pytest (the grader runs the tests with it): {e}")
  inside = os.path.realpath(checkout) + os.sep
  paths = [p for p in full if p and p not in bare and os.path.isdir(p)]
  return tuple(dict.fromkeys(p for p in paths if not (os.path.realpath(p) + os.sep).startswith(inside)))


def _run(argv: list[str]) -> str:
  r = subprocess.run(
    argv, check=False, capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": os.environ.get("PATH", "")}
  )
  if r.returncode != 0:
    raise RuntimeError((r.stderr or r.stdout).strip()[-300:])
  return r.stdout


FORMATS: tuple[TaskFormat, ...] = ()  # swebench needs its checkouts: only swebench@ROOT / swebench@MAP.json
PARAMETRIZED = {"swebench": swebench}

__all__ = ["FORMATS", "PARAMETRIZED", "check_row", "extract_patch", "grade", "prompt", "snapshot_of"]
