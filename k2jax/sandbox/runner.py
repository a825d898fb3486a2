"""Run untrusted Python in a fresh process that the kernel isolates; refuse when it cannot.

Every run gets its own user, mount, PID, network, IPC and UTS namespaces (`_child.py` builds
them with unshare(2); no privilege needed where unprivileged user namespaces are enabled):
- filesystem: a new root holding only the interpreter and system libraries (read-only), four /dev
  nodes, its own /proc, and the run's temp dir, the only writable path. The caller's files, the tests
  of a reward, other runs' dirs are not in the view at all;
- processes: the program is PID 1 of its namespace and sees and signals nothing outside; RLIMIT_NPROC
  counts per user namespace, so `max_processes` caps the run's own processes; when the run ends or
  times out the kernel kills everything left in the namespace;
- no network (a network namespace with no interface up), no capabilities (mapped to uid 1000 inside,
  bounding set emptied, no_new_privs); as root the launcher first drops to `uid` (default nobody);
- rlimits: CPU seconds, address space, file size (stdout/stderr go to capped files), open files.
Nothing relies on Python-level checks inside the process: the program may rewrite its own interpreter.

Where the kernel refuses (user namespaces disabled, or a container seccomp profile that blocks
unshare), `run_python` raises `SandboxUnavailable` naming the cause, unless
`SandboxConfig(unsafe_no_isolation=True)` accepts running with rlimits and a uid only (trusted code).
A program may write data for its caller to the file descriptor named by `$K2JAX_REPORT_FD`
(`SandboxResult.report`); it is the program's output like stdout, never a verdict on it.
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
import threading
import time

_CHILD = pathlib.Path(__file__).with_name("_child.py")
ISOLATED_LAYERS = ("userns", "mountns", "pidns", "netns", "ipcns", "readonly_root", "no_caps", "rlimits")


class SandboxUnavailable(RuntimeError):
  """This machine cannot isolate untrusted code as configured; the message says why and what to change."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  cpu_time_s: int = 5
  wall_time_s: float = 10.0
  memory_bytes: int = 512 * 2**20
  file_size_bytes: int = 8 * 2**20
  max_processes: int = 1  # processes the program may have at once: 1 = it cannot fork
  max_open_files: int = 64
  uid: int = 65534  # the launcher's uid when the caller is root
  max_output_bytes: int = 64 * 1024  # per stream: stdout, stderr, report
  python: str | None = None  # None: first interpreter the sandbox uid can run
  # Run with rlimits and a uid only where namespaces are unavailable. Untrusted code can then read the
  # caller's files and signal its processes: only for code you would run yourself.
  unsafe_no_isolation: bool = False
  # Extra bind mounts into the new root, (host path, path inside, read_only): a workspace read-write at a
  # fixed path, a venv's site-packages read-only (k2jax/sandbox/workspace.py). Isolated runs only.
  binds: tuple[tuple[str, str, bool], ...] = ()


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  returncode: int
  stdout: str
  stderr: str
  reason: str  # "ok" or why the run failed
  timed_out: bool
  layers: tuple[str, ...]
  elapsed_s: float
  workdir: str  # already deleted; kept for checks and logs
  report: str = ""  # what the program wrote to $K2JAX_REPORT_FD (capped)


def run_python(
  files: dict[str, str], entry: str, config: SandboxConfig = SandboxConfig(), stdin: str = ""
) -> SandboxResult:
  """Writes `files` into a fresh temp dir, runs `entry` there isolated and limited, deletes the dir."""
  if entry not in files:
    raise ValueError(f"run_python: entry {entry!r} is not among the files {sorted(files)}")
  for name in files:
    if os.path.isabs(name) or ".." in pathlib.PurePath(name).parts:
      raise ValueError(f"run_python: file name {name!r} must be relative and stay inside the run's dir")
  why = isolation_error(config)
  if why is not None and not config.unsafe_no_isolation:
    raise SandboxUnavailable(
      f"sandbox: refusing to run untrusted code: this machine cannot isolate it ({why}). Enable unprivileged "
      "user namespaces (sysctl user.max_user_namespaces>0, kernel.unprivileged_userns_clone=1; in a container "
      "a seccomp profile that allows unshare), run the code in the sandbox service (BUILD.md), or pass "
      "SandboxConfig(unsafe_no_isolation=True) for code you trust"
    )
  return _execute(files, entry, config, stdin, isolate=why is None)


def isolation_error(config: SandboxConfig = SandboxConfig()) -> str | None:
  """None when runs can be isolated here, else the reason (probed once per uid and interpreter)."""
  uid = config.uid if os.geteuid() == 0 else None
  return _probe(uid, config.python or _python_for(uid))


@functools.lru_cache(maxsize=None)
def _probe(uid: int | None, python: str) -> str | None:
  cfg = SandboxConfig(cpu_time_s=10, wall_time_s=60.0, uid=65534 if uid is None else uid, python=python)
  try:
    r = _execute({"main.py": "print('isolated')"}, "main.py", cfg, "", isolate=True)
  except SandboxUnavailable as e:
    return str(e)
  if r.stdout.strip() != "isolated":
    return f"a trivial isolated run failed: {r.reason} {r.stderr[-300:]}".strip()
  return None


def _execute(files: dict[str, str], entry: str, config: SandboxConfig, stdin: str, isolate: bool) -> SandboxResult:
  uid = config.uid if os.geteuid() == 0 else None
  python = config.python or _python_for(uid)
  work = tempfile.mkdtemp(prefix="k2jax-sandbox-")
  io_dir = tempfile.mkdtemp(prefix="k2jax-sandbox-io-")
  try:
    for name, text in files.items():
      path = pathlib.Path(work, name)
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text)
    pathlib.Path(io_dir, "stdin").write_text(stdin)
    os.mkdir(os.path.join(io_dir, "root"))
    shutil.copy(_CHILD, os.path.join(io_dir, "launcher.py"))
    if uid is not None:
      for d, dirs, names in os.walk(work):
        for p in [d, *(os.path.join(d, n) for n in dirs + names)]:
          os.chown(p, uid, uid)
      for p in (io_dir, os.path.join(io_dir, "root"), os.path.join(io_dir, "launcher.py")):
        os.chown(p, uid, uid)
    return _launch(python, work, io_dir, entry, config, uid, isolate)
  finally:
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(io_dir, ignore_errors=True)


def _launch(python, work, io_dir, entry, config: SandboxConfig, uid, isolate) -> SandboxResult:
  report_r, report_w = os.pipe()
  status_r, status_w = os.pipe()
  env = {
    "PATH": "/usr/bin:/bin",
    "HOME": work,
    "TMPDIR": work,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "K2JAX_REPORT_FD": str(report_w),
  }
  settings = {
    "isolate": isolate,
    "workdir": os.path.realpath(work),
    "newroot": os.path.join(io_dir, "root"),
    "argv": [python, "-I", "-S", "-B", os.path.join(os.path.realpath(work), entry)],
    "env": env,
    "report_fd": report_w,
    "status_fd": status_w,
    "cpu_time_s": config.cpu_time_s,
    "memory_bytes": config.memory_bytes,
    "file_size_bytes": config.file_size_bytes,
    "max_processes": config.max_processes,
    "max_open_files": config.max_open_files,
    "binds": [[os.path.realpath(src), dst, bool(ro)] for src, dst, ro in config.binds],
  }
  ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
  report = _Drain(report_r, config.max_output_bytes)
  start = time.monotonic()
  try:
    with (
      open(os.path.join(io_dir, "stdin")) as fin,
      open(os.path.join(io_dir, "stdout"), "w") as fout,
      open(os.path.join(io_dir, "stderr"), "w") as ferr,
    ):
      proc = subprocess.Popen(
        [python, "-I", "-S", "-B", os.path.join(io_dir, "launcher.py"), json.dumps(settings)],
        stdin=fin,
        stdout=fout,
        stderr=ferr,
        cwd=work,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        pass_fds=(report_w, status_w),
        start_new_session=True,
        **ids,
      )
  finally:
    os.close(report_w)
    os.close(status_w)
  timed_out = False
  try:
    proc.wait(timeout=config.wall_time_s)
  except subprocess.TimeoutExpired:
    timed_out = True
  _kill_group(proc.pid)  # the launcher's death takes the namespace's PID 1, and with it every process inside
  proc.wait()
  with os.fdopen(status_r) as f:
    status = (f.readline() or "").split(maxsplit=1)
  report.join(timeout=10.0)  # EOF once the last process holding the pipe is gone
  out, err = (_read_capped(os.path.join(io_dir, n), config.max_output_bytes) for n in ("stdout", "stderr"))
  if status and status[0] == "SETUP":
    raise SandboxUnavailable(f"isolation setup failed: {status[1].strip() if len(status) > 1 else '?'}")
  if status and status[0] in ("EXIT", "SIGNAL"):
    code = int(status[1]) * (-1 if status[0] == "SIGNAL" else 1)
  else:
    code = proc.returncode  # the launcher itself was killed (deadline)
  layers = ISOLATED_LAYERS if isolate else ("rlimits",)
  layers = (*layers, *(["uid"] if uid is not None else []))
  reason = _reason(code, timed_out, err, config)
  elapsed = time.monotonic() - start
  return SandboxResult(code, out, err, reason, timed_out, layers, elapsed, work, report.text())


class _Drain(threading.Thread):
  """Reads a pipe to EOF, keeping the first `limit` bytes (a full pipe would block the writer)."""

  def __init__(self, fd: int, limit: int):
    super().__init__(daemon=True)
    self.fd, self.limit, self.buf = fd, limit, bytearray()
    self.start()

  def run(self):
    with os.fdopen(self.fd, "rb", buffering=0) as f:
      while chunk := f.read(65536):
        if len(self.buf) < self.limit:
          self.buf += chunk[: self.limit - len(self.buf)]

  def text(self) -> str:
    return bytes(self.buf).decode(errors="replace")


def _reason(code: int, timed_out: bool, err: str, config: SandboxConfig) -> str:
  if timed_out:
    return f"wall-clock timeout after {config.wall_time_s}s"
  if code < 0:
    sig = signal.Signals(-code)
    return {
      signal.SIGXCPU: f"CPU time limit ({config.cpu_time_s}s)",
      signal.SIGXFSZ: f"file size limit ({config.file_size_bytes} bytes)",
      signal.SIGKILL: "killed (CPU hard limit or its own signal)",
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
        [c, "-I", "-S", "-c", "import ctypes, json, resource"], cwd="/", capture_output=True, timeout=30, **ids
      )
    except (OSError, subprocess.SubprocessError):
      continue
    if r.returncode == 0:
      return c
  raise RuntimeError(f"sandbox: no Python interpreter runnable as uid {uid} among {candidates}")
