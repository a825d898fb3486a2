"""The offline task builder: repository snapshots -> validated SWE tasks of three kinds.

For each repository (an unpacked sdist or a source dir that ships its tests):
1. baseline: run the whole suite `runs` times in the sandbox; the stable tests are those passing every
   time (a repo with a collection error, or under `min_pass_frac` of its tests passing, is rejected:
   SWE-smith's "> 80% of tests pass");
2. procedural bugs: AST mutations (`mutate.py`) of its non-test files, a deterministic sample of at most
   `max_candidates`; one is kept when, with it applied, >= 1 and <= `max_fail_to_pass` stable tests fail
   (FAIL_TO_PASS), >= 1 still pass (PASS_TO_PASS), nothing fails to collect, and the same FAIL_TO_PASS fail
   again on a second run (stable);
3. combos: 2-3 kept bugs in different functions applied together, validated the same way;
4. version diffs (`build_version_diff`): old source + new tests; FAIL_TO_PASS = new tests failing on the old
   source and passing on the new; the gold patch is the source diff, the issue the changelog entry.
The agent's snapshot is the buggy tree (no .git); `patch` is the gold fix; `base_commit` the tree hash.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import os
import random
import shutil
import tempfile
from typing import Sequence

from k2jax.sandbox.workspace import WorkspaceRunConfig, prepare_workspace
from k2jax.swe import issues, mutate, snapshot
from k2jax.swe.instances import Instance
from k2jax.swe.testrun import PASSED, TestRun, run_tests


@dataclasses.dataclass(frozen=True)
class BuildConfig:
  run: WorkspaceRunConfig = WorkspaceRunConfig()
  runs: int = 3  # baseline repetitions: tests must pass in all of them
  min_pass_frac: float = 0.8
  kinds: tuple[str, ...] = mutate.KINDS
  max_candidates: int = 200  # mutations tried per repository (a seeded sample)
  max_bugs: int = 50  # kept procedural bugs per repository
  max_fail_to_pass: int = 10
  combos: int = 10  # combination tasks per repository
  combo_sizes: tuple[int, ...] = (2, 3)
  workers: int = 0  # parallel validations (0 = the CPU count)
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class Bug:
  mutations: tuple[mutate.Mutation, ...]
  bug_patch: str  # clean -> buggy
  fail_to_pass: tuple[str, ...]
  pass_to_pass: tuple[str, ...]
  failure: str  # the end of pytest's output on the buggy tree


class Builder:
  """Builds the tasks of one repository into `out` (`out/snapshots/<instance_id>/`)."""

  def __init__(self, repo_dir: str, name: str, version: str, out: str, config: BuildConfig = BuildConfig(), llm=None):
    self.repo_dir, self.name, self.version, self.out, self.config, self.llm = repo_dir, name, version, out, config, llm
    self.stable: tuple[str, ...] = ()

  def baseline(self) -> tuple[str, ...]:
    """The tests that pass in every one of `config.runs` runs of the clean tree."""
    runs = [self._run_tree(self.repo_dir, {}) for _ in range(self.config.runs)]
    errors = sorted({e for r in runs for e in r.collect_errors})
    if errors:
      raise ValueError(f"{self.name} {self.version}: tests fail to collect: {errors[:5]}")
    every = set(runs[0].outcomes)
    stable = sorted(t for t in every if all(r.outcomes.get(t) in PASSED for r in runs))
    if not every or len(stable) < self.config.min_pass_frac * len(every):
      raise ValueError(f"{self.name} {self.version}: only {len(stable)} of {len(every)} tests pass stably")
    self.stable = tuple(stable)
    return self.stable

  def candidates(self) -> list[mutate.Mutation]:
    """A seeded sample of every mutation of the repository's non-test Python files."""
    found = []
    for rel in snapshot.walk_files(self.repo_dir):
      if rel.endswith(".py") and not snapshot.is_test_path(rel) and not rel.startswith(("setup.py", "docs/")):
        with open(os.path.join(self.repo_dir, rel)) as f:
          found += mutate.mutations(rel, f.read(), self.config.kinds)
    random.Random(self.config.seed).shuffle(found)
    return found[: self.config.max_candidates]

  def bugs(self, candidates: Sequence[mutate.Mutation]) -> list[Bug]:
    """The candidates that make valid single-bug tasks (at most `max_bugs`), in candidate order."""
    kept = [b for b in self._map(lambda m: self.validate((m,)), candidates) if b is not None]
    return kept[: self.config.max_bugs]

  def combos(self, bugs: Sequence[Bug]) -> list[Bug]:
    rng = random.Random(self.config.seed + 1)
    sets = []
    for size in self.config.combo_sizes:
      groups = [
        g
        for g in itertools.combinations(bugs, size)
        if len({(b.mutations[0].path, b.mutations[0].function) for b in g}) == size
      ]
      rng.shuffle(groups)
      sets += groups[: self.config.combos]
    rng.shuffle(sets)
    ms = [tuple(m for b in g for m in b.mutations) for g in sets]
    return [b for b in self._map(self.validate, ms) if b is not None][: self.config.combos]

  def validate(self, mutations: Sequence[mutate.Mutation]) -> Bug | None:
    """The bug of `mutations` applied together, or None when it is not a valid task."""
    bug_patch = _apply_all(self.repo_dir, mutations)
    if bug_patch is None:
      return None
    first = self._run_tree(self.repo_dir, {"patch": bug_patch}, self.stable)
    if first.collect_errors or not first.consistent and first.exit_code not in (0, 1):
      return None
    f2p = tuple(t for t in self.stable if first.outcomes.get(t) not in PASSED)
    p2p = tuple(t for t in self.stable if first.outcomes.get(t) in PASSED)
    if not (1 <= len(f2p) <= self.config.max_fail_to_pass) or not p2p:
      return None
    again = self._run_tree(self.repo_dir, {"patch": bug_patch}, f2p)
    if any(again.outcomes.get(t) in PASSED for t in f2p) or again.collect_errors:
      return None  # a flaky failure is no task
    return Bug(tuple(mutations), bug_patch, f2p, p2p, first.output)

  def instance(self, bug: Bug, kind: str) -> Instance:
    """Writes the buggy snapshot and returns its instance (gold patch = the bug reversed)."""
    ms = bug.mutations
    key = hashlib.sha256("".join(m.key for m in ms).encode()).hexdigest()[:8]
    label = ms[0].kind if kind == "procedural" else f"combo{len(ms)}"
    iid = f"pypi__{self.name}.{self.version}.{label}__{key}"
    snap = os.path.join("snapshots", iid)
    dst = os.path.join(self.out, snap)
    shutil.rmtree(dst, ignore_errors=True)
    snapshot.copy_tree(self.repo_dir, dst)
    snapshot.apply_patch(bug.bug_patch, dst)
    gold = snapshot.diff_trees(dst, self.repo_dir, include=lambda rel: not snapshot.is_test_path(rel))
    funcs = [(m.path[:-3].replace("/", "."), m.function) for m in ms]
    statement = issues.bug_statement(funcs, bug.fail_to_pass, bug.failure, int(key, 16), self.llm, gold)
    return Instance(
      instance_id=iid,
      repo=f"pypi/{self.name}",
      base_commit=snapshot.tree_hash(dst),
      problem_statement=statement,
      patch=gold,
      FAIL_TO_PASS=bug.fail_to_pass,
      PASS_TO_PASS=bug.pass_to_pass,
      version=self.version,
      snapshot=snap,
      kind=kind,
      mutations=tuple(f"{m.kind} {m.path} {m.summary}" for m in ms),
    )

  def _run_tree(self, src: str, edit: dict, tests: Sequence[str] = ()) -> TestRun:
    with tempfile.TemporaryDirectory(prefix="k2jax-swe-build-") as tmp:
      work = os.path.join(tmp, "repo")
      snapshot.copy_tree(src, work)
      if edit.get("patch"):
        snapshot.apply_patch(edit["patch"], work)
      prepare_workspace(work)
      return run_tests(work, tests, self.config.run)

  def _map(self, fn, items):
    workers = self.config.workers or os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # each call waits on a sandbox process
      return list(pool.map(fn, items))


def build_repo(repo_dir: str, name: str, version: str, out: str, config: BuildConfig = BuildConfig(), llm=None):
  """Procedural and combination tasks of one repository (see the module docstring)."""
  b = Builder(repo_dir, name, version, out, config, llm)
  b.baseline()
  bugs = b.bugs(b.candidates())
  combos = b.combos(bugs) if config.combos else []
  return [b.instance(x, "procedural") for x in bugs] + [b.instance(x, "combo") for x in combos]


def build_version_diff(
  old_dir: str,
  new_dir: str,
  name: str,
  old_version: str,
  new_version: str,
  out: str,
  config: BuildConfig = BuildConfig(),
) -> Instance | None:
  """The task "bring `old` to `new`'s behaviour": old source + new tests; None without a valid F2P/P2P."""
  new = Builder(new_dir, name, new_version, out, config)
  stable = new.baseline()
  test_patch = snapshot.diff_trees(old_dir, new_dir, include=snapshot.is_test_path)
  gold = snapshot.diff_trees(old_dir, new_dir, include=lambda rel: not snapshot.is_test_path(rel))
  if not gold or not test_patch:
    return None
  on_old = new._run_tree(old_dir, {"patch": test_patch}, stable)
  f2p = tuple(t for t in stable if on_old.outcomes.get(t) not in PASSED)
  p2p = tuple(t for t in stable if on_old.outcomes.get(t) in PASSED)
  if not f2p or not p2p or len(f2p) > config.max_fail_to_pass * 5:
    return None
  iid = f"pypi__{name}.{new_version}.version_diff__{hashlib.sha256(gold.encode()).hexdigest()[:8]}"
  snap = os.path.join("snapshots", iid)
  dst = os.path.join(out, snap)
  shutil.rmtree(dst, ignore_errors=True)
  snapshot.copy_tree(old_dir, dst)
  entry = _changelog(new_dir, new_version) or f"Update {name} from {old_version} to {new_version}."
  statement = f"Implement the changes of {name} {new_version}, as its changelog describes them:\n\n{entry}"
  return Instance(
    instance_id=iid,
    repo=f"pypi/{name}",
    base_commit=snapshot.tree_hash(dst),
    problem_statement=statement,
    patch=gold,
    FAIL_TO_PASS=f2p,
    PASS_TO_PASS=p2p,
    test_patch=test_patch,
    version=new_version,
    snapshot=snap,
    kind="version_diff",
  )


def _changelog(root: str, version: str) -> str:
  for rel in snapshot.walk_files(root):
    base = os.path.basename(rel).lower()
    if base.split(".")[0] in ("changelog", "changes", "history", "news", "versions") and rel.count("/") <= 1:
      with open(os.path.join(root, rel), errors="replace") as f:
        entry = issues.changelog_entry(f.read(), version)
      if entry:
        return entry
  return ""


def _apply_all(root: str, mutations: Sequence[mutate.Mutation]) -> str | None:
  """One patch for several mutations (each made on the clean file; their edits must not overlap)."""
  with tempfile.TemporaryDirectory(prefix="k2jax-swe-mut-") as tmp:
    work = os.path.join(tmp, "repo")
    snapshot.copy_tree(root, work)
    for m in mutations:
      try:
        snapshot.apply_patch(snapshot.diff_texts(m.path, m.before, m.after), work)
      except snapshot.PatchError:
        return None
    return snapshot.diff_trees(root, work)
