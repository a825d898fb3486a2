"""One memory + pids cgroup per sandbox run, where the host lets this process make one.

The run's other limits bound each kind of memory on its own (address space per process, a tmpfs for
scratch, the IPC namespace's SysV limits); a cgroup bounds their sum and what none of them sees
(memfd, kernel memory, pipe buffers): `memory.max` over everything the run's processes hold, `pids.max`
over its tasks. Where it comes from, first that works:
- cgroup v2: a child of `parent` (SandboxConfig.cgroup_parent), else of the nearest ancestor of the
  caller's own cgroup that has memory and pids in its `cgroup.subtree_control` and lets us mkdir
  (root on a systemd host: the caller's slice; a user: a `Delegate=yes` unit's cgroup);
- cgroup v1 (hybrid hosts): children of the caller's own memory and pids cgroups.
The caller writes the launcher's pid into `cgroup.procs` before the launcher starts anything.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import os
import queue
import threading
import time

_COUNTER = itertools.count()


@dataclasses.dataclass
class RunCgroup:
  dirs: list[str]  # v2: one; v1: the memory cgroup, then the pids cgroup when there is one
  version: int

  def add(self, pid: int) -> None:
    for d in self.dirs:
      with open(os.path.join(d, "cgroup.procs"), "w") as f:
        f.write(str(pid))

  def oom_killed(self) -> bool:
    name = "memory.events" if self.version == 2 else "memory.oom_control"
    try:
      with open(os.path.join(self.dirs[0], name)) as f:
        fields = dict(line.split() for line in f if len(line.split()) == 2)
    except OSError:
      return False
    return int(fields.get("oom_kill", "0")) > 0

  def release(self) -> None:
    """Removes the cgroup off the caller's path: the verdict does not wait for the tasks to leave."""
    _REAPER.put(self)
    _start_reaper()

  def remove(self) -> None:
    """Kills what is left (there should be nothing: the PID namespace died) and removes the dirs."""
    if self.version == 2:
      _try_write(os.path.join(self.dirs[0], "cgroup.kill"), "1")
    for d in self.dirs:
      for _ in range(200):  # tasks leave asynchronously after SIGKILL: up to ~1 s
        try:
          os.rmdir(d)
          break
        except FileNotFoundError:
          break
        except OSError:
          time.sleep(0.005)


_REAPER: queue.Queue[RunCgroup | None] = queue.Queue()
_REAPER_LOCK = threading.Lock()
_REAPER_THREAD: list[threading.Thread] = []


def _start_reaper() -> None:
  with _REAPER_LOCK:
    if not _REAPER_THREAD:
      t = threading.Thread(target=_reap, name="k2jax-sandbox-cgroup-reaper", daemon=True)
      t.start()
      _REAPER_THREAD.append(t)
      atexit.register(_drain)


def _reap() -> None:
  while (cg := _REAPER.get()) is not None:
    cg.remove()
    _REAPER.task_done()
  _REAPER.task_done()


def _drain() -> None:
  """At exit: every cgroup handed to the reaper is removed before the process ends."""
  _REAPER.put(None)
  _REAPER.join()


def create(memory_bytes: int, max_tasks: int, parent: str = "") -> tuple[RunCgroup | None, str]:
  """A fresh cgroup with the limits set, or (None, why not)."""
  name = f"k2jax-sandbox-{os.getpid()}-{next(_COUNTER)}"
  errors = []
  for version, parent_dirs in _candidates(parent):
    made: list[str] = []
    try:
      for d in parent_dirs:
        made.append(os.path.join(d, name))
        os.mkdir(made[-1])
      cg = RunCgroup(made, version)
      _limit(cg, memory_bytes, max_tasks)
      return cg, ""
    except OSError as e:
      errors.append(f"v{version} under {parent_dirs[0]}: {e.strerror or e}")
      for d in reversed(made):
        try:
          os.rmdir(d)
        except OSError:
          pass
  return None, "; ".join(errors) or "no cgroup v2 with memory and pids controllers, nor a v1 memory hierarchy"


def _limit(cg: RunCgroup, memory_bytes: int, max_tasks: int) -> None:
  if cg.version == 2:
    d = cg.dirs[0]
    _write(os.path.join(d, "memory.max"), str(memory_bytes))
    _try_write(os.path.join(d, "memory.swap.max"), "0")  # absent without swap accounting
    _write(os.path.join(d, "pids.max"), str(max_tasks))
    return
  mem = cg.dirs[0]
  _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
  _try_write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))  # no swap beyond it
  if len(cg.dirs) > 1:
    _write(os.path.join(cg.dirs[1], "pids.max"), str(max_tasks))


def _candidates(parent: str):
  """(version, parent dirs) to try, in order."""
  own = _own_cgroups()
  mounts = _mounts()
  if parent:
    yield 2, [parent]
    return
  if "" in own and "cgroup2" in mounts:
    d = mounts["cgroup2"] + own[""]
    while True:
      enabled = set(_read(os.path.join(d, "cgroup.subtree_control")).split())
      if {"memory", "pids"} <= enabled and os.access(d, os.W_OK):
        yield 2, [d]
        break
      if os.path.normpath(d) == os.path.normpath(mounts["cgroup2"]):
        break
      d = os.path.dirname(d.rstrip("/"))
  if "memory" in own and "memory" in mounts:
    dirs = [mounts["memory"] + own["memory"]]
    if "pids" in own and "pids" in mounts:
      dirs.append(mounts["pids"] + own["pids"])
    yield 1, dirs


def _own_cgroups() -> dict[str, str]:
  """controller -> this process's cgroup path ("" for the v2 unified hierarchy)."""
  out = {}
  for line in _read("/proc/self/cgroup").splitlines():
    _, controllers, path = line.split(":", 2)
    for c in controllers.split(",") if controllers else [""]:
      out[c] = path
  return out


@functools.cache
def _mounts() -> dict[str, str]:
  """ "cgroup2" -> its mount point; each v1 controller -> the mount point of its hierarchy."""
  out = {}
  for line in _read("/proc/self/mountinfo").splitlines():
    left, _, right = line.partition(" - ")
    parts, rparts = left.split(), right.split()
    if len(parts) < 5 or len(rparts) < 3 or parts[3] != "/":  # a bind of a sub-cgroup is not the hierarchy
      continue
    if rparts[0] == "cgroup2":
      out.setdefault("cgroup2", parts[4])
    elif rparts[0] == "cgroup":
      for opt in rparts[2].split(","):
        if opt not in ("rw", "ro"):
          out.setdefault(opt, parts[4])
  return out


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return ""


def _write(path: str, text: str) -> None:
  with open(path, "w") as f:
    f.write(text)


def _try_write(path: str, text: str) -> None:
  try:
    _write(path, text)
  except OSError:
    pass
