"""Run untrusted Python in a separate, limited process.

Layers (each recorded in `SandboxResult.layers` when active):
- a separate process in its own session; the whole process group is SIGKILLed at the wall-clock limit;
- as root: the child runs as an unprivileged uid (`uid`, default nobody) so RLIMIT_NPROC binds (root is
  exempt) and system files are not writable; not root: it runs as the calling user;
- rlimits: CPU seconds, address space, file size (stdout/stderr go to files, so they are capped too),
  process count, open files, no core dumps;
- a fresh network namespace (no interfaces up) when the kernel permits it (root, or unprivileged user
  namespaces), else no network isolation beyond the next layer;
- a Python audit hook that ends the process on sockets, process creation, signalling, ctypes, and writes or
  filesystem changes outside its temporary directory. Audit hooks are a guard rail, not a security boundary
  (code can reach around them through interpreter internals); the OS layers above are the boundary.
Not covered: seccomp syscall filtering, cgroup memory/pids accounting, reading world-readable files.
The temporary directory is removed after every run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_CHILD = pathlib.Path(__file__).with_name("_child.py")
VIOLATION_EXIT = 113


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  cpu_time_s: int = 5
  wall_time_s: float = 10.0
  memory_bytes: int = 512 * 2**20
  file_size_bytes: int = 8 * 2**20
  max_processes: int = 1  # RLIMIT_NPROC of the sandbox uid: 1 = no new processes
  max_open_files: int = 64
  uid: int = 65534  # used only when running as root
  network_namespace: bool = True
  audit_hook: bool = True
  max_output_bytes: int = 64 * 1024
  python: str | None = None  # None: first interpreter the sandbox uid can run


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  returncode: int
  stdout: str
  stderr: str
  reason: str  # "ok" or why the run failed
  timed_out: bool
  violation: str | None
  layers: tuple[str, ...]
  elapsed_s: float
  workdir: str  # already deleted; kept for checks and logs


def run_python(
  files: dict[str, str], entry: str, config: SandboxConfig = SandboxConfig(), stdin: str = ""
) -> SandboxResult:
  """Writes `files` into a fresh temp dir, runs `entry` there under the limits, deletes the dir."""
  if entry not in files:
    raise ValueError(f"run_python: entry {entry!r} is not among the files {sorted(files)}")
  uid = config.uid if os.geteuid() == 0 else None
  python = config.python or _python_for(uid)
  work = tempfile.mkdtemp(prefix="k2jax-sandbox-")
  io_dir = tempfile.mkdtemp(prefix="k2jax-sandbox-io-")
  try:
    for name, text in files.items():
      pathlib.Path(work, name).write_text(text)
    pathlib.Path(io_dir, "stdin").write_text(stdin)
    if uid is not None:
      for p in [work, *(os.path.join(work, n) for n in files), io_dir]:
        os.chown(p, uid, uid)
    return _run(python, work, io_dir, entry, config, uid)
  finally:
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(io_dir, ignore_errors=True)


def _run(python: str, work: str, io_dir: str, entry: str, config: SandboxConfig, uid: int | None):
  read_fd, write_fd = os.pipe()
  settings = {
    "workdir": work,
    "entry": entry,
    "report_fd": write_fd,
    "cpu_time_s": config.cpu_time_s,
    "memory_bytes": config.memory_bytes,
    "file_size_bytes": config.file_size_bytes,
    "max_processes": config.max_processes,
    "max_open_files": config.max_open_files,
    "network_namespace": config.network_namespace,
    "audit_hook": config.audit_hook,
  }
  shutil.copy(_CHILD, os.path.join(io_dir, "child.py"))
  env = {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
  ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
  start = time.monotonic()
  with (
    open(os.path.join(io_dir, "stdin")) as fin,
    open(os.path.join(io_dir, "stdout"), "w") as fout,
    open(os.path.join(io_dir, "stderr"), "w") as ferr,
  ):
    proc = subprocess.Popen(
      [python, "-I", "-S", "-B", os.path.join(io_dir, "child.py"), json.dumps(settings)],
      stdin=fin,
      stdout=fout,
      stderr=ferr,
      cwd=work,
      env=env,
      pass_fds=(write_fd,),
      start_new_session=True,
      **ids,
    )
  os.close(write_fd)
  timed_out = False
  try:
    proc.wait(timeout=config.wall_time_s)
  except subprocess.TimeoutExpired:
    timed_out = True
  _kill_group(proc.pid)  # also reaps stragglers that outlived the main process
  proc.wait()
  with os.fdopen(read_fd) as f:
    report = f.read()
  out, err = (_read_capped(os.path.join(io_dir, n), config.max_output_bytes) for n in ("stdout", "stderr"))
  violation = next((l[len("VIOLATION ") :] for l in report.splitlines() if l.startswith("VIOLATION ")), None)
  layers = next((l.split()[1:] for l in report.splitlines() if l.startswith("LAYERS")), [])
  layers = ("process_group", *(["uid"] if uid is not None else []), *layers)
  reason = _reason(proc.returncode, timed_out, violation, err, config)
  return SandboxResult(proc.returncode, out, err, reason, timed_out, violation, layers, time.monotonic() - start, work)


def _reason(code: int, timed_out: bool, violation: str | None, err: str, config: SandboxConfig) -> str:
  if timed_out:
    return f"wall-clock timeout after {config.wall_time_s}s"
  if violation:
    return f"sandbox violation: {violation}"
  if code < 0:
    sig = signal.Signals(-code)
    return {
      signal.SIGXCPU: f"CPU time limit ({config.cpu_time_s}s)",
      signal.SIGXFSZ: f"file size limit ({config.file_size_bytes} bytes)",
      signal.SIGKILL: "killed (CPU hard limit)",
    }.get(sig, f"crashed with {sig.name}")
  if code != 0:
    if "MemoryError" in err:
      return f"memory limit ({config.memory_bytes} bytes)"
    last = err.strip().splitlines()[-1] if err.strip() else ""
    return f"exited with code {code}: {last[:200]}"
  return "ok"


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _read_capped(path: str, limit: int) -> str:
  with open(path, "rb") as f:
    return f.read(limit).decode(errors="replace")


@functools.lru_cache(maxsize=None)
def _python_for(uid: int | None) -> str:
  """The first interpreter `uid` can start (root's pyenv/venv may sit in a directory it cannot enter)."""
  candidates = [
    sys.executable,
    getattr(sys, "_base_executable", ""),
    shutil.which("python3") or "",
    "/usr/bin/python3",
    "/usr/local/bin/python3",
  ]
  ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
  for c in dict.fromkeys(x for x in candidates if x):
    try:
      r = subprocess.run(
        [c, "-I", "-S", "-c", "import ctypes, json, resource, runpy"], cwd="/", capture_output=True, timeout=30, **ids
      )
    except (OSError, subprocess.SubprocessError):
      continue
    if r.returncode == 0:
      return c
  raise RuntimeError(f"sandbox: no Python interpreter runnable as uid {uid} among {candidates}")
