"""Sandboxed code reward: kernel isolation holds against every probe, as root and as an unprivileged user.

Tests that need namespaces skip, naming the reason, where the kernel refuses them; the refusal path
(`SandboxUnavailable` unless `unsafe_no_isolation`) is tested everywhere.
"""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from k2jax.grading.base import Completion, Prompt
from k2jax.grading.code import code_reward
from k2jax.sandbox import runner as sandbox
from k2jax.sandbox.code import CodeRewardConfig, run_tests, split_test
from k2jax.sandbox.runner import SandboxConfig, SandboxUnavailable, run_python
from tests import procs
from tests.rl import sandbox_probes

# Generous wall limits: the CI machine is shared, so CPU seconds accrue slower than wall seconds.
# 5 s of CPU: a slow CI VM spends most of a second on interpreter start and page faults, and a memory
# hog must meet its memory limit first. The CPU-limit case sets its own 1 s.
SB = SandboxConfig(cpu_time_s=5, wall_time_s=30, memory_bytes=128 * 2**20, file_size_bytes=2**20)
CFG = CodeRewardConfig(SB)
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
NOT_ISOLATED = sandbox.isolation_error(SB)
needs_isolation = pytest.mark.skipif(
  NOT_ISOLATED is not None, reason=f"this machine cannot create the sandbox's namespaces: {NOT_ISOLATED}"
)
ROOT = os.geteuid() == 0
SANDBOX_UID = SB.uid if ROOT else None


@pytest.fixture
def open_dir():
  """A dir the sandbox uid could reach if the isolation let it (pytest's tmp dirs are root-only)."""
  with tempfile.TemporaryDirectory(prefix="k2jax-probes-") as d:
    os.chmod(d, 0o755)
    yield pathlib.Path(d)


def _reward(code, cfg=CFG):
  return run_tests("def add(a, b):\n    return a + b\n" + code, TESTS, cfg)


@needs_isolation
def test_correct_code_gets_one_and_temp_dir_is_removed():
  p = Prompt("c", "code", (1,), data={"tests": TESTS})
  r = code_reward(p, Completion((), "Here:\n```python\ndef add(a, b):\n    return a + b\n```", "stop", False), CFG)
  assert r.reward == 1.0 and r.reason == "2/2 tests passed"
  res = run_python({"main.py": "import os; print(os.getcwd(), sorted(os.listdir('/')))"}, "main.py", SB)
  cwd, listing = res.stdout.split(" ", 1)
  assert res.reason == "ok" and cwd == os.path.realpath(res.workdir)
  assert "root" not in listing and "home" not in listing and "work" not in listing  # the caller's dirs: absent
  assert not os.path.exists(res.workdir)


@needs_isolation
def test_wrong_code_gets_pass_rate():
  r = run_tests("def add(a, b):\n    return a * b + 0 if a == 2 else a + b\n", TESTS, CFG)
  assert r.reward == 0.5 and "1/2 tests passed" in r.reason and "got 6" in r.reason


@needs_isolation
@pytest.mark.parametrize(
  "code,reason",
  [
    ("while True: pass", "CPU time limit"),
    ("import time\ntime.sleep(60)", "wall-clock timeout"),
    (
      "import os\nwhile True: os.fork()",
      "process limit (max_processes=1) hit; 0/2 tests passed; test 0: BlockingIOError",
    ),
    ("x = []\nwhile True: x.append(bytearray(10**7))", "memory limit"),
    ("import socket\nsocket.socket().connect(('127.0.0.1', 9))", "Network is unreachable"),
    ("open('/tmp/k2jax_sandbox_escape.txt', 'w').write('x')", "Read-only file system"),
    (
      "open('big.bin', 'w').write('x' * (4 * 2**20))",
      "file size limit (1048576 bytes) hit; 0/2 tests passed; test 0: OSError: [Errno 27]",
    ),
    ("fs = [open('/dev/null') for _ in range(100)]", "open files limit (max_open_files=64) hit"),
    ("import os\nos.abort()", "crashed with SIGABRT"),
    ("raise SystemExit(3)", "SystemExit: 3"),
  ],
)
def test_misbehaviour_gets_zero_with_reason(code, reason):
  cfg = CFG
  if "sleep" in code:
    cfg = CodeRewardConfig(dataclasses.replace(SB, wall_time_s=2.0))
  elif reason == "CPU time limit":
    cfg = CodeRewardConfig(dataclasses.replace(SB, cpu_time_s=1))
  r = _reward("\n" + code + "\n", cfg)
  assert r.reward == 0.0 and reason in r.reason, r
  assert not os.path.exists("/tmp/k2jax_sandbox_escape.txt")


@needs_isolation
@pytest.mark.parametrize("probe", sorted(sandbox_probes.PROBES))
def test_probe_gets_zero_and_touches_nothing_outside(probe, open_dir):
  """Frame-walking guard removal, dir_fd writes, killing the parent, reading the tests file, forged result
  lines, always-equal objects; the canary, tests file and sleeper belong to the sandbox's own uid."""
  out = sandbox_probes.run_probe(probe, run_tests, CFG, str(open_dir), uid=SANDBOX_UID)
  _assert_held(out)


@needs_isolation
def test_probes_as_an_unprivileged_caller(open_dir):
  """The documented deployment: the caller is not root, so the sandbox runs as the caller's own uid."""
  if not ROOT:
    pytest.skip("already unprivileged: test_probe_gets_zero_and_touches_nothing_outside ran as this user")
  tmp_path = open_dir
  python = sandbox._python_for(SB.uid)
  pkg = tmp_path / "pkg"
  src_dir = pathlib.Path(sandbox.__file__).parent
  for src in sorted(src_dir.glob("*.py")):
    if src.name != "__init__.py":  # the package's __init__ pulls nothing the probes need
      dst = pkg / "k2jax" / "sandbox" / src.name
      dst.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(src, dst)
  # The package's modules outside k2jax.sandbox that it imports (k2jax.pyparse), as the probes load them.
  outside = {m for src in src_dir.glob("*.py") for m in re.findall(r"^from k2jax import (\w+)", src.read_text(), re.M)}
  for name in sorted(outside):
    shutil.copy(src_dir.parent / f"{name}.py", pkg / "k2jax" / f"{name}.py")
  shutil.copy(sandbox_probes.__file__, pkg / "sandbox_probes.py")
  import pyseccomp  # the system-call filter's libseccomp binding: one module, as a venv would hold it

  shutil.copy(pyseccomp.__file__, pkg / "pyseccomp.py")
  for d, _, names in os.walk(tmp_path):
    os.chmod(d, 0o755)
    for n in names:
      os.chmod(os.path.join(d, n), 0o644)
  p = subprocess.run(
    [python, "-I", str(pkg / "sandbox_probes.py"), str(pkg)],
    user=SB.uid,
    group=SB.uid,
    extra_groups=[],
    cwd=str(pkg),
    env={"PATH": "/usr/bin:/bin", "TMPDIR": "/tmp"},
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  results = json.loads(p.stdout.strip().splitlines()[-1])
  assert results.pop("uid") == SB.uid
  assert sorted(results) == sorted(sandbox_probes.PROBES)
  for out in results.values():
    _assert_held(out)


def _assert_held(out):
  assert out["reward"] == 0.0, out
  assert out["canary"] == "weights" and out["dir"] == ["checkpoint.bin", "hidden_tests.json"], out
  assert out["sleeper_alive"] and not out["secret_leaked"], out
  assert "pidns" in out["layers"] and "mountns" in out["layers"], out


def test_refuses_without_isolation_unless_told_unsafe(monkeypatch, open_dir):
  """Runs on every machine: without namespaces nothing untrusted runs unless the caller opts out."""
  why = "unshare(user, mount, pid, net, ipc, uts, cgroup namespaces): Operation not permitted (errno 1)"
  monkeypatch.setattr(sandbox, "isolation_error", lambda config=SB: why)
  with pytest.raises(SandboxUnavailable, match="refusing to run untrusted code") as e:
    run_python({"main.py": "print(1)"}, "main.py", SB)
  assert why in str(e.value) and "unsafe_no_isolation=True" in str(e.value)
  with pytest.raises(SandboxUnavailable, match="Operation not permitted"):
    run_tests("def add(a, b): return a + b", TESTS, CFG)
  # Opting out runs with rlimits (and a uid when root) only, and says so.
  unsafe = dataclasses.replace(SB, unsafe_no_isolation=True)
  r = run_tests("def add(a, b): return a + b", TESTS, CodeRewardConfig(unsafe))
  assert r.reward == 1.0 and r.info["layers"] == (("rlimits", "uid") if ROOT else ("rlimits",))
  # The probes are real: unisolated, the hidden tests file is read and the caller's file overwritten.
  out = sandbox_probes.run_probe("read_tests_file", run_tests, CodeRewardConfig(unsafe), str(open_dir), SANDBOX_UID)
  assert out["reward"] == 1.0, out
  (open_dir / "b").mkdir()
  probe = "frame_walk_guard_removal"
  out = sandbox_probes.run_probe(probe, run_tests, CodeRewardConfig(unsafe), str(open_dir / "b"), SANDBOX_UID)
  assert out["canary"] == "pwned", out


def test_verdict_parts_never_enter_the_sandbox():
  s = split_test("r = solve([3, 1], k=2)\nassert sorted(r) == [1, 987654321] and len(r) - 1 == 1, 'msg'")
  assert s.steps == (("exec", "r = solve([3, 1], k=2)"), ("eval", "r"), ("eval", "r"))
  assert "987654321" not in json.dumps(s.steps) and s.n_values == 2
  # Operators on the program's values are applied here, size-checked first (test_code_grader.py).
  s = split_test("assert [0] * n() == [0, 0] and math.isclose(f(x=1), 0.5, rel_tol=1e-3)")
  assert [src for kind, src in s.steps] == ["n()", "f(x=1)"]
  s = split_test("expected = (987654321, [1])\nn = len(expected)\nassert add(2, 3) == expected and n == 2")
  assert s.steps == (("eval", "add(2, 3)"),) and "987654321" not in json.dumps(s.steps)
  s = split_test("x = [5]\nx.append(f())\nassert x == [5, 3]")  # mutated by a sandbox statement: moves there
  assert s.steps == (("exec", "x = [5]"), ("exec", "x.append(f())"), ("eval", "x"))
  with pytest.raises(ValueError, match="(?s)test 3: an assert inside .* would be judged inside the sandbox"):
    split_test("def check(candidate):\n    assert candidate(1) == 2\ncheck(add)", "test 3")
  with pytest.raises(ValueError, match="not valid Python"):
    split_test("assert add(1,", "t")


@needs_isolation
def test_values_cross_as_plain_data_only():
  code = "def pair(): return (1, [2.5, 'x'], {'k': {3}}, b'z', None, True)\ndef big(): return 10**5000\n"
  tests = [
    "assert pair() == (1, [2.5, 'x'], {'k': {3}}, b'z', None, True)",
    "assert pair()[0] == 1 and len(pair()) == 6",
    "assert big() > 0",
    "want = (1, [2.5, 'x'], {'k': {3}}, b'z', None, True)\nassert pair() == want",
  ]
  r = run_tests(code, tests, CFG)
  assert [ok for ok, _ in r.info["outcomes"]] == [True, True, False, True], r
  assert "unencodable" in r.info["outcomes"][2][1] or "ValueError" in r.info["outcomes"][2][1]


@needs_isolation
def test_process_cap_and_a_full_report_pipe():
  forks = "import os\npids = []\nfor _ in range(5):\n    try:\n        pids.append(os.fork())\n"
  forks += "    except OSError:\n        break\n    if pids[-1] == 0:\n        os._exit(0)\nprint(len(pids))\n"
  r = run_python({"main.py": forks}, "main.py", dataclasses.replace(SB, max_processes=3))
  assert r.reason == "ok" and r.stdout.strip() == "2", r  # the program itself plus two
  flood = "import os\nos.write(int(os.environ['K2JAX_REPORT_FD']), b'x' * (4 << 20))\nprint('done')"
  r = run_python({"main.py": flood}, "main.py", SB)  # 4 MiB through a 64 KiB pipe: drained, capped, no hang
  assert r.reason == "ok" and r.stdout.strip() == "done" and len(r.report) == SB.max_output_bytes


@needs_isolation
def test_no_network_to_the_callers_loopback():
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(1)
  listener.settimeout(0.5)
  port = listener.getsockname()[1]
  r = _reward(f"\nimport socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
  assert r.reward == 0.0 and "unreachable" in r.reason, r
  with pytest.raises(socket.timeout):
    listener.accept()  # nothing got through
  listener.close()
  # Bounded even when the program swallows the errors: the wall clock ends it, the namespace is killed.
  cfg = CodeRewardConfig(dataclasses.replace(SB, wall_time_s=5.0))
  r = _reward("\nimport os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n", cfg)
  assert r.reward == 0.0 and ("wall-clock" in r.reason or "CPU" in r.reason), r


@needs_isolation
def test_parent_is_unaffected():
  threads = [threading.Thread(target=_reward, args=("\nimport os\nwhile True: os.fork()\n",)) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert subprocess.run(["true"]).returncode == 0  # the parent can still create processes
  big = bytearray(256 * 2**20)  # and allocate beyond the child's memory limit
  assert len(big) == 256 * 2**20
  assert _reward("").reward == 1.0


# Memory and disk that are not address space, each bounded, each named when hit.
LIMITS = dataclasses.replace(
  SB,
  memory_bytes=256 * 2**20,
  file_size_bytes=8 * 2**20,
  scratch_bytes=16 * 2**20,
  shm_bytes=16 * 2**20,
  total_memory_bytes=128 * 2**20,
)
SYSV_SHM = "import ctypes\nlibc = ctypes.CDLL(None)\nids = [libc.shmget(0, 12 << 20, 0o1600) for _ in range(3)]\n"
SYSV_SHM += "print(ids)\nraise SystemExit(1 if -1 in ids else 0)\n"
POSIX_SHM = "import _posixshmem, mmap, os\nms = []\nfor n in ('/a', '/b', '/c'):\n"
POSIX_SHM += "    fd = _posixshmem.shm_open(n, os.O_CREAT | os.O_RDWR, 0o600)\n    os.ftruncate(fd, 7 << 20)\n"
POSIX_SHM += "    ms.append(mmap.mmap(fd, 7 << 20))\n    ms[-1][:] = b'x' * (7 << 20)\n"


@needs_isolation
def test_dev_null_zero_urandom_open_inside():
  code = "with open('/dev/null', 'r+b') as f:\n    f.write(b'x')\n    assert f.read() == b''\n"
  code += "with open('/dev/zero', 'rb') as f:\n    assert f.read(3) == bytes(3)\n"
  code += "with open('/dev/urandom', 'rb') as f:\n    print(len(f.read(16)))\n"
  code += "import subprocess, os\nprint(os.path.realpath('/dev/shm') == os.getcwd())\n"
  for cfg in (LIMITS, dataclasses.replace(LIMITS, kernel_limits=False)):
    r = run_python({"main.py": code}, "main.py", cfg)
    assert r.reason == "ok" and r.stdout.split()[0] == "16", r


@needs_isolation
@pytest.mark.parametrize(
  "name,code,reason",
  [
    ("disk", "for i in range(64):\n    open(f'f{i}', 'wb').write(bytes(1 << 20))\n", "scratch space limit"),
    ("inodes", "for i in range(100000):\n    open(f'f{i}', 'w').close()\n", "scratch space limit"),
    ("sysv_shm", SYSV_SHM, "shared memory limit (shm_bytes=16777216, SysV"),
    ("posix_shm", POSIX_SHM, "scratch space limit (scratch_bytes=16777216"),
  ],
)
def test_memory_that_is_not_address_space_is_bounded(name, code, reason):
  r = run_python({"main.py": code}, "main.py", LIMITS)
  assert reason in r.reason and r.returncode != 0, r
  assert {"scratch_tmpfs", "ipc_limits", "no_nested_userns"} <= set(r.layers), r.layers


@needs_isolation
def test_scratch_is_a_private_tmpfs_and_no_nested_namespaces():
  code = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
  code += (
    "print([l.split(' - ')[1].split()[0] for l in open('/proc/self/mountinfo') if ' ' + os.getcwd() + ' ' in l])\n"
  )
  code += "print(libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER
  code += "os.mkdir('m')\nprint(libc.mount(b'tmpfs', b'm', b'tmpfs', 0, b'size=1g'), ctypes.get_errno())\n"
  r = run_python({"main.py": code}, "main.py", LIMITS)
  mounts, userns, mount = r.stdout.splitlines()
  assert r.reason == "ok" and mounts == "['tmpfs']", r  # the program's writes never reach the host's disk
  assert userns == "-1 1" and mount == "-1 1" and r.denied == ("unshare", "mount"), r  # the system-call filter
  # Under the filter, the layers it covers still hold on their own.
  r = run_python({"main.py": code}, "main.py", dataclasses.replace(LIMITS, seccomp="off"))
  mounts, userns, mount = r.stdout.splitlines()
  assert userns == "-1 28" and mount == "-1 1" and r.denied == (), r  # ENOSPC: max_user_namespaces is 0; EPERM: no caps


CGROUP_ERROR = sandbox.cgroup_error(LIMITS) if NOT_ISOLATED is None else NOT_ISOLATED


@pytest.mark.skipif(CGROUP_ERROR is not None, reason=f"this host gives the caller no cgroup: {CGROUP_ERROR}")
def test_cgroup_bounds_what_no_rlimit_sees():
  """memfd: 15 x 8 MiB stays under every rlimit (open files x file size) but not the run's memory.max."""
  code = "import os\nfds = []\nfor _ in range(15):\n    fd = os.memfd_create('x')\n"
  code += "    os.write(fd, bytes((8 << 20) - 1))\n    fds.append(fd)\nprint('held', len(fds))\n"
  r = run_python({"main.py": code}, "main.py", LIMITS)
  assert "cgroup" in r.layers and r.reason == "memory limit of the whole run (cgroup memory.max=134217728 bytes)", r
  r = run_python({"main.py": code}, "main.py", dataclasses.replace(LIMITS, total_memory_bytes=512 * 2**20))
  assert r.reason == "ok" and r.stdout.strip() == "held 15", r


def test_cgroup_required_refuses_and_v2_is_found_from_our_own(monkeypatch, tmp_path):
  """Runs everywhere: a fake cgroup2 tree stands in for the kernel's files."""
  from k2jax.sandbox import _cgroup

  root = tmp_path / "cg"
  (root / "slice" / "me").mkdir(parents=True)
  (root / "slice" / "cgroup.subtree_control").write_text("cpu memory pids\n")
  (root / "slice" / "me" / "cgroup.subtree_control").write_text("")
  monkeypatch.setattr(_cgroup, "_own_cgroups", lambda: {"": "/slice/me"})
  monkeypatch.setattr(_cgroup, "_mounts", lambda: {"cgroup2": str(root)})
  cg, why = _cgroup.create(96 * 2**20, 3)
  assert cg is not None and cg.version == 2 and os.path.dirname(cg.dirs[0]) == str(root / "slice"), why
  assert (pathlib.Path(cg.dirs[0]) / "memory.max").read_text() == str(96 * 2**20)
  assert (pathlib.Path(cg.dirs[0]) / "pids.max").read_text() == "3"
  for f in pathlib.Path(cg.dirs[0]).iterdir():
    f.unlink()  # a real cgroup's files vanish with it
  monkeypatch.setattr(_cgroup, "_try_write", lambda path, text: None)  # cgroup.kill: a kernel file
  cg.remove()
  assert not os.path.exists(cg.dirs[0])
  monkeypatch.setattr(_cgroup, "create", lambda *a: (None, "no memory controller"))
  with pytest.raises(SandboxUnavailable, match="cgroup='required'.*no memory controller"):
    sandbox._run_cgroup(dataclasses.replace(SB, cgroup="required"))
  assert sandbox._run_cgroup(SB) is None  # auto: run without one, and `layers` says so


@needs_isolation
def test_a_kernel_refusing_ipc_limits_still_runs_and_says_so(monkeypatch):
  """Before Linux 5.19 only the host's root may set IPC sysctls; kernel/hostname (UTS, still the host's
  at that point) is refused the same way here."""
  monkeypatch.setattr(sandbox, "_ipc_sysctls", lambda config: {"kernel/hostname": "x"})
  r = run_python({"main.py": "print('ran')"}, "main.py", LIMITS)
  assert r.reason == "ok" and r.stdout.strip() == "ran", r
  assert "ipc_limits" not in r.layers and "scratch_tmpfs" in r.layers and r.full == (), r


@needs_isolation
def test_a_caller_killed_mid_run_leaves_no_sandbox_process_behind():
  """An env worker SIGKILLed by its pool while a run sleeps: the launcher dies with its caller (PDEATHSIG),
  PID 1 with the launcher, and the program with its namespace; nothing waits out the 60 s on its own."""
  script = (
    "import sys; sys.path.insert(0, sys.argv[1])\n"
    "from k2jax.sandbox.runner import SandboxConfig, run_python\n"
    "run_python({'main.py': 'import time; time.sleep(60)'}, 'main.py', SandboxConfig(cpu_time_s=5, wall_time_s=120))\n"
  )
  caller = subprocess.Popen([sys.executable, "-c", script, str(pathlib.Path(__file__).parents[2])])
  try:
    deadline = time.monotonic() + 60
    while len(procs.descendants(caller.pid)) < 3:  # launcher, PID 1, the program
      assert caller.poll() is None and time.monotonic() < deadline, "the run did not start"
      time.sleep(0.1)
    under = procs.descendants(caller.pid)
  finally:
    caller.kill()
    caller.wait()
  deadline = time.monotonic() + 10
  while alive := {p for p in under if procs.alive(p)}:
    assert time.monotonic() < deadline, f"left running after their caller died: {sorted(alive)}"
    time.sleep(0.1)
