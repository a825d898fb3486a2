"""The sandbox launcher (standard library only): build the kernel's isolation, then exec the program.

Started by `runner.py` with argv[1] = a JSON object, as the sandbox uid, or as root when the caller is root
(`drop_uid` set). Root first stages: in a private mount namespace of its own it bind-mounts every host path
the new root will hold (interpreter prefix, system dirs, the run's dir, `binds`) at `stage_dir/N`, then drops
to `drop_uid` (no groups, no capabilities) and goes on as below reading those paths through the stages: a
venv or workspace in a directory the sandbox uid cannot enter (a 0700 home) is still mounted, and nothing of
the caller's permissions changes. Isolated runs:
1. unshare a user namespace mapping the calling uid to 0, and an IPC namespace owned by it, whose
   SysV limits (shmmax, shmall, shmmni, msgmni, msgmnb, sem) and POSIX mqueue count it sets: the kernel lets
   only that namespace's root write them. Then a second user namespace inside, mapping uid 1000 to it
   (never 0, so the exec below clears every capability), whose max_user_namespaces it sets to 0: the
   program cannot make a user namespace of its own, so it cannot mount a tmpfs the limits do not see
   (a sysctl, not seccomp: clone3 passes its flags in memory a seccomp filter cannot read). Then mount,
   PID, network, UTS and cgroup namespaces owned by the inner one;
2. fork: the child is PID 1 of the new PID namespace (it cannot see or signal anything outside it, and
   when it dies the kernel kills every process left inside); it dies with the launcher (PDEATHSIG);
3. the child builds a new root on a tmpfs: the interpreter and system libraries bind-mounted read-only,
   /dev/{null,zero,random,urandom} (device binds, so they open), a fresh /proc, and as the only writable
   path a private tmpfs of `scratch_bytes` at the run's dir, filled with a copy of its files (disk writes
   never reach the host; /dev/shm links there, so POSIX shm counts too); it moves that root over / and
   chroots into it (the caller's files are not in the view at all);
4. capability bounding set emptied, no_new_privs; PID 1 makes itself non-dumpable (its memory and /proc
   files out of the program's reach), loads the system-call filter (`_confine.py`, `syscalls.py`) and
   forks the program, which takes a new session, sets rlimits (CPU, address space, file size, open files,
   processes of this user namespace, no core), restricts itself with Landlock where the kernel has it,
   and execs the interpreter on the entry file. PID 1 answers the filter's refusals and names them.
PID 1 waits and reports `EXIT n FLAGS` / `SIGNAL n FLAGS` (or `SETUP why` when isolation failed) on a
status pipe the program never holds, FLAGS naming the limits found full (`scratch`, `shm`), the walls
that held (`seccomp`, `landlock`) and the refused calls (`denied=a+b`), then exits,
which ends the namespace. When the caller put the launcher in a cgroup it first waits for a byte on
`go_fd`, so nothing runs before the cgroup's limits apply. Unisolated runs (the explicit unsafe
mode) skip steps 1 and 3, and the launcher's child is the program.
"""

import ctypes
import json
import os
import resource
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _confine.py, copied beside this file
import _confine  # noqa: E402

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE, MS_RELATIME = (
  1024,
  2048,
  4096,
  8192,
  16384,
  1 << 18,
  1 << 21,
)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
INNER_ID = 1000
DEVICES = ("null", "zero", "random", "urandom")
NO_IPC_LIMITS = []  # the IPC sysctl this kernel refused to the namespace, if any
WALLS = {"landlock_abi": 0}  # PID 1's: the Landlock ABI the program will use (0: none)
STAGED = {}  # host dir -> the bind of it root made under stage_dir (where the sandbox uid reaches it)

cfg = json.loads(sys.argv[1])
status = os.fdopen(cfg["status_fd"], "w", buffering=1)
os.set_inheritable(cfg["status_fd"], False)  # closed by the exec: the program never holds it
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


class SetupError(Exception):
  pass


def _check(ret, what):
  if ret != 0:
    err = ctypes.get_errno()
    raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(src, dst, fstype, flags, data=None):
  enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
  _check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {src} -> {dst}")


def _write(path, text):
  with open(path, "w") as f:
    f.write(text)


def enter_namespaces():
  rest = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWCGROUP
  if not cfg["kernel_limits"]:  # no kernel limits: kept so bench/sandbox.py measures their cost
    _map_user(INNER_ID, os.geteuid(), os.getegid(), rest | CLONE_NEWIPC)
    return
  _map_user(0, os.geteuid(), os.getegid(), CLONE_NEWIPC)
  for name, value in cfg["ipc_sysctls"].items():  # this IPC namespace's own limits, for the whole run
    try:
      _write(f"/proc/sys/{name}", str(value))
    except PermissionError:  # kernels before 5.19 let only the host's root set them: `layers` says so
      NO_IPC_LIMITS.append(name)
      break
  _map_user(INNER_ID, 0, 0, 0)
  _check_write("/proc/sys/user/max_user_namespaces", "0")
  _check(libc.unshare(rest), "unshare(mount, pid, net, uts, cgroup namespaces)")


def _map_user(inner, outer_uid, outer_gid, more_flags):
  _check(libc.unshare(CLONE_NEWUSER | more_flags), f"unshare(user namespace, flags {more_flags:#x})")
  _write("/proc/self/setgroups", "deny")
  _write("/proc/self/uid_map", f"{inner} {outer_uid} 1")
  _write("/proc/self/gid_map", f"{inner} {outer_gid} 1")


def _check_write(path, value):
  try:
    _write(path, str(value))
  except OSError as e:
    raise SetupError(f"cannot set {path} to {value}: {e}") from e


def _locked_flags(path):
  """Mount flags the kernel will not let a user namespace clear on a bind of `path` (must be repeated)."""
  f = os.statvfs(path).f_flag
  out = 0
  for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC)):
    if f & st:
      out |= ms
  for st, ms in ((os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
    if f & st:
      out |= ms
  return out


def _scratch(workdir, root):
  """A private tmpfs of scratch_bytes at the run's dir, holding a copy of its files: the only writable path."""
  dst = root + workdir
  os.makedirs(dst, exist_ok=True)
  size, inodes = cfg["scratch_bytes"], cfg["scratch_inodes"]
  _mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes={inodes},mode=0755")
  src = STAGED.get(workdir, workdir)
  for d, dirs, names in os.walk(src):
    rel = os.path.relpath(d, src)
    for n in dirs:
      os.makedirs(os.path.join(dst, rel, n), exist_ok=True)
    for n in names:
      with open(os.path.join(d, n), "rb") as fin, open(os.path.join(dst, rel, n), "wb") as fout:
        fout.write(fin.read())
  os.symlink(workdir, root + "/dev/shm")  # shm_open's files: on the scratch tmpfs, inside its limit


def _full(workdir):
  """Limits found full when the program ended: the scratch tmpfs, the IPC namespace's SysV shm."""
  flags = ["no_ipc_limits"] if NO_IPC_LIMITS else []
  try:
    st = os.statvfs(workdir)
    if st.f_bavail * st.f_frsize < 2 * st.f_frsize or st.f_favail == 0:
      flags.append("scratch")
  except OSError:
    pass
  try:
    with open("/proc/sysvipc/shm") as f:
      rows = f.read().splitlines()[1:]
    used = sum(int(r.split()[3]) for r in rows)
    # A refused shmget leaves no trace: over half the budget held means the next request could not fit.
    if 2 * used >= cfg["shm_bytes"] or len(rows) >= cfg["ipc_sysctls"]["kernel/shmmni"]:
      flags.append(f"shm={used}")
  except (OSError, ValueError, IndexError, KeyError):
    pass
  return ",".join(flags) or "-"


def _bind(src, dst, read_only, is_file=False, device=False):
  """Bind-mounts host path `src` (through its stage, when root staged it) at `dst` under the new root."""
  src = STAGED.get(src, src)
  if is_file:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    open(dst, "a").close()
  else:
    os.makedirs(dst, exist_ok=True)
  _mount(src, dst, None, MS_BIND)
  # A device node opens only on a mount without nodev; everything else writable is nodev.
  flags = MS_BIND | MS_REMOUNT | MS_NOSUID | _locked_flags(src) | (MS_RDONLY if read_only else 0)
  flags |= 0 if device else MS_NODEV
  _mount(None, dst, None, flags)


def _ro_paths():
  """System library dirs and this interpreter's prefix (it may live outside /usr, e.g. pyenv, /opt)."""
  exe_dir = os.path.dirname(os.path.realpath(sys.executable))
  prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
  paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", *sorted(prefixes), exe_dir]
  out = []
  for p in paths:  # a path already inside a bound dir needs no bind of its own
    if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out if not os.path.islink(q)):
      out.append(p)
  return out


def root_plan(ro_paths):
  """What the new root holds, read by whoever can see it all (root, before it drops): [(path, link target or
  None for a dir)]. Paths that are neither are left out."""
  plan = []
  for path in ro_paths:
    if os.path.islink(path):  # /bin -> usr/bin on merged-/usr systems: same link, same target
      plan.append((path, os.readlink(path)))
    elif os.path.isdir(path):
      plan.append((path, None))
  return plan


def stage(plan):
  """Root only: a private mount namespace (nothing reaches the caller's) where every host dir of the new root
  is bind-mounted under `stage_dir`, whose own mode lets the sandbox uid through to those binds."""
  _check(libc.unshare(CLONE_NEWNS), "unshare(mount namespace) to stage the binds as root")
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  top = cfg["stage_dir"]
  _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0755")
  dirs = [p for p, link in plan if link is None] + [cfg["workdir"]] + [src for src, _, _ in cfg["binds"]]
  for path in dict.fromkeys(dirs):
    # Opened without following a last symlink (the run's dir belongs to the sandbox uid, which could swap it
    # for a link to what only root may see), then bound through the descriptor: what was checked is bound.
    try:
      fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
      raise SetupError(f"bind source {path!r} is not a directory: {e}") from e
    try:
      at = os.path.join(top, str(len(STAGED)))
      os.mkdir(at)
      _mount(f"/proc/self/fd/{fd}", at, None, MS_BIND)
    finally:
      os.close(fd)
    STAGED[path] = at


def drop_to(uid):
  """Root becomes `uid` for good: no supplementary groups, real/effective/saved ids, no capabilities left."""
  os.setgroups([])
  os.setresgid(uid, uid, uid)
  os.setresuid(uid, uid, uid)
  if os.getuid() != uid or os.geteuid() != uid:
    raise SetupError(f"could not drop to uid {uid}")
  # The id change made this process non-dumpable, which hands /proc/self/* to root: uid_map must be ours.
  _check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")


def build_root(plan):
  root = cfg["newroot"]
  _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the caller
  _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
  for path, link in plan:
    if link is not None:
      if not os.path.lexists(root + path):
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(link, root + path)
    else:
      _bind(path, root + path, read_only=True)
  for dev in DEVICES:
    _bind("/dev/" + dev, root + "/dev/" + dev, read_only=False, is_file=True, device=True)
  if cfg["kernel_limits"]:
    _scratch(cfg["workdir"], root)
  else:
    _bind(cfg["workdir"], root + cfg["workdir"], read_only=False)
  for src, dst, read_only in cfg["binds"]:  # SandboxConfig.binds: host path -> a path inside
    _bind(src, root + dst, read_only)
  os.makedirs(root + "/proc", exist_ok=True)
  try:  # refused where the caller's /proc is partly masked (some containers); Python does not need it
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  except SetupError:
    pass
  os.chdir(root)
  _mount(root, "/", None, MS_MOVE)  # the new root covers the old one for this namespace ...
  os.chroot(".")  # ... and becomes this process's root
  os.chdir("/")
  _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_privileges(last):
  for cap in range(last + 1):
    _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
  _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def set_limits():
  nproc = cfg["max_processes"] + (2 if cfg["isolate"] else 0)  # the launcher and PID 1 count in the namespace
  for name, soft, hard in (
    ("RLIMIT_CPU", cfg["cpu_time_s"], cfg["cpu_time_s"] + 1),
    ("RLIMIT_AS", cfg["memory_bytes"], cfg["memory_bytes"]),
    ("RLIMIT_FSIZE", cfg["file_size_bytes"], cfg["file_size_bytes"]),
    ("RLIMIT_NPROC", nproc, nproc),
    ("RLIMIT_NOFILE", cfg["max_open_files"], cfg["max_open_files"]),
    ("RLIMIT_CORE", 0, 0),
    *([("RLIMIT_MEMLOCK", 0, 0)] if cfg["kernel_limits"] else []),  # nothing pinned outside the address space
  ):
    resource.setrlimit(getattr(resource, name), (soft, hard))


def child(cap_last, plan):
  """Isolated: PID 1 of the namespace, builds the root, then runs the program as its child and reports.

  The program is not PID 1 itself: the kernel drops signals without a handler sent to a namespace's
  init, which would turn SIGXCPU and abort() into hangs. Unisolated, this process is the program."""
  try:
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if not cfg["isolate"]:
      program()
    build_root(plan)
    drop_privileges(cap_last)
    listener = walls()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the program may signal PID 1 only where it has a handler
    pid = os.fork()
    if pid == 0:
      if listener is not None:
        os.close(listener)  # PID 1 holds the only one: the program cannot answer its own refused calls
      os.setsid()  # kill(0, ...) from the program reaches only its own session
      program()
  except (SetupError, _confine.ConfineError, OSError, ValueError) as e:
    status.write(f"SETUP {e}\n")
    os._exit(2)
  os.close(cfg["report_fd"])
  if listener is not None:
    st, denied = _confine.supervise(listener, cfg["syscall_names"], pid)
  else:
    st, denied = os.waitpid(pid, 0)[1], []
  full = _full(cfg["workdir"]) if cfg["kernel_limits"] else "-"
  full = ",".join(x for x in [*full.split(","), *_wall_flags(listener is not None, denied)] if x != "-") or "-"
  status.write(f"SIGNAL {os.WTERMSIG(st)} {full}\n" if os.WIFSIGNALED(st) else f"EXIT {os.WEXITSTATUS(st)} {full}\n")
  os._exit(0)  # PID 1 exits: the kernel kills whatever the program left behind


def walls():
  """PID 1, isolated, after no_new_privs: non-dumpable, the Landlock ABI found (or refused by config), the
  system-call filter loaded. Returns the filter's listener fd (None when the filter is off by config)."""
  _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "non-dumpable")
  if cfg["landlock"] != "off":
    WALLS["landlock_abi"] = _confine.landlock_abi()
    if WALLS["landlock_abi"] < 1 and cfg["landlock"] == "required":
      raise SetupError(
        "SandboxConfig(landlock='required'): this kernel has no Landlock (CONFIG_SECURITY_LANDLOCK, 'landlock' in "
        "the lsm= boot list; Linux >= 5.13)"
      )
  return _confine.load_filter(cfg["seccomp_bpf"]) if cfg["seccomp_bpf"] else None


def _wall_flags(filtered, denied):
  flags = ["seccomp"] if filtered else []
  flags += ["landlock"] if WALLS["landlock_abi"] >= 1 else []
  return flags + (["denied=" + "+".join(denied)] if denied else [])


def _landlock():
  """The program restricts itself (PID 1 stays outside its domain); a no-op where PID 1 found no Landlock."""
  if WALLS["landlock_abi"] < 1:
    return
  writable = [cfg["workdir"], *(dst for _, dst, read_only in cfg["binds"] if not read_only)]
  read_only = [dst for _, dst, ro in cfg["binds"] if ro]
  _confine.landlock(WALLS["landlock_abi"], writable, ["/dev/" + d for d in DEVICES], read_only)


def program():
  try:
    os.chdir(cfg["workdir"])
    set_limits()
    if cfg["isolate"]:
      _landlock()
    exe = os.path.realpath(sys.executable)  # a venv's symlink may point outside the new root's view
    os.execve(exe, [exe, *cfg["argv"][1:]], cfg["env"])
  except (OSError, ValueError, _confine.ConfineError) as e:
    status.write(f"SETUP {e}\n")
    os._exit(2)


def main():
  # The launcher dies with its caller: a runner SIGKILLed mid-run (an env worker stopped by its pool) must not
  # leave a program running with no wall-clock deadline over it. Its PID 1 dies with it in turn (below), and
  # with PID 1 the kernel kills the whole namespace. The parent may already be gone: then exit now.
  _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
  if os.getppid() != cfg["parent_pid"]:
    sys.exit(2)
  if cfg["go_fd"] is not None:  # the caller moves this process into the run's cgroup, then says go
    go = os.read(cfg["go_fd"], 1)
    os.close(cfg["go_fd"])
    if go != b"g":
      sys.exit(2)
  try:
    plan = root_plan(_ro_paths()) if cfg["isolate"] else []
    if cfg["drop_uid"] is not None:  # started as root: stage what the sandbox uid could not reach, then drop
      if cfg["isolate"]:
        stage(plan)
      drop_to(cfg["drop_uid"])
      _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # an id change clears it
      if os.getppid() != cfg["parent_pid"]:
        sys.exit(2)
    if cfg["isolate"]:
      enter_namespaces()
  except (SetupError, OSError) as e:
    status.write(f"SETUP {e}\n")
    sys.exit(2)
  try:
    with open("/proc/sys/kernel/cap_last_cap") as f:
      cap_last = int(f.read())
  except (OSError, ValueError):
    cap_last = 40  # CAP_CHECKPOINT_RESTORE, the highest as of Linux 6.x
  pid = os.fork()  # the program's setsid aside, all share the process group the caller kills at the deadline
  if pid == 0:
    child(cap_last, plan)
  os.close(cfg["report_fd"])
  for fd in (0, 1, 2):
    os.close(fd)
  _, st = os.waitpid(pid, 0)  # isolated: PID 1 reported the program's status first, this line is ignored
  status.write(f"SIGNAL {os.WTERMSIG(st)}\n" if os.WIFSIGNALED(st) else f"EXIT {os.WEXITSTATUS(st)}\n")


main()
