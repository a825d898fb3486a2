"""/proc helpers for tests that check nothing outlives the process that started it."""

import os


def alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie has exited: only its parent has yet to reap it)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def descendants(pid: int) -> set[int]:
  """Live processes under `pid` (a sandbox's namespaced processes are visible here by their outer pids)."""
  parent: dict[int, int] = {}
  for p in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{p}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if fields[0] != "Z":
      parent[int(p)] = int(fields[1])
  out, frontier = set(), {pid}
  while frontier:
    frontier = {p for p, pp in parent.items() if pp in frontier} - out
    out |= frontier
  return out
