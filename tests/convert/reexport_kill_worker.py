"""SIGKILLs a re-export at every point where it changes the filesystem (test_export_dir.py).

  python reexport_kill_worker.py <repo_root> <dst>
For each mode and for k = 1, 2, ...: `dst` holds export "a" and nothing beside it; a forked child re-exports
"b" and is killed at its k-th point, a point being just before each mkdir, rename, unlink, rmdir or exchange,
and just before and just after each open for writing (the file exists, empty). The modes: RENAME_EXCHANGE,
points counted from the start of the export; the two-rename fallback, from the swap on (what comes before
is the same); over an export from before the MARKER, from its marking on. Then the parent loads `dst` (which
recovers an interrupted two-rename swap), records which export it holds, exports "a" again (cleaning what
the child left) and records the directory's entries. The mode ends at the first k the child outlives.
A writer killed while cleaning a dead writer's sibling leaves the states a writer killed in its own
`remove_export` leaves (a marked export with a prefix of its list deleted, or an unmarked partial one), so
these points cover those too. Prints one JSON line: {mode: [[k, seen, entries], ...]}.
"""

import builtins
import json
import os
import signal
import sys

sys.path.insert(0, sys.argv[1])
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402
from safetensors import safe_open  # noqa: E402

from k2jax.convert import export_dir  # noqa: E402
from k2jax.convert import hf as hf_io  # noqa: E402
from tests.convert.test_export_dir import _numpy_state  # noqa: E402

SHARD_BYTES = 600_000  # three shards: a multi-file index and a partly deleted list, few points
# Where each mode starts counting points (None: at the start of the export).
MODES = {"exchange": None, "two_renames": "_swap_into_place", "before_marker": "_mark_unmarked"}
_EXCHANGE = export_dir._exchange


def arm(k: int, mode: str) -> None:
  """Makes this process SIGKILL itself at its k-th point (see the module docstring)."""
  count = [0 if MODES[mode] is None else -1]  # -1: not counting yet

  def point():
    if count[0] >= 0:
      count[0] += 1
      if count[0] == k:
        os.kill(os.getpid(), signal.SIGKILL)

  def before(fn, start=False):
    def wrapped(*args, **kwargs):
      if start:
        count[0] = max(count[0], 0)
      point()
      return fn(*args, **kwargs)

    return wrapped

  if MODES[mode] is not None:  # export_dir calls its own functions through its globals
    setattr(export_dir, MODES[mode], before(getattr(export_dir, MODES[mode]), start=True))
  for name in ("mkdir", "rename", "unlink", "rmdir"):  # shutil.rmtree and os.makedirs call these too
    setattr(os, name, before(getattr(os, name)))
  real_open = builtins.open

  def open_(file, mode="r", *args, **kwargs):
    if not any(c in mode for c in "wax+"):
      return real_open(file, mode, *args, **kwargs)
    point()
    f = real_open(file, mode, *args, **kwargs)
    point()
    return f

  builtins.open = open_
  export_dir._exchange = before(lambda a, b: False) if mode == "two_renames" else before(_EXCHANGE)


def holds(dst: str, want: dict) -> str:
  hf_io.read_config(dst)  # recovers an interrupted two-rename swap, as every load does
  got = {}
  for shard in sorted(set(hf_io.weight_map(dst).values())):
    with safe_open(os.path.join(dst, shard), "numpy") as f:
      got.update({key: f.get_tensor(key) for key in f.keys()})
  match = [n for n, w in want.items() if set(w) == set(got) and all(np.array_equal(w[k], got[k]) for k in w)]
  return match[0] if len(match) == 1 else "MIXED-OR-BROKEN"


def main(dst: str) -> None:
  cfg, a = _numpy_state(0)
  _, b = _numpy_state(1)
  want = {name: dict(hf_io.iter_hf_tensors(cfg, s, None)) for name, s in (("a", a), ("b", b))}
  hf_io.save_hf(cfg, a, dst, max_shard_bytes=SHARD_BYTES)
  out = {}
  for mode in MODES:
    rows = out[mode] = []
    for k in range(1, 200):
      if mode == "before_marker":
        os.unlink(os.path.join(dst, export_dir.MARKER))
      pid = os.fork()
      if pid == 0:
        arm(k, mode)
        hf_io.save_hf(cfg, b, dst, max_shard_bytes=SHARD_BYTES)
        os._exit(0)
      _, status = os.waitpid(pid, 0)
      seen = holds(dst, want)
      if os.WIFEXITED(status):
        rows.append([k, seen, sorted(os.listdir(os.path.dirname(dst))), os.WEXITSTATUS(status)])
        break
      hf_io.save_hf(cfg, a, dst, max_shard_bytes=SHARD_BYTES)
      rows.append([k, seen, sorted(os.listdir(os.path.dirname(dst)))])
    hf_io.save_hf(cfg, a, dst, max_shard_bytes=SHARD_BYTES)
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[2])
