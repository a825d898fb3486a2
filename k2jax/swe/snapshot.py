"""Repository snapshots without history: copy, hash, diff, apply a patch, and restore the test files.

A snapshot is a plain directory (never a .git: an agent must not find the fix in version-control history,
SWE-bench #465). Diffs are git-style unified diffs of text files (difflib's hunks with git's headers, so
`git apply` and `patch -p1` both take them); applying uses the system `git apply`, then `patch`, in the
order SWE-bench's harness tries them. `is_test_path` says which files grading takes from the pristine
copy: tests, conftest files and the test configuration (pytest.ini, tox.ini, setup.cfg, pyproject.toml).
"""

from __future__ import annotations

import difflib
import hashlib
import os
import shutil
import subprocess
import tempfile

SKIP_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".hypothesis", ".tox", ".eggs", ".mypy_cache"})
SKIP_SUFFIXES = (".pyc", ".pyo")
CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", ".pytest.ini"})
TEST_DIRS = frozenset({"tests", "test", "testing"})


class PatchError(ValueError):
  """A patch that does not apply (or is not a text diff): the agent's fault, not the infrastructure's."""


def is_test_path(rel: str) -> bool:
  """Tests, conftest files and test configuration: graded from the pristine copy, never from a patch."""
  parts = rel.replace(os.sep, "/").split("/")
  name = parts[-1]
  if name in CONFIG_FILES or name.startswith(("sitecustomize", "usercustomize")) or name.endswith(".pth"):
    return True
  if any(p in TEST_DIRS for p in parts[:-1]):
    return True
  return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def walk_files(root: str) -> list[str]:
  """Relative paths of the regular files and symlinks under `root`, sorted; caches and .git skipped."""
  out = []
  for d, dirs, names in os.walk(root):
    links = [x for x in dirs if os.path.islink(os.path.join(d, x))]  # listed as files, never followed
    out += [os.path.relpath(os.path.join(d, x), root) for x in links]
    dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and x not in links)
    for n in names:
      if not n.endswith(SKIP_SUFFIXES):
        out.append(os.path.relpath(os.path.join(d, n), root))
  return sorted(out)


def copy_tree(src: str, dst: str) -> None:
  """Copies `src` to a new `dst` without caches or .git (symlinks stay symlinks)."""
  shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(*SKIP_DIRS, *("*" + s for s in SKIP_SUFFIXES)))


def tree_hash(root: str) -> str:
  """sha256 over (path, content) of every file: the snapshot's `base_commit`."""
  h = hashlib.sha256()
  for rel in walk_files(root):
    p = os.path.join(root, rel)
    data = os.readlink(p).encode() if os.path.islink(p) else open(p, "rb").read()
    h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
  return h.hexdigest()[:40]


def diff_trees(old: str, new: str, include=lambda rel: True) -> str:
  """A git-style unified diff from tree `old` to tree `new` over the files `include` accepts.

  Symlinks and binary (non-UTF-8) files are left out: a source fix is text."""
  files = sorted(set(walk_files(old)) | set(walk_files(new)))
  out = []
  for rel in files:
    if not include(rel):
      continue
    a, b = _read_text(os.path.join(old, rel)), _read_text(os.path.join(new, rel))
    if a == b or a is False or b is False:
      continue
    out.append(_file_diff(rel, a, b))
  return "".join(out)


def diff_texts(rel: str, before: str, after: str) -> str:
  """The diff of one file's text (the task builder's mutations)."""
  return _file_diff(rel, before, after) if before != after else ""


def apply_patch(patch: str, root: str, *, reverse: bool = False) -> str:
  """Applies `patch` to the tree at `root`; returns the tool that applied it; PatchError when none could."""
  if not patch.strip():
    return "empty"
  with tempfile.NamedTemporaryFile("w", suffix=".diff", delete=False) as f:
    f.write(patch)
  rev = ["--reverse"] if reverse else []
  attempts = [
    ["git", "apply", "--whitespace=nowarn", *rev, f.name],
    [
      "patch",
      "--batch",
      "--forward",
      "--fuzz=5",
      "-p1",
      "--no-backup-if-mismatch",
      *(["-R"] if reverse else []),
      "-i",
      f.name,
    ],
  ]
  errors = []
  try:
    for argv in attempts:
      before = _state(root)
      # Inside a git work tree `git apply` takes paths from its top and skips the rest with exit 0: stop
      # its repository discovery at `root`'s parent so paths are `root`'s own.
      env = {**_GIT_ENV, "GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.abspath(root))}
      r = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=60, env=env)
      if r.returncode == 0 and _state(root) != before:
        return argv[0]
      errors.append(f"{argv[0]}: {(r.stderr or r.stdout).strip()[:300] or 'changed nothing'}")
      _restore(root, before)  # `patch` may have applied some hunks: undo them before the next try
  finally:
    os.unlink(f.name)
  raise PatchError("patch does not apply: " + " | ".join(errors))


def restore_tests(pristine: str, work: str) -> list[str]:
  """Makes every test path of `work` equal to `pristine`'s (added ones deleted); returns what changed."""
  changed = []
  for rel in sorted(set(walk_files(pristine)) | set(walk_files(work))):
    if not is_test_path(rel):
      continue
    src, dst = os.path.join(pristine, rel), os.path.join(work, rel)
    if os.path.lexists(dst) and os.path.lexists(src) and _same(src, dst):
      continue
    changed.append(rel)
    if os.path.lexists(dst):
      os.unlink(dst)
    if os.path.lexists(src):
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      shutil.copy2(src, dst, follow_symlinks=False)
  return changed


_GIT_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"}


def _read_text(path: str):
  """The file's text; None when absent; False for symlinks and binary files (not diffed)."""
  if not os.path.lexists(path):
    return None
  if os.path.islink(path) or not os.path.isfile(path):
    return False
  try:
    with open(path, encoding="utf-8", newline="") as f:
      return f.read()
  except UnicodeDecodeError:
    return False


def _file_diff(rel: str, a: str | None, b: str | None) -> str:
  head = [f"diff --git a/{rel} b/{rel}\n"]
  if a is None:
    head.append("new file mode 100644\n")
  if b is None:
    head.append("deleted file mode 100644\n")
  a_lines, b_lines = (a or "").splitlines(keepends=True), (b or "").splitlines(keepends=True)
  body = list(
    difflib.unified_diff(
      a_lines, b_lines, "/dev/null" if a is None else f"a/{rel}", "/dev/null" if b is None else f"b/{rel}", n=3
    )
  )
  fixed = []
  for line in body:  # git's marker for a last line without a newline (difflib leaves it unterminated)
    fixed.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
  return "".join(head + fixed)


def _same(a: str, b: str) -> bool:
  if os.path.islink(a) or os.path.islink(b):
    return os.path.islink(a) and os.path.islink(b) and os.readlink(a) == os.readlink(b)
  with open(a, "rb") as fa, open(b, "rb") as fb:
    return fa.read() == fb.read()


def _state(root: str) -> dict[str, bytes]:
  return {
    rel: open(os.path.join(root, rel), "rb").read()
    for rel in walk_files(root)
    if os.path.isfile(os.path.join(root, rel))
  }


def _restore(root: str, state: dict[str, bytes]) -> None:
  for rel in walk_files(root):
    if rel not in state:
      os.unlink(os.path.join(root, rel))
  for rel, data in state.items():
    with open(os.path.join(root, rel), "wb") as f:
      f.write(data)
