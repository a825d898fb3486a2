"""Commands (bash, pytest) in the sandbox over a writable workspace directory mounted at a fixed path.

`run_python` (runner.py) gives a program an empty temp dir; repository work needs more: the repository
read-write at `WORKSPACE_MOUNT` (/testbed, the SWE-bench convention), the test tools (pytest and its
dependencies, a venv's site-packages) read-only on PYTHONPATH, many processes (bash, pytest), a deadline
of the command's own, and output kept as head + tail (a test log's end is what matters). Everything else
is runner.py's isolation: namespaces, no network, read-only root, rlimits; when the command ends or times
out every process it started dies with its PID namespace, so nothing outlives a call.

`prepare_workspace(path)` hands a directory to the sandbox uid (root runs the sandbox as nobody);
`run_command(argv, workspace)` runs an argv (e.g. `["bash", "-c", cmd]`); `run_entry(files, entry,
workspace)` runs a Python entry file of the caller's (a test harness) with the same mounts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping, Sequence

from k2jax.sandbox.runner import SandboxConfig, SandboxResult, run_python

WORKSPACE_MOUNT = "/testbed"
_MARK = "\n[... {n} bytes of output omitted ...]\n"


@dataclasses.dataclass(frozen=True)
class WorkspaceRunConfig:
  timeout_s: float = 60.0  # the command's deadline (the sandbox itself is killed a few seconds later)
  cpu_time_s: int = 120
  memory_bytes: int = 2 * 2**30  # address space per process (pytest + a library under test)
  file_size_bytes: int = 64 * 2**20
  max_processes: int = 64
  max_open_files: int = 256
  head_bytes: int = 6000  # output kept from the start ...
  tail_bytes: int = 6000  # ... and from the end
  max_report_bytes: int = 32 * 2**20  # what run_entry's program may write to $K2JAX_REPORT_FD (test records)
  python_paths: tuple[str, ...] = ()  # read-only dirs mounted at their own path and put on PYTHONPATH
  env: tuple[tuple[str, str], ...] = ()  # extra environment variables of the command
  unsafe_no_isolation: bool = False  # runner.SandboxConfig's escape hatch (trusted code only)
  python: str | None = None  # the interpreter (a SWE repository's own environment); None: the sandbox's default


@dataclasses.dataclass(frozen=True)
class CommandResult:
  returncode: int
  output: str  # stdout and stderr interleaved, head + tail
  timed_out: bool
  elapsed_s: float
  reason: str  # runner.SandboxResult.reason, or the command's own timeout
  report: str = ""  # what the entry wrote to $K2JAX_REPORT_FD (run_entry)


def sandbox_uid() -> int | None:
  """The uid sandboxed commands run as (root launches them as nobody), or None: the caller's own."""
  return SandboxConfig.uid if os.geteuid() == 0 else None


def prepare_workspace(path: str) -> None:
  """Makes `path` writable by the sandbox uid. Its parents need no change: as root the sandbox mounts it
  (and `python_paths`) before dropping to that uid, so a workspace in a 0700 dir still mounts."""
  uid = sandbox_uid()
  if uid is not None:
    for d, dirs, names in os.walk(path):
      for p in [d, *(os.path.join(d, n) for n in dirs + names)]:
        os.lchown(p, uid, uid)


def run_command(
  argv: Sequence[str], workspace: str, config: WorkspaceRunConfig = WorkspaceRunConfig()
) -> CommandResult:
  """Runs `argv` with cwd /testbed (= `workspace`); output head+tail capped; killed at `config.timeout_s`."""
  if not argv:
    raise ValueError("run_command: empty argv")
  spec = {"argv": list(argv), "timeout_s": config.timeout_s, "head": config.head_bytes, "tail": config.tail_bytes}
  r = run_entry({"exec.py": _EXEC.replace("SPEC", json.dumps(json.dumps(spec)))}, "exec.py", workspace, config)
  timed_out = r.timed_out or r.returncode == _TIMEOUT_CODE
  reason = f"timed out after {config.timeout_s}s" if r.returncode == _TIMEOUT_CODE else r.reason
  return CommandResult(r.returncode, r.stdout + r.stderr, timed_out, r.elapsed_s, reason, r.report)


def run_entry(
  files: Mapping[str, str],
  entry: str,
  workspace: str,
  config: WorkspaceRunConfig = WorkspaceRunConfig(),
  stdin: str = "",
) -> SandboxResult:
  """`runner.run_python(files, entry, stdin=stdin)` with the workspace at /testbed and `config.python_paths`
  mounted.

  The entry starts as `python -I -S` (no site, PYTHONPATH ignored); `K2JAX_PYTHONPATH`, `K2JAX_ENV`
  (JSON) and `K2JAX_TESTBED` tell it what to set up for what it runs. `stdin` is for what the entry must
  know but its files and environment must not show (a test harness's nonce)."""
  if not os.path.isdir(workspace):
    raise FileNotFoundError(f"run_entry: workspace {workspace!r} is not a directory")
  paths = tuple(os.path.realpath(p) for p in config.python_paths)
  for p in paths:
    if not os.path.isdir(p):
      raise FileNotFoundError(f"WorkspaceRunConfig.python_paths: {p!r} is not a directory")
  env = {"K2JAX_PYTHONPATH": os.pathsep.join((WORKSPACE_MOUNT, *paths)), "K2JAX_TESTBED": WORKSPACE_MOUNT}
  env["K2JAX_ENV"] = json.dumps(dict(config.env))
  sb = SandboxConfig(
    cpu_time_s=config.cpu_time_s,
    wall_time_s=config.timeout_s + 15.0,
    memory_bytes=config.memory_bytes,
    file_size_bytes=config.file_size_bytes,
    max_processes=config.max_processes,
    max_open_files=config.max_open_files,
    # runner.py caps stdout, stderr and the report alike: the report must fit a whole suite's records
    max_output_bytes=max(config.head_bytes + config.tail_bytes + 4096, config.max_report_bytes),
    unsafe_no_isolation=config.unsafe_no_isolation,
    python=config.python,
    binds=((workspace, WORKSPACE_MOUNT, False), *((p, p, True) for p in paths)),
  )
  header = f"import os\nos.environ.update({env!r})\n"  # runner.py gives the entry a fixed environment
  return run_python({**files, entry: header + files[entry]}, entry, sb, stdin)


def default_python_paths() -> tuple[str, ...]:
  """The site-packages dir that holds pytest (and pluggy, iniconfig, packaging) in this interpreter."""
  import pytest

  return (os.path.dirname(os.path.dirname(os.path.realpath(pytest.__file__))),)


_TIMEOUT_CODE = 124  # what coreutils `timeout` answers, so agents read it the usual way
_EXEC = (
  r'''
import collections, json, os, signal, subprocess, sys, threading
spec = json.loads(SPEC)
env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "TERM": "dumb"}
env.update(HOME=os.environ["HOME"], TMPDIR=os.environ["TMPDIR"], PYTHONPATH=os.environ["K2JAX_PYTHONPATH"])
env.update(json.loads(os.environ["K2JAX_ENV"]))
bin_dir = os.path.join(os.environ["HOME"], ".bin")
os.makedirs(bin_dir, exist_ok=True)
for name in ("python", "python3"):  # the sandbox's interpreter under the names agents type
    link = os.path.join(bin_dir, name)
    if not os.path.lexists(link):
        os.symlink(os.path.realpath(sys.executable), link)
env["PATH"] = bin_dir + ":" + env["PATH"]
os.chdir(os.environ["K2JAX_TESTBED"])
proc = subprocess.Popen(spec["argv"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        env=env, start_new_session=True, close_fds=True)
timed_out = []
def _kill():
    timed_out.append(1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
timer = threading.Timer(spec["timeout_s"], _kill)
timer.start()
head, tail, total = bytearray(), collections.deque(), 0
tail_len = 0
while chunk := proc.stdout.read1(65536):
    total += len(chunk)
    room = spec["head"] - len(head)
    if room > 0:
        head += chunk[:room]
        chunk = chunk[room:]
    if chunk:
        tail.append(chunk)
        tail_len += len(chunk)
        while tail and tail_len - len(tail[0]) >= spec["tail"]:
            tail_len -= len(tail.popleft())
code = proc.wait()
timer.cancel()
t = b"".join(tail)[-spec["tail"]:] if tail else b""
omitted = total - len(head) - len(t)
out = bytes(head) + ('''
  + repr(_MARK)
  + r'''.format(n=omitted).encode() if omitted > 0 else b"") + t
if timed_out:
    out += ("\n[timed out after %ss: every process of the command was killed]\n" % spec["timeout_s"]).encode()
sys.stdout.buffer.write(out)
sys.stdout.flush()
os._exit(124 if timed_out else (code if code >= 0 else 128 - code))
'''
)
