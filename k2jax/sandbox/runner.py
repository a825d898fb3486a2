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
  bounding set emptied, no_new_privs); as root the launcher first drops to `uid` (default nobody), after
  bind-mounting (in a private mount namespace) every host dir the run's root holds, so an interpreter,
  venv or workspace under a directory that uid cannot enter (a 0700 home) is still mounted, read-only
  where it was, and no permission on the host changes;
- rlimits: CPU seconds, address space, file size (stdout/stderr go to capped files), open files, no
  locked memory;
- memory that is not address space, each bounded where it lives: the only writable path is a private
  tmpfs of `scratch_bytes` (files the program writes never reach the host's disk; POSIX shm is there
  too), SysV shm and message queues by the run's own IPC namespace limits (`shm_bytes`; kernels before
  5.19 refuse them to a user namespace: there `layers` lacks "ipc_limits" and only a cgroup bounds
  SysV shm), no nested user
  namespaces (so no tmpfs of its own), and, where this host lets the caller make a cgroup (v2, or v1
  on hybrid hosts; `cgroup`), `total_memory_bytes` and a task cap over everything the run holds
  together (memfd, kernel memory included). A run killed by a limit says which in `reason`;
- system calls: a seccomp filter built with libseccomp (`syscalls.py`: Docker's default allow list less
  what a grader never needs; new namespaces, mounts, ptrace, bpf, perf, keys, userfaultfd, io_uring, kexec,
  file handles refused with EPERM, clone3 with ENOSYS); each refused call is named in `denied`;
- Landlock, where the kernel has it: a second wall on the file system (read and execute under the new
  root, writes only in the run's dir and writable binds).
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

from k2jax.sandbox import _cgroup, syscalls

_CHILD = pathlib.Path(__file__).with_name("_child.py")
_CONFINE = pathlib.Path(__file__).with_name("_confine.py")
ISOLATED_LAYERS = ("userns", "mountns", "pidns", "netns", "ipcns", "readonly_root", "no_caps", "rlimits")
WALL_FLAGS = ("seccomp", "landlock")  # reported by the sandbox's PID 1 when they were applied
LIMIT_LAYERS = ("scratch_tmpfs", "ipc_limits", "no_nested_userns")


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
  scratch_bytes: int = 64 * 2**20  # the tmpfs that is the run's dir: its files and all it writes
  scratch_inodes: int = 4096
  shm_bytes: int = 64 * 2**20  # SysV shared memory of the run's IPC namespace, all segments together
  # Everything the run holds together (cgroup memory.max): processes, scratch, shm, memfd, kernel memory.
  total_memory_bytes: int = 768 * 2**20
  cgroup: str = "auto"  # "auto": a cgroup per run where this host allows one; "required"; "off"
  cgroup_parent: str = ""  # a cgroup v2 dir to make the runs' cgroups in ("": found from our own)
  # False: the sandbox as it was before these limits (workdir bound from the host's disk, default IPC
  # limits, nested user namespaces allowed, no cgroup); only to measure what the limits cost.
  kernel_limits: bool = True
  # Run with rlimits and a uid only where namespaces are unavailable. Untrusted code can then read the
  # caller's files and signal its processes: only for code you would run yourself.
  unsafe_no_isolation: bool = False
  # Extra bind mounts into the new root, (host path, path inside, read_only): a workspace read-write at a
  # fixed path, a venv's site-packages read-only (k2jax/sandbox/workspace.py). Isolated runs only.
  binds: tuple[tuple[str, str, bool], ...] = ()
  # The system-call filter: "required" (no libseccomp, or a kernel without seccomp user notification,
  # raises SandboxUnavailable) or "off" (the named fallback: runs without it, and `layers` lacks "seccomp").
  seccomp: str = "required"
  # Landlock: "auto" (where the kernel has it; `layers` says "landlock" when it held), "required", "off".
  landlock: str = "auto"


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
  full: tuple[str, ...] = ()  # limits found (nearly) exhausted at the end: "scratch", "shm=BYTES", "cgroup_memory"
  denied: tuple[str, ...] = ()  # system calls the filter refused (EPERM), by name, in the order first made


def run_python(
  files: dict[str, str], entry: str, config: SandboxConfig = SandboxConfig(), stdin: str = ""
) -> SandboxResult:
  """Writes `files` into a fresh temp dir, runs `entry` there isolated and limited, deletes the dir."""
  if entry not in files:
    raise ValueError(f"run_python: entry {entry!r} is not among the files {sorted(files)}")
  for field, allowed in (("cgroup", ("auto", "required", "off")), ("seccomp", ("required", "off"))):
    if getattr(config, field) not in allowed:
      raise ValueError(f"SandboxConfig.{field}: {getattr(config, field)!r} is not one of {allowed}")
  if config.landlock not in ("auto", "required", "off"):
    raise ValueError(f"SandboxConfig.landlock: {config.landlock!r} is not one of ('auto', 'required', 'off')")
  size = sum(len(t.encode()) for t in files.values())
  if config.kernel_limits and size > config.scratch_bytes // 2:
    raise ValueError(f"run_python: the files take {size} bytes, over half of scratch_bytes={config.scratch_bytes}")
  for name in files:
    if os.path.isabs(name) or ".." in pathlib.PurePath(name).parts:
      raise ValueError(f"run_python: file name {name!r} must be relative and stay inside the run's dir")
  why = isolation_error(config)
  if why is not None and not config.unsafe_no_isolation:
    raise SandboxUnavailable(
      f"sandbox: refusing to run untrusted code: this machine cannot isolate it ({why}). Enable unprivileged "
      "user namespaces (sysctl user.max_user_namespaces>0, kernel.unprivileged_userns_clone=1; in a container "
      "a seccomp profile that allows unshare), run the code in the sandbox service (docs/agentic.md), or pass "
      "SandboxConfig(unsafe_no_isolation=True) for code you trust"
    )
  return _execute(files, entry, config, stdin, isolate=why is None)


def isolation_error(config: SandboxConfig = SandboxConfig()) -> str | None:
  """None when runs can be isolated here, else the reason (probed once per uid and interpreter)."""
  uid = config.uid if os.geteuid() == 0 else None
  return _probe(uid, config.python or _python_for(uid), config.seccomp, config.landlock)


@functools.lru_cache(maxsize=None)
def _probe(uid: int | None, python: str, seccomp: str = "required", landlock: str = "auto") -> str | None:
  cfg = SandboxConfig(cpu_time_s=10, wall_time_s=60.0, uid=65534 if uid is None else uid, python=python)
  cfg = dataclasses.replace(cfg, seccomp=seccomp, landlock=landlock)
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
  work = tempfile.mkdtemp(prefix="k2jax-sandbox-")  # root stages it: it may sit where the uid cannot go
  io_dir = tempfile.mkdtemp(prefix="k2jax-sandbox-io-", dir=_io_parent(uid))
  try:
    for name, text in files.items():
      path = pathlib.Path(work, name)
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text)
    pathlib.Path(io_dir, "stdin").write_text(stdin)
    os.mkdir(os.path.join(io_dir, "root"))
    os.mkdir(os.path.join(io_dir, "stage"))  # root's binds of what the sandbox uid cannot reach (_child.stage)
    shutil.copy(_CHILD, os.path.join(io_dir, "launcher.py"))
    shutil.copy(_CONFINE, os.path.join(io_dir, "_confine.py"))
    if uid is not None:
      for d, dirs, names in os.walk(work):
        for p in [d, *(os.path.join(d, n) for n in dirs + names)]:
          os.chown(p, uid, uid)
      # The launcher starts as root: its file and dir stay root's (the sandbox uid cannot swap the code root
      # runs); the uid gets through to its new root's mount point only.
      os.chmod(io_dir, 0o711)
      os.chown(os.path.join(io_dir, "root"), uid, uid)
    return _launch(python, work, io_dir, entry, config, uid, isolate)
  finally:
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(io_dir, ignore_errors=True)


def _io_parent(uid: int | None) -> str | None:
  """Where the launcher's own dir goes: after dropping to `uid` it mounts the new root there, so every
  directory above it must let others through (the caller's TMPDIR may be a 0700 dir of root's)."""
  if uid is None:
    return None
  for cand in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
    path, ok = os.path.realpath(cand), os.path.isdir(cand)
    while ok and path not in ("/", ""):
      ok = bool(os.stat(path).st_mode & 0o001)
      path = os.path.dirname(path)
    if ok:
      return cand
  raise SandboxUnavailable(f"sandbox: no temp dir that uid {uid} can traverse (tried TMPDIR, /tmp, /var/tmp, /dev/shm)")


def _launch(python, work, io_dir, entry, config: SandboxConfig, uid, isolate) -> SandboxResult:
  bpf, names = _filter(config) if isolate else (b"", {})
  report_r, report_w = os.pipe()
  status_r, status_w = os.pipe()
  cgroup = _run_cgroup(config) if isolate and config.kernel_limits else None
  go_r, go_w = os.pipe() if cgroup is not None else (None, None)
  env = {
    "PATH": "/usr/bin:/bin",
    "HOME": work,
    "TMPDIR": work,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "K2JAX_REPORT_FD": str(report_w),
  }
  settings = {
    "parent_pid": os.getpid(),  # the launcher dies with this process (PDEATHSIG), checked after it is set
    "isolate": isolate,
    "workdir": os.path.realpath(work),
    "newroot": os.path.join(io_dir, "root"),
    "argv": [python, "-I", "-S", "-B", os.path.join(os.path.realpath(work), entry)],
    "env": env,
    "report_fd": report_w,
    "status_fd": status_w,
    "go_fd": go_r,
    "cpu_time_s": config.cpu_time_s,
    "memory_bytes": config.memory_bytes,
    "file_size_bytes": config.file_size_bytes,
    "max_processes": config.max_processes,
    "max_open_files": config.max_open_files,
    "kernel_limits": config.kernel_limits,
    "scratch_bytes": config.scratch_bytes,
    "scratch_inodes": config.scratch_inodes,
    "shm_bytes": config.shm_bytes,
    "ipc_sysctls": _ipc_sysctls(config),
    "binds": [[os.path.realpath(src), dst, bool(ro)] for src, dst, ro in config.binds],
    "drop_uid": uid,  # root: the launcher stages the binds while root, then drops to this uid itself
    "stage_dir": os.path.join(io_dir, "stage"),
    "seccomp_bpf": bpf.hex(),  # "": no filter (unisolated, or seccomp='off')
    "syscall_names": {str(nr): name for nr, name in names.items()},
    "landlock": config.landlock,
  }
  report = _Drain(report_r, config.max_output_bytes)
  start = time.monotonic()
  proc = None
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
        pass_fds=tuple(fd for fd in (report_w, status_w, go_r) if fd is not None),
        start_new_session=True,
      )
    if cgroup is not None:
      try:
        cgroup.add(proc.pid)  # before the go byte: nothing has run yet
      except OSError as e:
        cgroup.release()
        cgroup = None
        if config.cgroup == "required":
          raise SandboxUnavailable(f"SandboxConfig(cgroup='required'): cannot move the run into its cgroup: {e}")
      os.write(go_w, b"g")
  except BaseException:
    if proc is not None:
      _kill_group(proc.pid)
      proc.wait()
    if cgroup is not None:
      cgroup.remove()
    raise
  finally:
    for fd in (report_w, status_w, go_r, go_w):
      if fd is not None:
        os.close(fd)
  # A blocking wait with a timer for the deadline: Popen.wait(timeout=) polls with sleeps of up to 50 ms, so
  # it noticed the end ~25 ms late on average (a third of a trivial run's 80 ms; bench/swe_env.py).
  late = threading.Event()
  timer = threading.Timer(config.wall_time_s, lambda: (late.set(), _kill_group(proc.pid)))
  timer.daemon = True
  timer.start()
  try:
    proc.wait()
  finally:
    timer.cancel()
  timed_out = late.is_set()
  _kill_group(proc.pid)  # the launcher's death takes the namespace's PID 1, and with it every process inside
  proc.wait()
  with os.fdopen(status_r) as f:
    status = (f.readline() or "").split(maxsplit=1)
  report.join(timeout=10.0)  # EOF once the last process holding the pipe is gone
  full: tuple[str, ...] = ()
  if cgroup is not None:
    full = ("cgroup_memory",) if cgroup.oom_killed() else ()
    cgroup.release()
  out, err = (_read_capped(os.path.join(io_dir, n), config.max_output_bytes) for n in ("stdout", "stderr"))
  if status and status[0] == "SETUP":
    raise SandboxUnavailable(f"isolation setup failed: {status[1].strip() if len(status) > 1 else '?'}")
  if status and status[0] in ("EXIT", "SIGNAL"):
    number, _, flags = status[1].partition(" ")
    code = int(number) * (-1 if status[0] == "SIGNAL" else 1)
    full += tuple(f for f in flags.strip().split(",") if f not in ("", "-"))
  else:
    code = proc.returncode  # the launcher itself was killed (deadline)
  denied = next((tuple(f[7:].split("+")) for f in full if f.startswith("denied=")), ())
  walls = tuple(w for w in WALL_FLAGS if w in full)
  full = tuple(f for f in full if f not in WALL_FLAGS and not f.startswith("denied="))
  layers = (*ISOLATED_LAYERS, *walls) if isolate else ("rlimits",)
  limits = [x for x in LIMIT_LAYERS if x != "ipc_limits" or "no_ipc_limits" not in full]
  layers = (*layers, *(limits if isolate and config.kernel_limits else ()))
  full = tuple(f for f in full if f != "no_ipc_limits")
  layers = (*layers, *(["cgroup"] if cgroup is not None else []), *(["uid"] if uid is not None else []))
  reason = _reason(code, timed_out, err, config, full)
  elapsed = time.monotonic() - start
  return SandboxResult(code, out, err, reason, timed_out, layers, elapsed, work, report.text(), full, denied)


def _filter(config: SandboxConfig) -> tuple[bytes, dict[int, str]]:
  """The compiled system-call filter and its names, or none when the config turns it off."""
  if config.seccomp == "off":
    return b"", {}
  try:
    return syscalls.filter_program()
  except syscalls.FilterUnavailable as e:
    raise SandboxUnavailable(f"sandbox: refusing to run untrusted code without its system-call filter: {e}") from e


def _ipc_sysctls(config: SandboxConfig) -> dict[str, str | int]:
  """The run's IPC namespace limits: SysV shm within shm_bytes, message queues and semaphores small."""
  page = os.sysconf("SC_PAGE_SIZE")
  return {
    "kernel/shmmax": config.shm_bytes,
    "kernel/shmall": max(config.shm_bytes // page, 1),
    "kernel/shmmni": 16,
    "kernel/msgmni": 16,  # x msgmnb 16 KiB: 256 KiB of queued messages at most
    "kernel/msgmnb": 16384,
    "kernel/sem": "32 1024 32 16",  # semmsl semmns semopm semmni
    "fs/mqueue/queues_max": 4,  # x msg_max 10 x msgsize_max 8 KiB
  }


def _run_cgroup(config: SandboxConfig) -> _cgroup.RunCgroup | None:
  if config.cgroup == "off":
    return None
  cg, why = _cgroup.create(config.total_memory_bytes, config.max_processes + 2, config.cgroup_parent)
  if cg is None and config.cgroup == "required":
    raise SandboxUnavailable(f"SandboxConfig(cgroup='required'): cannot make a cgroup here: {why}")
  return cg


def cgroup_error(config: SandboxConfig = SandboxConfig()) -> str | None:
  """None when runs get a cgroup here, else why not (for logs and tests)."""
  cg, why = _cgroup.create(config.total_memory_bytes, config.max_processes + 2, config.cgroup_parent)
  if cg is not None:
    cg.remove()
  return None if cg is not None else why


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


def _reason(code: int, timed_out: bool, err: str, config: SandboxConfig, full: tuple[str, ...] = ()) -> str:
  if "cgroup_memory" in full:  # the kernel's OOM killer inside the run's cgroup
    return f"memory limit of the whole run (cgroup memory.max={config.total_memory_bytes} bytes)"
  if timed_out:
    return f"wall-clock timeout after {config.wall_time_s}s"
  last = err.strip().splitlines()[-1][:200] if err.strip() else ""
  if code != 0 and "scratch" in full:
    return f"scratch space limit (scratch_bytes={config.scratch_bytes}, {config.scratch_inodes} inodes): {last}"
  shm = [f for f in full if f.startswith("shm=")]
  if code != 0 and shm:
    used = shm[0].split("=")[1]
    return f"shared memory limit (shm_bytes={config.shm_bytes}, SysV, {used} bytes held at exit): {last}"
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
    limit = limit_named(last, config)
    return f"{limit}: {last}" if limit else f"exited with code {code}: {last}"
  return "ok"


def limit_named(error: str, config: SandboxConfig) -> str | None:
  """The rlimit a program's error line (`OSError: [Errno 27] ...`) says it hit, in words, or None."""
  if error.startswith("MemoryError"):
    return f"memory limit ({config.memory_bytes} bytes)"
  if error.split(":", 1)[0] not in ("OSError", "BlockingIOError"):  # not a failed comparison's `got ...`
    return None
  for errno_text, limit in (
    ("[Errno 11]", f"process limit (max_processes={config.max_processes})"),  # EAGAIN from fork/clone
    ("[Errno 27]", f"file size limit ({config.file_size_bytes} bytes)"),  # EFBIG: Python ignores SIGXFSZ
    ("[Errno 24]", f"open files limit (max_open_files={config.max_open_files})"),  # EMFILE
  ):
    if errno_text in error:
      return limit
  return None


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
