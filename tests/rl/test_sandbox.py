"""Sandboxed code reward: every misbehaviour ends within its limit with reward 0 and a reason."""

import os
import socket
import subprocess
import threading

import pytest

from k2jax.rl.rewards.base import Completion, Prompt
from k2jax.rl.rewards.code import code_reward
from k2jax.sandbox.code import CodeRewardConfig, run_tests
from k2jax.sandbox.runner import SandboxConfig, run_python

# Generous wall limits: the CI machine is shared, so CPU seconds accrue slower than wall seconds.
SB = SandboxConfig(cpu_time_s=1, wall_time_s=30, memory_bytes=128 * 2**20, file_size_bytes=2**20)
CFG = CodeRewardConfig(SB)
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]


def _reward(code, cfg=CFG):
  return run_tests("def add(a, b):\n    return a + b\n" + code, TESTS, cfg)


def test_correct_code_gets_one_and_temp_dir_is_removed():
  p = Prompt("c", "code", (1,), data={"tests": TESTS})
  r = code_reward(p, Completion((), "Here:\n```python\ndef add(a, b):\n    return a + b\n```", "stop", False), CFG)
  assert r.reward == 1.0 and r.reason == "2/2 tests passed"
  res = run_python({"main.py": "import os; print(os.getcwd())"}, "main.py", SB)
  assert res.reason == "ok" and res.stdout.strip() == os.path.realpath(res.workdir)
  assert not os.path.exists(res.workdir)


def test_wrong_code_gets_pass_rate():
  r = run_tests("def add(a, b):\n    return a * b + 0 if a == 2 else a + b\n", TESTS, CFG)
  assert r.reward == 0.5 and "1/2 tests passed" in r.reason


@pytest.mark.parametrize(
  "code,reason",
  [
    ("while True: pass", "CPU time limit"),
    ("import time\ntime.sleep(60)", "wall-clock timeout"),
    ("import os\nwhile True: os.fork()", "process creation"),
    ("x = []\nwhile True: x.append(bytearray(10**7))", "memory limit"),
    ("import socket\nsocket.socket().connect(('127.0.0.1', 9))", "network"),
    ("open('/tmp/k2jax_sandbox_escape.txt', 'w').write('x')", "write outside the sandbox directory"),
    ("open('big.bin', 'w').write('x' * (4 * 2**20))", "File too large"),
    ("import os\nos.abort()", "crashed with SIGABRT"),
    ("raise SystemExit(3)", "SystemExit: 3"),
  ],
)
def test_misbehaviour_gets_zero_with_reason(code, reason):
  cfg = CFG if "sleep" not in code else CodeRewardConfig(dataclass_replace(SB, wall_time_s=2.0))
  r = _reward("\n" + code + "\n", cfg)
  assert r.reward == 0.0 and reason in r.reason, r
  assert not os.path.exists("/tmp/k2jax_sandbox_escape.txt")


def dataclass_replace(x, **kw):
  import dataclasses

  return dataclasses.replace(x, **kw)


def test_os_layers_hold_without_the_audit_hook():
  """With the audit hook off, rlimits, the uid and the network namespace still stop the attempts."""
  cfg = CodeRewardConfig(dataclass_replace(SB, audit_hook=False, wall_time_s=5.0))
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(1)
  listener.settimeout(0.5)
  port = listener.getsockname()[1]
  r = _reward(f"\nimport socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", cfg)
  assert r.reward == 0.0 and ("unreachable" in r.reason or "refused" in r.reason), r
  with pytest.raises(socket.timeout):
    listener.accept()  # nothing got through
  listener.close()
  r = _reward("\nimport os\nfor _ in range(100): os.fork()\n", cfg)
  assert r.reward == 0.0 and ("BlockingIOError" in r.reason or "Resource temporarily" in r.reason), r
  # Bounded even when the program swallows the errors: the wall clock ends it, the group is killed.
  r = _reward("\nimport os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n", cfg)
  assert r.reward == 0.0 and ("wall-clock" in r.reason or "CPU" in r.reason), r
  assert "netns" in r.info["layers"] and "rlimits" in r.info["layers"]


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
