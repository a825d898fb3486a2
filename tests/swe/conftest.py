"""Shared SWE fixtures: the committed toy repository (data/swe/toy) built once per session into tasks."""

import os
import tempfile

import pytest

from k2jax.sandbox.runner import isolation_error
from k2jax.sandbox.workspace import WorkspaceRunConfig, default_python_paths
from k2jax.swe import build, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = os.path.join(ROOT, "data", "swe", "toy")
NOT_ISOLATED = isolation_error()
needs_isolation = pytest.mark.skipif(
  NOT_ISOLATED is not None, reason=f"the sandbox cannot isolate code on this machine: {NOT_ISOLATED}"
)
RUN = WorkspaceRunConfig(timeout_s=30.0, python_paths=default_python_paths())
CONFIG = build.BuildConfig(run=RUN, max_candidates=8, max_bugs=4, combos=1, combo_sizes=(2,), workers=2)


@pytest.fixture(scope="session")
def toy_tasks(tmp_path_factory):
  """(task root, instances): procedural bugs, one combo and the 1.0 -> 1.1 version diff of toycalc."""
  if NOT_ISOLATED is not None:
    pytest.skip(f"the sandbox cannot isolate code on this machine: {NOT_ISOLATED}")
  out = str(tmp_path_factory.mktemp("swe_tasks"))
  old, new = os.path.join(TOY, "toycalc-1.0"), os.path.join(TOY, "toycalc-1.1")
  instances = build.build_repo(old, "toycalc", "1.0", out, CONFIG)
  instances.append(build.build_version_diff(old, new, "toycalc", "1.0", "1.1", out, CONFIG))
  return out, instances


def patch_with(root, instance, edits):
  """A patch turning the instance's snapshot into the snapshot with `edits` ({path: text, or None to delete})
  written over it, after the gold patch when edits has the key "__gold__"."""
  with tempfile.TemporaryDirectory() as tmp:
    work = os.path.join(tmp, "repo")
    pristine = instance.snapshot_dir(root)
    snapshot.copy_tree(pristine, work)
    if edits.pop("__gold__", False):
      snapshot.apply_patch(instance.patch, work)
    for rel, text in edits.items():
      path = os.path.join(work, rel)
      if text is None:
        os.unlink(path)
      else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
          f.write(text)
    return snapshot.diff_trees(pristine, work)


def read(root, instance, rel):
  with open(os.path.join(instance.snapshot_dir(root), rel)) as f:
    return f.read()
