"""Runs inside the sandbox process (standard library only): isolate, limit, then run the entry script.

argv[1] is a JSON object from `sandbox.py`. Order matters: leave the network namespace while ctypes is
still allowed, set rlimits, install the audit hook last, then run the user's entry file.
"""

import json
import os
import resource
import runpy
import sys

VIOLATION_EXIT = 113
cfg = json.loads(sys.argv[1])
report = os.fdopen(cfg["report_fd"], "w", buffering=1)
layers = []

if cfg["network_namespace"]:
  import ctypes

  _libc = ctypes.CDLL(None, use_errno=True)
  CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
  # Root may create a netns directly; others need a user namespace around it.
  flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
  if _libc.unshare(flags) == 0:
    layers.append("netns")
  del _libc

for name, soft, hard in (
  ("RLIMIT_CPU", cfg["cpu_time_s"], cfg["cpu_time_s"] + 1),
  ("RLIMIT_AS", cfg["memory_bytes"], cfg["memory_bytes"]),
  ("RLIMIT_FSIZE", cfg["file_size_bytes"], cfg["file_size_bytes"]),
  ("RLIMIT_NPROC", cfg["max_processes"], cfg["max_processes"]),
  ("RLIMIT_NOFILE", cfg["max_open_files"], cfg["max_open_files"]),
  ("RLIMIT_CORE", 0, 0),
):
  resource.setrlimit(getattr(resource, name), (soft, hard))
layers.append("rlimits")

ROOT = os.path.realpath(cfg["workdir"])
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
BLOCKED = {
  "os.fork": "process creation",
  "os.forkpty": "process creation",
  "os.posix_spawn": "process creation",
  "os.spawn": "process creation",
  "os.exec": "process creation",
  "os.system": "process creation",
  "subprocess.Popen": "process creation",
  "os.kill": "signalling",
  "os.killpg": "signalling",
  "ctypes.dlopen": "native code",
  "ctypes.dlsym": "native code",
  "ctypes.cdata": "native code",
}
PATH_EVENTS = {
  "os.remove",
  "os.rmdir",
  "os.mkdir",
  "os.rename",
  "os.replace",
  "os.symlink",
  "os.link",
  "os.chmod",
  "os.chown",
  "os.truncate",
  "os.utime",
  "shutil.rmtree",
  "shutil.copyfile",
  "shutil.move",
  "os.chdir",
}


def _violation(what):
  report.write(f"VIOLATION {what}\n")
  report.flush()
  os._exit(VIOLATION_EXIT)


def _outside(path):
  if isinstance(path, int):
    return False  # file descriptor: already opened under the policy
  p = os.path.realpath(os.fsdecode(path))
  return not (p == ROOT or p.startswith(ROOT + os.sep) or p == "/dev/null")


def _hook(event, args):
  if event.startswith("socket."):
    _violation(f"network ({event})")
  if event in BLOCKED:
    _violation(f"{BLOCKED[event]} ({event})")
  if event == "open" and args and args[0] is not None:
    path, mode, flags = (list(args) + [None, 0])[:3]
    writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
    if writes and _outside(path):
      _violation(f"write outside the sandbox directory ({os.fsdecode(path)})")
  if event in PATH_EVENTS:
    for a in args:
      if isinstance(a, (str, bytes, os.PathLike)) and _outside(a):
        _violation(f"filesystem change outside the sandbox directory ({event} {os.fsdecode(a)})")


if cfg["audit_hook"]:
  sys.addaudithook(_hook)
  layers.append("audit_hook")
report.write("LAYERS " + " ".join(layers) + "\n")

os.chdir(ROOT)
sys.path.insert(0, ROOT)
sys.argv = [cfg["entry"]]
try:
  runpy.run_path(os.path.join(ROOT, cfg["entry"]), run_name="__main__")
except MemoryError:
  sys.stderr.write("MemoryError\n")
  sys.exit(1)
