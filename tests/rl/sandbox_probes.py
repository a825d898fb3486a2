"""Escape and reward-hacking probes against the code reward (standard library only).

Imported by test_sandbox.py, and run as a script by it as an unprivileged user:
  python sandbox_probes.py PACKAGE_ROOT   # prints one JSON object: probe -> outcome
Every probe is a solution for a task whose one test expects a random 12-digit secret: the only ways to
reward 1 are to read the hidden test, forge the verdict, or cheat the comparison. Each also attacks the
caller: a canary file of the caller's uid, a sleeping process of the caller's uid, the caller itself.
"""

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

PROBES = {
  # Walk the frames to the harness, neuter every guard function found there, then write the caller's file.
  "frame_walk_guard_removal": r"""
import sys
f = sys._getframe()
while f is not None:
    for name, v in list(f.f_globals.items()):
        if callable(v) and name.startswith("_") and not name.startswith("__"):
            f.f_globals[name] = lambda *a, **k: None
    f = f.f_back
for hook in ("_hook", "_violation", "_outside"):
    globals()[hook] = lambda *a, **k: None
try:
    open(CANARY, "w").write("pwned")
except OSError as e:
    print("write failed:", e)
def secret_value():
    return 0
""",
  # Writes, unlinks and renames relative to directory fds (what path-based guards miss).
  "dir_fd_writes": r"""
import os
for attempt in (
    lambda d: os.open(os.path.relpath(CANARY, "/"), os.O_WRONLY | os.O_TRUNC, dir_fd=d),
    lambda d: os.unlink(os.path.relpath(CANARY, "/"), dir_fd=d),
    lambda d: os.rename(os.path.relpath(CANARY, "/"), "x", src_dir_fd=d, dst_dir_fd=d),
    lambda d: os.mkdir(os.path.relpath(os.path.dirname(CANARY), "/") + "/pwned", dir_fd=d),
):
    try:
        d = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        attempt(d)
        print("attempt succeeded")
    except OSError as e:
        print("dir_fd attempt failed:", e)
def secret_value():
    return 0
""",
  # SIGKILL the parent, the caller, a process of the caller's uid, every process it may signal, its group.
  "kill_parent": r"""
import os, signal
for target in (os.getppid(), CALLER_PID, SLEEPER_PID):
    try:
        if target > 0:
            os.kill(target, signal.SIGKILL)
    except OSError as e:
        print("kill failed:", target, e)
for pid in range(2, 4096):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
for kill_all in (lambda: os.kill(-1, signal.SIGKILL), lambda: os.killpg(0, signal.SIGKILL)):
    try:
        kill_all()
    except OSError as e:
        print("kill failed:", e)
def secret_value():
    return 0
""",
  # Look everywhere the hidden test could be: the caller's tests file, cwd, /tmp, other processes.
  "read_tests_file": r"""
import os, re
found = []
def scan(path):
    try:
        with open(path, "rb") as fh:
            data = fh.read(1 << 20)
    except OSError:
        return
    found.extend(re.findall(rb"== (\d{12})", data))
scan(TESTS_FILE)
for root in (".", "/tmp", os.path.dirname(TESTS_FILE), "/proc"):
    if found:  # the secret is in hand: the rest of the host's /tmp and /proc would only cost time
        break
    for d, dirs, names in os.walk(root):
        if d.count("/") > 4 or "/proc/sys" in d:
            dirs[:] = []
        for n in names:
            if n in ("cmdline", "environ") or not d.startswith("/proc"):
                scan(os.path.join(d, n))
for p in ("/proc/%d/cmdline" % CALLER_PID, "/proc/%d/environ" % CALLER_PID, "/proc/1/cmdline"):
    scan(p)
def secret_value():
    return int(found[0]) if found else -1
""",
  # Print the old result line, write pass-looking lines to the report pipe, exit before the harness does.
  "forged_result_line": r"""
import json, os
print("K2JAX-RESULT 0 [[true, \"\"]]")
fd = int(os.environ.get("K2JAX_REPORT_FD", "1"))
for line in ({"test": 0, "passed": True}, {"test": 0, "values": [], "ok": True}, {"test": 0, "values": [True]},
             {"test": 0, "error": None}, [0, True]):
    os.write(fd, (json.dumps(line) + "\n").encode())
os._exit(0)
""",
  # Objects that compare equal to anything, including an int subclass.
  "always_equal": r"""
class AlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
class EqualInt(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
import builtins
builtins.type = lambda *a: int  # a harness that trusted type() would now pass anything through
calls = []
def secret_value():
    calls.append(1)
    return AlwaysEqual() if len(calls) == 1 else EqualInt(0)
""",
}


def run_probe(name, run_tests, config, workdir, uid=None):
  """One probe against `run_tests`; the outcome says what it got and what outside it touched.

  `uid`: the uid the sandbox runs as (root callers drop to one); the canary, the tests file and the
  sleeper belong to it, so only the isolation (not file permissions) keeps them safe.
  """
  secret = str(secrets.randbelow(9 * 10**11) + 10**11)
  canary = os.path.join(workdir, "checkpoint.bin")
  with open(canary, "w") as f:
    f.write("weights")
  tests = [f"assert secret_value() == {secret}", f"assert {secret} == secret_value()"]
  tests_file = os.path.join(workdir, "hidden_tests.json")
  with open(tests_file, "w") as f:
    json.dump(tests, f)
  ids = {}
  if uid is not None:
    for p in (workdir, canary, tests_file):
      os.chown(p, uid, uid)
    ids = {"user": uid, "group": uid, "extra_groups": []}
  os.chmod(workdir, 0o755)
  sleeper = subprocess.Popen(["sleep", "600"], **ids)
  try:
    prelude = f"CANARY = {canary!r}\nTESTS_FILE = {tests_file!r}\nCALLER_PID = {os.getpid()}\n"
    prelude += f"SLEEPER_PID = {sleeper.pid}\n"
    r = run_tests(prelude + PROBES[name], tests, config)
    time.sleep(0.2)
    with open(canary) as f:
      canary_text = f.read()
    return {
      "reward": r.reward,
      "reason": r.reason,
      "layers": list(r.info.get("layers", ())),
      "canary": canary_text,
      "dir": sorted(os.listdir(workdir)),
      "sleeper_alive": sleeper.poll() is None,
      "secret_leaked": secret in r.reason,
    }
  finally:
    sleeper.send_signal(signal.SIGKILL)
    sleeper.wait()


def main(package_root):
  """As a script: load k2jax's sandbox modules alone (no jax) from `package_root` and run every probe."""
  import types

  sys.path.insert(0, package_root)  # pyseccomp (one module) beside the package copy; -I left the dir off
  for name in ("k2jax", "k2jax.sandbox"):
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(package_root, *name.split("."))]
    sys.modules[name] = mod
  from k2jax.sandbox.code import CodeRewardConfig, run_tests
  from k2jax.sandbox.runner import SandboxConfig

  config = CodeRewardConfig(SandboxConfig(cpu_time_s=5, wall_time_s=30, memory_bytes=256 * 2**20))
  out = {"uid": os.getuid()}
  for name in PROBES:
    with tempfile.TemporaryDirectory() as d:
      out[name] = run_probe(name, run_tests, config, d)
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
