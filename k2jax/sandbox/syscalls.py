"""The sandbox's system-call filter: which calls a program may make, compiled to BPF by libseccomp.

The allow list is Docker's default seccomp profile (moby `profiles/seccomp/default.json`, its unconditional
list and its argument rules), less calls a grader never needs (io_uring, file handles, fanotify). Everything
else is refused with EPERM, and named: the default action is SECCOMP_RET_USER_NOTIF, so the sandbox's PID 1
(`_child.py`) hears of each refused call, records its name for `SandboxResult.denied`, and answers EPERM.
What is refused on purpose, by family (`REFUSED`, each tested from inside the sandbox):
- new namespaces: unshare, setns, clone with any CLONE_NEW* flag (the flags are clone's first argument,
  which the filter can read); clone3 passes them in memory the filter cannot read, so clone3 gets ENOSYS
  and glibc, Python and Go fall back to clone (Docker's own answer);
- mounts and roots: mount, umount2, pivot_root, chroot, the new mount API (fsopen ... mount_setattr);
- other processes' memory: ptrace, process_vm_readv/writev, kcmp, pidfd_getfd, process_madvise;
- kernel attack surface: bpf, perf_event_open, keyctl, add_key, request_key, userfaultfd, io_uring_*,
  kexec_load, kexec_file_load, open_by_handle_at and name_to_handle_at, module loading, reboot, swap,
  clock setting, acct, quotactl, syslog, iopl/ioperm, NUMA policy.

The filter is built here, in the trusted caller, once per process; the launcher (standard library only)
loads the exported program with seccomp(2). libseccomp is reached through `pyseccomp` (ctypes over the
system's libseccomp.so.2, PyPI); where either is missing `filter_program` raises `FilterUnavailable`.
"""

from __future__ import annotations

import functools
import os
import tempfile

# Docker's default profile, unconditional allow list, less io_uring_{setup,enter,register}, name_to_handle_at,
# fanotify_mark and process_mrelease; 32-bit-only names are left out (they do not resolve on 64-bit arches).
ALLOWED = (
  "accept accept4 access adjtimex alarm bind brk capget capset chdir chmod chown clock_adjtime clock_getres "
  "clock_gettime clock_nanosleep close close_range connect copy_file_range creat dup dup2 dup3 epoll_create "
  "epoll_create1 epoll_ctl epoll_ctl_old epoll_pwait epoll_pwait2 epoll_wait epoll_wait_old eventfd eventfd2 "
  "execve execveat exit exit_group faccessat faccessat2 fadvise64 fallocate fchdir fchmod fchmodat fchown "
  "fchownat fcntl fdatasync fgetxattr flistxattr flock fork fremovexattr fsetxattr fstat fstatfs fsync ftruncate "
  "futex futex_waitv futimesat getcpu getcwd getdents getdents64 getegid geteuid getgid getgroups getitimer "
  "getpeername getpgid getpgrp getpid getppid getpriority getrandom getresgid getresuid getrlimit "
  "get_robust_list getrusage getsid getsockname getsockopt get_thread_area gettid gettimeofday getuid getxattr "
  "inotify_add_watch inotify_init inotify_init1 inotify_rm_watch io_cancel ioctl io_destroy io_getevents "
  "io_pgetevents ioprio_get ioprio_set io_setup io_submit kill landlock_add_rule landlock_create_ruleset "
  "landlock_restrict_self lchown lgetxattr link linkat listen listxattr llistxattr lremovexattr lseek lsetxattr "
  "lstat madvise membarrier memfd_create memfd_secret mincore mkdir mkdirat mknod mknodat mlock mlock2 mlockall "
  "mmap mprotect mq_getsetattr mq_notify mq_open mq_timedreceive mq_timedsend mq_unlink mremap msgctl msgget "
  "msgrcv msgsnd msync munlock munlockall munmap nanosleep newfstatat open openat openat2 pause pidfd_open "
  "pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll ppoll prctl pread64 preadv preadv2 "
  "prlimit64 pselect6 pwrite64 pwritev pwritev2 read readahead readlink readlinkat readv recvfrom recvmmsg "
  "recvmsg remap_file_pages removexattr rename renameat renameat2 restart_syscall rmdir rseq rt_sigaction "
  "rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend rt_sigtimedwait rt_tgsigqueueinfo "
  "sched_getaffinity sched_getattr sched_getparam sched_get_priority_max sched_get_priority_min "
  "sched_getscheduler sched_rr_get_interval sched_setaffinity sched_setattr sched_setparam sched_setscheduler "
  "sched_yield seccomp select semctl semget semop semtimedop sendfile sendmmsg sendmsg sendto setfsgid setfsuid "
  "setgid setgroups setitimer setpgid setpriority setregid setresgid setresuid setreuid setrlimit "
  "set_robust_list setsid setsockopt set_thread_area set_tid_address setuid setxattr shmat shmctl shmdt shmget "
  "shutdown sigaltstack signalfd signalfd4 socketpair splice stat statfs statx symlink symlinkat sync "
  "sync_file_range syncfs sysinfo tee tgkill time timer_create timer_delete timer_getoverrun timer_gettime "
  "timer_settime timerfd_create timerfd_gettime timerfd_settime times tkill truncate umask uname unlink unlinkat "
  "utime utimensat utimes vfork vmsplice wait4 waitid write writev "
  # Per-arch, as Docker: x86-64's arch_prctl and modify_ldt, arm64's cache and TLS calls.
  "arch_prctl modify_ldt cacheflush set_tls"
).split()

# Refused calls by family (not in ALLOWED; each gets EPERM and is named, `clone` only with a CLONE_NEW* flag).
REFUSED = {
  "namespaces": ("unshare", "setns", "clone"),
  "mount": (
    "mount umount2 pivot_root chroot fsopen fsconfig fsmount fspick move_mount open_tree mount_setattr".split()
  ),
  "ptrace": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "process_madvise"),
  "bpf": ("bpf",),
  "perf_event_open": ("perf_event_open",),
  "keys": ("keyctl", "add_key", "request_key"),
  "userfaultfd": ("userfaultfd",),
  "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
  "kexec": ("kexec_load", "kexec_file_load"),
  "file_handles": ("open_by_handle_at", "name_to_handle_at"),
  "kernel": (
    "init_module finit_module delete_module reboot swapon swapoff settimeofday clock_settime acct quotactl "
    "syslog iopl ioperm lookup_dcookie fanotify_init mbind set_mempolicy get_mempolicy move_pages".split()
  ),
}
ENOSYS_CALLS = ("clone3",)  # answered ENOSYS: callers fall back to clone, whose flags the filter reads
# Docker's mask: every CLONE_NEW* flag (NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET) and CLONE_NEWTIME.
CLONE_NAMESPACE_FLAGS = 0x7E020080
AF_VSOCK = 40  # the one socket family Docker refuses (host <-> VM sockets, not behind the network namespace)
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # Docker's: linux, with UNAME26, ADDR_NO_RANDOMIZE, query


class FilterUnavailable(RuntimeError):
  """libseccomp or its Python bindings are missing; the message says what to install."""


@functools.lru_cache(maxsize=1)
def filter_program() -> tuple[bytes, dict[int, str]]:
  """(the filter as raw BPF for seccomp(2), {syscall number: name} for naming refused calls), built once."""
  try:
    import pyseccomp as sc  # noqa: PLC0415 (ctypes binding; its import loads libseccomp.so.2)
  except (ImportError, OSError) as e:
    raise FilterUnavailable(
      f"the sandbox's system-call filter needs libseccomp: {e}. Install the system library (Debian/Ubuntu: "
      "apt-get install libseccomp2) and `pip install pyseccomp`, or run with SandboxConfig(seccomp='off')"
    ) from e
  f = sc.SyscallFilter(sc.NOTIFY)
  f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)  # 32-bit or x32 entry points: the process dies
  f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)  # a binary tree over syscall numbers, not a linear scan of ~300 rules
  arch = sc.system_arch()
  for name in ALLOWED:
    if _resolves(sc, arch, name):
      f.add_rule(sc.ALLOW, name)
  f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NAMESPACE_FLAGS, 0))
  f.add_rule(sc.ERRNO(38), "clone3")  # ENOSYS
  f.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.NE, AF_VSOCK))
  for persona in PERSONALITIES:
    f.add_rule(sc.ALLOW, "personality", sc.Arg(0, sc.EQ, persona))
  with tempfile.TemporaryFile() as tmp:
    f.export_bpf(tmp)
    tmp.seek(0)
    bpf = tmp.read()
  names = {}
  for name in (*ALLOWED, *(n for family in REFUSED.values() for n in family), "socket", "personality"):
    if _resolves(sc, arch, name):
      names[sc.resolve_syscall(arch, name)] = name
  return bpf, names


# The pod's seccomp profile (deploy/seccomp/k2jax-sandbox.json, `python -m k2jax.sandbox.syscalls`): the inner
# filter's allow list plus what the sandbox's setup does outside it (_child.py): unshare with exactly the
# namespace sets it asks for, mount with no flag beyond those it uses (no MS_SHARED/MS_SLAVE propagation),
# chroot into the new root. Everything else the inner filter refuses stays refused for the whole pod.
SETUP_UNSHARE = (
  0x00020000,  # CLONE_NEWNS: root stages its binds (a root-run service only)
  0x18000000,  # CLONE_NEWUSER | CLONE_NEWIPC: the outer user namespace and the run's IPC namespace
  0x10000000,  # CLONE_NEWUSER: the inner user namespace
  0x66020000,  # CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWPID | CLONE_NEWNET
  0x7E020000,  # all of the above at once (SandboxConfig(kernel_limits=False))
)
# MS_RDONLY NOSUID NODEV NOEXEC REMOUNT NOATIME NODIRATIME BIND MOVE REC PRIVATE RELATIME
SETUP_MOUNT_FLAGS = 0x1 | 0x2 | 0x4 | 0x8 | 0x20 | 0x400 | 0x800 | 0x1000 | 0x2000 | 0x4000 | 0x40000 | 0x200000


def pod_profile() -> dict:
  """The container runtime's seccomp profile (OCI / Docker JSON) for pods that run the sandbox."""
  rule = lambda names, **kw: {"names": list(names), "action": "SCMP_ACT_ALLOW", **kw}  # noqa: E731
  arg = lambda i, op, v, v2=0: {"index": i, "value": v, "valueTwo": v2, "op": op}  # noqa: E731
  return {
    "defaultAction": "SCMP_ACT_ERRNO",
    "defaultErrnoRet": 1,
    "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"],
    "syscalls": [
      rule(ALLOWED + ["chroot"]),
      rule(["clone"], args=[arg(0, "SCMP_CMP_MASKED_EQ", CLONE_NAMESPACE_FLAGS)]),
      {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
      rule(["socket"], args=[arg(0, "SCMP_CMP_NE", AF_VSOCK)]),
      *(rule(["personality"], args=[arg(0, "SCMP_CMP_EQ", p)]) for p in PERSONALITIES),
      *(rule(["unshare"], args=[arg(0, "SCMP_CMP_EQ", flags)]) for flags in SETUP_UNSHARE),
      rule(["mount"], args=[arg(3, "SCMP_CMP_MASKED_EQ", ~SETUP_MOUNT_FLAGS & (2**64 - 1), 0)]),
    ],
  }


def filter_error() -> str | None:
  """None when the filter builds here, else why not (for `SandboxUnavailable` and tests)."""
  try:
    filter_program()
  except FilterUnavailable as e:
    return str(e)
  return None


def _resolves(sc, arch: int, name: str) -> bool:
  try:
    return sc.resolve_syscall(arch, name) >= 0
  except (ValueError, OSError):
    return False


def landlock_abi() -> int:
  """This kernel's Landlock ABI version (0: none), asked the way the launcher asks it."""
  import ctypes  # noqa: PLC0415

  libc = ctypes.CDLL(None, use_errno=True)
  nr = {"x86_64": 444, "aarch64": 444}.get(os.uname().machine)
  return max(libc.syscall(nr, None, 0, 1), 0) if nr is not None else 0


if __name__ == "__main__":
  import json

  print(json.dumps(pod_profile(), indent=1))
