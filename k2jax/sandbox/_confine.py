"""The launcher's last walls before the program runs (standard library only): seccomp and Landlock.

Imported by `_child.py` (copied beside it into the run's root-owned dir). The sandbox's PID 1 loads the
system-call filter that `syscalls.py` compiled (raw BPF, passed in hex) with seccomp(2) and
SECCOMP_FILTER_FLAG_NEW_LISTENER: the filter's default action is SECCOMP_RET_USER_NOTIF, so each refused
call blocks until PID 1 (`supervise`), holding the listener, records the call's name and answers
EPERM. The program (forked after the load, so it inherits the filter; PID 1 keeps the only listener)
restricts itself with Landlock just before exec, where the kernel has it: read and execute under the new
root, everything under the run's dir and writable binds, read/write on the /dev nodes. Landlock's domain also bars the program
from ptrace-class access (/proc/1/mem) to PID 1, which sits outside it.
"""

import ctypes
import errno
import os
import select

SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER = 1, 1 << 3
NOTIF_RECV, NOTIF_SEND = 0xC0502100, 0xC0182101  # _IOWR('!', 0|1, struct seccomp_notif (80 B) | _resp (24 B))
NR = {"x86_64": {"seccomp": 317}, "aarch64": {"seccomp": 277}}  # landlock_* are 444-446 on every arch
LANDLOCK_CREATE, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT = 444, 445, 446
MAX_NAMED = 64  # distinct refused calls kept per run (every family listed in syscalls.REFUSED fits)

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]


class _SockFprog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _Notif(ctypes.Structure):  # struct seccomp_notif, with its struct seccomp_data inline
  _fields_ = [
    ("id", ctypes.c_uint64),
    ("pid", ctypes.c_uint32),
    ("flags", ctypes.c_uint32),
    ("nr", ctypes.c_int32),
    ("arch", ctypes.c_uint32),
    ("ip", ctypes.c_uint64),
    ("args", ctypes.c_uint64 * 6),
  ]


class _Resp(ctypes.Structure):  # struct seccomp_notif_resp
  _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32), ("flags", ctypes.c_uint32)]


class _PathBeneath(ctypes.Structure):  # struct landlock_path_beneath_attr (packed)
  _pack_ = 1
  _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class ConfineError(Exception):
  pass


def load_filter(bpf_hex: str) -> int:
  """Loads the filter on this process (no_new_privs already set); returns the notification listener's fd."""
  code = bytes.fromhex(bpf_hex)
  buf = ctypes.create_string_buffer(code, len(code))
  prog = _SockFprog(len(code) // 8, ctypes.addressof(buf))
  nr = NR.get(os.uname().machine, {}).get("seccomp")
  if nr is None:
    raise ConfineError(f"seccomp filter: no system-call number known for seccomp(2) on {os.uname().machine}")
  fd = libc.syscall(nr, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, ctypes.byref(prog))
  if fd < 0:
    err = ctypes.get_errno()
    raise ConfineError(
      f"seccomp filter with a notification listener (Linux >= 5.0, CONFIG_SECCOMP_FILTER): {os.strerror(err)} "
      f"(errno {err}); SandboxConfig(seccomp='off') runs without it"
    )
  os.set_inheritable(fd, False)
  return fd


def supervise(fd: int, names: dict, pid: int) -> tuple[int, list]:
  """PID 1's loop until its child `pid` ends: answers every refused call with EPERM, keeping the names of the
  first MAX_NAMED distinct ones. No thread: a thread would count against the run's cgroup task cap."""
  denied = []
  child = os.pidfd_open(pid)
  try:
    while True:
      ready, _, _ = select.select([fd, child], [], [])
      if fd in ready:
        _answer(fd, names, denied)
      if child in ready:
        return os.waitpid(pid, 0)[1], denied
  finally:
    os.close(child)


def _answer(fd: int, names: dict, denied: list) -> None:
  note = _Notif()  # the kernel wants it zeroed
  if libc.ioctl(fd, NOTIF_RECV, ctypes.byref(note)) != 0:
    return  # ENOENT: the caller died before we read it; EINTR: select again
  name = names.get(str(note.nr), f"syscall_{note.nr}")
  if name not in denied and len(denied) < MAX_NAMED:
    denied.append(name)
  resp = _Resp(note.id, 0, -errno.EPERM, 0)
  libc.ioctl(fd, NOTIF_SEND, ctypes.byref(resp))  # ENOENT when the caller died meanwhile: nothing to answer


def landlock_abi() -> int:
  """The kernel's Landlock ABI version, 0 where it has none (or it is disabled at boot)."""
  v = libc.syscall(LANDLOCK_CREATE, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
  return max(int(v), 0)


def landlock(abi: int, writable: list, devices: list, read_only_binds: list) -> None:
  """Restricts this process and what it execs: read/execute under /, all rights under `writable` dirs,
  read/write on `devices`, and under `read_only_binds` read/execute plus writing files already there: the
  mount refuses writes to regular files (EROFS) but not to FIFOs (the verifier's channels between its
  sandboxes are FIFOs in a read-only bind). Handles every right `abi` knows: whatever is not granted is
  refused."""
  fs_all = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # REFER (v2), TRUNCATE (v3), IOCTL_DEV (v5)
  # Files only: TCP (ABI 4) and signal/abstract-socket scopes (ABI 6) are the empty network and PID namespaces'
  # already, and a second refusal there would only change the errors programs see.
  ruleset = (ctypes.c_uint64 * 1)(fs_all)
  fd = libc.syscall(LANDLOCK_CREATE, ctypes.byref(ruleset), ctypes.sizeof(ruleset), 0)
  if fd < 0:
    raise ConfineError(f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
  try:
    read_exec = 0b1101  # EXECUTE | READ_FILE | READ_DIR
    dev = 0b0110 | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)  # WRITE/READ_FILE, TRUNCATE, IOCTL
    rules = [("/", read_exec), *((p, fs_all) for p in writable), *((p, dev) for p in devices)]
    rules += [(p, read_exec | 0b0010) for p in read_only_binds]  # | WRITE_FILE
    for path, rights in rules:
      _add_rule(fd, path, rights)
    if libc.syscall(LANDLOCK_RESTRICT, fd, 0) != 0:
      raise ConfineError(f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
  finally:
    os.close(fd)


def _add_rule(ruleset_fd: int, path: str, rights: int) -> None:
  pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
  try:
    rule = _PathBeneath(rights, pfd)
    if libc.syscall(LANDLOCK_ADD_RULE, ruleset_fd, 1, ctypes.byref(rule), 0) != 0:  # LANDLOCK_RULE_PATH_BENEATH
      raise ConfineError(f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
  finally:
    os.close(pfd)
