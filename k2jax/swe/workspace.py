"""A bounded pool of prepared workspaces: per-episode copies of task snapshots, made ahead of need.

An episode takes a fresh copy of its instance's snapshot (`acquire`), works in it, and gives it back
(`release`: deleted, never reused). Copies are made ahead on worker threads (rLLM's and Tunix's warm
queues): after an instance is acquired, up to `ready_per_instance` copies of it are kept ready, and at
most `max_ready` ready copies exist over all instances (the least recently used instance's are deleted
first), so memory and disk stay bounded however many tasks a run has. Every copy lives under the pool's
own root dir, named with this process's pid: `close()` deletes it, and a new pool deletes the roots of
pools whose process died without closing (no directory outlives a crash for long).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import shutil
import tempfile
import threading
import time

from k2jax.sandbox.workspace import prepare_workspace
from k2jax.swe import snapshot

_PREFIX = "k2jax-swe-ws-"


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  root_parent: str = ""  # where pool roots are made ("" = the system temp dir)
  ready_per_instance: int = 2  # copies kept ready per recently used snapshot
  max_ready: int = 64  # ready copies over all snapshots
  prepare_workers: int = 2


@dataclasses.dataclass
class Workspace:
  path: str
  snapshot: str
  ready_s: float  # seconds `acquire` waited for it (0-ish when it was prepared ahead)


class WorkspacePool:
  def __init__(self, config: PoolConfig = PoolConfig()):
    if config.ready_per_instance < 0 or config.max_ready < 0 or config.prepare_workers < 1:
      raise ValueError(f"PoolConfig: counts must be >= 0 and prepare_workers >= 1, got {config}")
    self.config = config
    parent = config.root_parent or tempfile.gettempdir()
    reap_dead_pools(parent)
    self.root = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent)
    self._ready: collections.OrderedDict[str, collections.deque[str]] = collections.OrderedDict()
    self._pending: collections.Counter[str] = collections.Counter()
    self._lock = threading.Lock()
    self._live: set[str] = set()
    self._closed = False
    self._workers = concurrent.futures.ThreadPoolExecutor(config.prepare_workers, thread_name_prefix="swe-ws")

  def acquire(self, snapshot_dir: str) -> Workspace:
    """A fresh copy of `snapshot_dir` for one episode (prepared ahead when possible)."""
    t0 = time.monotonic()
    key = os.path.realpath(snapshot_dir)
    if not os.path.isdir(key):
      raise FileNotFoundError(f"workspace pool: snapshot {snapshot_dir!r} is not a directory")
    with self._lock:
      if self._closed:
        raise RuntimeError("workspace pool is closed")
      queue = self._ready.get(key)
      path = queue.popleft() if queue else None
      if key in self._ready:
        self._ready.move_to_end(key)
    if path is None:
      path = self._make(key)
    with self._lock:
      self._live.add(path)
      closed = self._closed
    if closed:  # closed while copying: the copy goes, and the root its copy may have made again
      self.release(Workspace(path, key, 0.0))
      self._drop_root_if_closed()
      raise RuntimeError("workspace pool is closed")
    self._refill(key)
    return Workspace(path, key, time.monotonic() - t0)

  def release(self, ws: Workspace) -> None:
    with self._lock:
      self._live.discard(ws.path)
    shutil.rmtree(ws.path, ignore_errors=True)

  def counts(self) -> dict[str, int]:
    """ready / live copies, copies being prepared, and the dirs under the pool's root (a dir that is none of
    the three is a leak)."""
    with self._lock:
      ready = sum(len(q) for q in self._ready.values())
      preparing = sum(self._pending.values())
      return {"ready": ready, "live": len(self._live), "preparing": preparing, "dirs": len(os.listdir(self.root))}

  def wait_idle(self, timeout_s: float = 60.0) -> bool:
    """Waits until no copy is being prepared (False if some still are after `timeout_s`): counts taken then
    are exact (a copy in progress is a dir that is neither ready nor live)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      with self._lock:
        if not any(self._pending.values()):
          return True
      time.sleep(0.01)
    return False

  def close(self) -> None:
    with self._lock:
      self._closed = True
    self._workers.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(self.root, ignore_errors=True)

  def _make(self, key: str) -> str:
    path = tempfile.mkdtemp(prefix="ws-", dir=self.root)
    os.rmdir(path)
    try:
      snapshot.copy_tree(key, path)
      prepare_workspace(path)
    except BaseException:  # a copy cut short (disk full, a file gone, the pool closed) is deleted
      shutil.rmtree(path, ignore_errors=True)
      self._drop_root_if_closed()
      raise
    return path

  def _drop_root_if_closed(self) -> None:
    """After `close()`: deletes the root again (a copy running past `close()` makes it anew: copytree
    creates its destination's parents)."""
    with self._lock:
      closed = self._closed
    if closed:
      shutil.rmtree(self.root, ignore_errors=True)

  def _refill(self, key: str) -> None:
    with self._lock:
      if self._closed:
        return
      have = len(self._ready.get(key, ())) + self._pending[key]
      want = max(self.config.ready_per_instance - have, 0)
      self._pending[key] += want
    for k in range(want):
      try:
        self._workers.submit(self._prepare_one, key)
      except RuntimeError:  # closed meanwhile: the copies not submitted are not pending
        with self._lock:
          self._pending[key] -= want - k
        return

  def _prepare_one(self, key: str) -> None:
    try:
      path = self._make(key)
    except Exception:  # noqa: BLE001  _make deleted what it copied; acquire makes its own when none is ready
      with self._lock:
        self._pending[key] -= 1
      return
    evicted = []
    with self._lock:
      self._pending[key] -= 1
      if self._closed:
        evicted.append(path)
      else:
        self._ready.setdefault(key, collections.deque()).append(path)
        while sum(len(q) for q in self._ready.values()) > self.config.max_ready:
          old_key, old = next(iter(self._ready.items()))
          evicted.append(old.popleft())
          if not old:
            del self._ready[old_key]
    for p in evicted:
      shutil.rmtree(p, ignore_errors=True)


def reap_dead_pools(parent: str) -> list[str]:
  """Deletes pool roots under `parent` whose owning process is gone; returns them."""
  gone = []
  for name in os.listdir(parent):
    if not name.startswith(_PREFIX):
      continue
    pid = name[len(_PREFIX) :].split("-", 1)[0]
    if pid.isdigit() and not _alive(int(pid)):
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
      gone.append(name)
  return gone


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True
