"""The sandbox's system-call filter and Landlock wall, seen from inside a run.

One run calls every refused system call (by number, with harmless arguments) and reports each call's errno;
the filter's own record of what it refused (`SandboxResult.denied`) tells its refusals from the kernel's
(a call without capabilities may fail with EPERM anyway). Ordinary programs still run: threads, subprocesses,
numpy, pytest over a workspace.
"""

import dataclasses
import errno
import json
import os

import pytest

from k2jax.sandbox import _confine, runner, syscalls
from k2jax.sandbox.code import CodeRewardConfig, run_tests
from k2jax.sandbox.runner import SandboxConfig, SandboxUnavailable, run_python
from k2jax.sandbox.workspace import WorkspaceRunConfig, default_python_paths, prepare_workspace, run_command

SB = SandboxConfig(cpu_time_s=5, wall_time_s=30, memory_bytes=256 * 2**20, max_processes=8)
NOT_ISOLATED = runner.isolation_error(SB)
needs_isolation = pytest.mark.skipif(
  NOT_ISOLATED is not None, reason=f"this machine cannot isolate code (or filter its calls): {NOT_ISOLATED}"
)
LANDLOCK_ABI = syscalls.landlock_abi()
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17

# Calls every refused call by number; the clone probe asks for a new user namespace (and exits at once in
# the child, should the call ever succeed).
PROBE = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
numbers = json.loads(sys.argv[1] if len(sys.argv) > 1 else open("numbers.json").read())
out = {}
for name, nr in numbers.items():
  args = (CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0) if name == "clone" else (0, 0, 0, 0, 0)
  ctypes.set_errno(0)
  r = libc.syscall(nr, *args)
  if r == 0 and name == "clone":
    os._exit(0)
  out[name] = ctypes.get_errno() if r == -1 else 0
print(json.dumps(out))
""".replace("CLONE_NEWUSER", str(CLONE_NEWUSER)).replace("SIGCHLD", str(SIGCHLD))


def _numbers(names):
  import pyseccomp as sc

  arch = sc.system_arch()
  return {n: sc.resolve_syscall(arch, n) for n in names}


@pytest.fixture(scope="module")
def probed():
  if NOT_ISOLATED is not None:
    pytest.skip(f"this machine cannot isolate code: {NOT_ISOLATED}")
  names = [n for family in syscalls.REFUSED.values() for n in family] + list(syscalls.ENOSYS_CALLS)
  files = {"main.py": PROBE, "numbers.json": json.dumps(_numbers(names))}
  r = run_python(files, "main.py", SB)
  assert r.returncode == 0, (r.reason, r.stderr[-2000:])
  return json.loads(r.stdout), r


@pytest.mark.parametrize("family", sorted(syscalls.REFUSED))
def test_each_refused_family_gets_eperm_from_the_filter(family, probed):
  errnos, result = probed
  for name in syscalls.REFUSED[family]:
    assert errnos[name] == errno.EPERM, (name, errno.errorcode.get(errnos[name], errnos[name]))
    assert name in result.denied, (name, result.denied)  # the filter refused it, not the missing capability


def test_clone3_gets_enosys_so_runtimes_fall_back_to_clone(probed):
  errnos, result = probed
  assert errnos["clone3"] == errno.ENOSYS and "clone3" not in result.denied
  assert "seccomp" in result.layers


def test_the_allow_list_holds_no_refused_call():
  refused = {n for family in syscalls.REFUSED.values() for n in family}
  assert not refused & set(syscalls.ALLOWED)
  assert {"ptrace", "bpf", "perf_event_open", "keyctl", "add_key", "userfaultfd", "io_uring_setup"} <= refused
  assert {"kexec_load", "open_by_handle_at", "mount", "unshare", "setns"} <= refused
  assert len(refused) <= _confine.MAX_NAMED  # a run calling all of them still gets each named


ORDINARY = r"""
import subprocess, sys, threading
got = []
ts = [threading.Thread(target=lambda i=i: got.append(i * i)) for i in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
child = subprocess.run([sys.executable, "-I", "-S", "-c", "print(6 * 7)"], capture_output=True, text=True)
print(sorted(got), child.stdout.strip(), child.returncode)
"""


@needs_isolation
def test_threads_and_subprocesses_run_under_the_filter():
  r = run_python({"main.py": ORDINARY}, "main.py", SB)
  assert r.returncode == 0 and r.stdout.split("\n")[0] == "[0, 1, 4, 9] 42 0", (r.reason, r.stderr[-2000:])
  assert r.denied == () and "seccomp" in r.layers


@needs_isolation
def test_numpy_and_pytest_over_a_workspace_run_under_the_filter(tmp_path):
  ws = tmp_path / "repo"
  ws.mkdir()
  (ws / "test_calc.py").write_text(
    "import numpy as np\n\ndef test_solve():\n  a = np.array([[3.0, 1.0], [1.0, 2.0]])\n"
    "  x = np.linalg.solve(a, np.array([9.0, 8.0]))\n  assert np.allclose(x, [2.0, 3.0])\n\n"
    "def test_fails():\n  assert np.arange(3).sum() == 4\n"
  )
  prepare_workspace(str(ws))
  cfg = WorkspaceRunConfig(timeout_s=60.0, python_paths=default_python_paths())
  out = run_command(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_calc.py"], str(ws), cfg)
  assert "1 failed, 1 passed" in out.output, out.output[-3000:]


@needs_isolation
def test_a_refused_call_is_named_in_the_verdicts_info():
  code = "import ctypes\nctypes.CDLL(None).ptrace(0, 0, 0, 0)\ndef add(a, b):\n    return a + b\n"
  r = run_tests(code, ["assert add(2, 3) == 5"], CodeRewardConfig(SB))
  assert r.reward == 1.0 and r.info["denied_syscalls"] == ("ptrace",), r
  clean = run_tests("def add(a, b):\n    return a + b\n", ["assert add(2, 3) == 5"], CodeRewardConfig(SB))
  assert clean.info["denied_syscalls"] == ()


@needs_isolation
def test_seccomp_off_is_a_named_fallback_and_shows_what_the_filter_refused():
  """Off by config: no filter, `layers` says so, and PTRACE_TRACEME (refused above) now succeeds."""
  off = dataclasses.replace(SB, seccomp="off")
  r = run_python(
    {
      "main.py": PROBE.replace('sys.argv[1] if len(sys.argv) > 1 else ', ''),
      "numbers.json": json.dumps(_numbers(["ptrace"])),
    },
    "main.py",
    off,
  )
  assert r.returncode == 0 and json.loads(r.stdout) == {"ptrace": 0}, (r.reason, r.stderr[-2000:])
  assert "seccomp" not in r.layers and r.denied == ()


def test_no_libseccomp_refuses_to_run_and_says_what_to_install(monkeypatch):
  def missing():
    raise syscalls.FilterUnavailable("the sandbox's system-call filter needs libseccomp: no libseccomp.so.2")

  monkeypatch.setattr(syscalls, "filter_program", missing)
  monkeypatch.setattr(runner, "isolation_error", lambda config=SB: None)
  with pytest.raises(SandboxUnavailable, match="without its system-call filter: .*libseccomp"):
    run_python({"main.py": "print(1)"}, "main.py", SB)
  with pytest.raises(ValueError, match=r"SandboxConfig.seccomp: 'maybe'"):
    run_python({"main.py": "print(1)"}, "main.py", dataclasses.replace(SB, seccomp="maybe"))
  with pytest.raises(ValueError, match=r"SandboxConfig.landlock: 'on'"):
    run_python({"main.py": "print(1)"}, "main.py", dataclasses.replace(SB, landlock="on"))


WRITE_PROC = "open('/proc/self/comm', 'w').write('renamed')\nprint(open('/proc/self/comm').read().strip())\n"


@needs_isolation
@pytest.mark.skipif(LANDLOCK_ABI < 1, reason="this kernel has no Landlock (CONFIG_SECURITY_LANDLOCK, lsm=landlock)")
def test_landlock_is_a_second_wall_on_files():
  """/proc is mounted writable for the program's own entries; only Landlock refuses the write."""
  r = run_python({"main.py": WRITE_PROC}, "main.py", dataclasses.replace(SB, landlock="required"))
  assert r.returncode != 0 and "PermissionError" in r.stderr and "landlock" in r.layers, r
  off = run_python({"main.py": WRITE_PROC}, "main.py", dataclasses.replace(SB, landlock="off"))
  assert off.returncode == 0 and off.stdout.strip() == "renamed" and "landlock" not in off.layers, off
  # The run's dir stays writable under Landlock, /dev/null too.
  ok = run_python(
    {"main.py": "open('x', 'w').write('1'); open('/dev/null', 'w').write('1'); print('ok')"}, "main.py", SB
  )
  assert ok.stdout.strip() == "ok" and "landlock" in ok.layers, ok
