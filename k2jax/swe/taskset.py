"""A task set on disk, built from a directory of package sources (sdists and/or unpacked source trees).

  sources/  more-itertools-9.0.0.tar.gz  more-itertools-9.1.0.tar.gz  toycalc-1.0/  toycalc-1.1/ ...
  out/      instances.jsonl     SWE-bench rows (k2jax fields: snapshot, kind, mutations)
            rl_tasks.jsonl      records for `configs/rl.py` agentic tasks (env "swe")
            snapshots/<id>/     each instance's repository as the agent sees it (no .git)
            repos/<name>-<v>/   the unpacked sources the tasks were made from

Per package, the newest version gets procedural and combination tasks; each pair of consecutive versions
a version-diff task. sdists are unpacked with tarfile's `data` filter (no links out, no devices, no
absolute paths); a source tree without a test directory or test files is skipped with a message.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tarfile
import zipfile

from packaging.version import InvalidVersion, Version

from k2jax.swe import build, snapshot
from k2jax.swe.instances import Instance, write_instances

log = logging.getLogger(__name__)
_NAME_VERSION = re.compile(r"^(?P<name>.+?)-(?P<version>\d[^-]*?)(\.tar\.gz|\.tgz|\.zip)?$")
DEMO = {"content": "", "tool_calls": [{"id": "functions.bash:0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "python -m pytest -q -x"}'}}]}  # fmt: skip
GUIDE = "\n\nThe repository is checked out at /testbed. Fix the issue with the tools, then call finish."


def discover(sources: str, unpack_to: str) -> dict[str, list[tuple[str, str]]]:
  """{package name: [(version, source dir), ...] oldest first} for every sdist or dir in `sources`."""
  found: dict[str, list[tuple[str, str]]] = {}
  for entry in sorted(os.listdir(sources)):
    m = _NAME_VERSION.match(entry)
    if not m:
      continue
    path = os.path.join(sources, entry)
    name, version = m.group("name").lower().replace("_", "-"), m.group("version")
    try:
      Version(version)
    except InvalidVersion:
      log.warning("skipping %s: %r is not a version", entry, version)
      continue
    root = path if os.path.isdir(path) else unpack(path, os.path.join(unpack_to, f"{name}-{version}"))
    if not any(snapshot.is_test_path(f) and f.endswith(".py") for f in snapshot.walk_files(root)):
      log.warning("skipping %s: it ships no tests", entry)
      continue
    found.setdefault(name, []).append((version, root))
  return {n: sorted(v, key=lambda x: Version(x[0])) for n, v in found.items()}


def unpack(archive: str, dest: str) -> str:
  """Unpacks an sdist into `dest`; returns its single top-level dir (or `dest`)."""
  shutil.rmtree(dest, ignore_errors=True)
  os.makedirs(dest)
  if archive.endswith(".zip"):
    with zipfile.ZipFile(archive) as z:
      for n in z.namelist():
        if n.startswith("/") or ".." in n.split("/"):
          raise ValueError(f"{archive}: member {n!r} leaves the archive's dir")
      z.extractall(dest)
  else:
    with tarfile.open(archive) as t:
      t.extractall(dest, filter="data")
  tops = os.listdir(dest)
  return os.path.join(dest, tops[0]) if len(tops) == 1 and os.path.isdir(os.path.join(dest, tops[0])) else dest


def build_task_set(
  sources: str, out: str, config: build.BuildConfig, llm=None, version_diffs: bool = True, max_turns: int = 0
) -> list[Instance]:
  """Builds every task of `sources` into `out` and writes instances.jsonl and rl_tasks.jsonl."""
  os.makedirs(out, exist_ok=True)
  instances: list[Instance] = []
  for name, versions in discover(sources, os.path.join(out, "repos")).items():
    version, root = versions[-1]
    try:
      instances += build.build_repo(root, name, version, out, config, llm)
    except ValueError as e:  # a suite that does not run cleanly here: no tasks from it, the rest go on
      log.warning("no procedural tasks from %s %s: %s", name, version, e)
    for (v0, r0), (v1, r1) in zip(versions, versions[1:]) if version_diffs else ():
      try:
        inst = build.build_version_diff(r0, r1, name, v0, v1, out, config)
      except ValueError as e:
        log.warning("no version-diff task %s %s -> %s: %s", name, v0, v1, e)
        continue
      if inst is not None:
        instances.append(inst)
  write_task_set(out, instances, max_turns=max_turns)
  return instances


def write_task_set(out: str, instances: list[Instance], task_set_path: str | None = None, max_turns: int = 0) -> None:
  """instances.jsonl, and rl_tasks.jsonl whose records name `task_set_path` (default: `out`) as their set.

  `max_turns` > 0 goes into each record: the environment then grades at that turn (a rollout's own turn
  cap would end the episode ungraded)."""
  write_instances(os.path.join(out, "instances.jsonl"), instances)
  where = task_set_path or out
  with open(os.path.join(out, "rl_tasks.jsonl"), "w") as f:
    for i in instances:
      rec = {"id": i.instance_id, "instruction": i.problem_statement + GUIDE, "instance_id": i.instance_id}
      rec.update(task_set=where, demo=DEMO, **({"max_turns": max_turns} if max_turns > 0 else {}))
      f.write(json.dumps(rec) + "\n")
