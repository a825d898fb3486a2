"""Top XLA ops of a jitted call, from a `jax.profiler` trace: what `--profile` in bench/ prints.

  ops = trace_ops.top_ops(lambda: jax.block_until_ready(fn(*args)), compiled.as_text(), calls=2)

Traces `calls` blocking calls, reads the trace's perfetto JSON (the XLA:CPU thunk executor records one
event per executed HLO instruction, with its name in `args.hlo_op`), and sums each instruction's
self time (its duration less the events nested in it on the same thread: a while loop or conditional
counts only its own bookkeeping). Each row: the instruction, its opcode and the source (`op_name`
metadata) from the compiled HLO text, calls, and its share of the traced wall time. Thunks of one
executable can run concurrently on the thread pool, so shares may sum past 1.
"""

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*[^=]*?\s([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_index(hlo_text: str) -> dict[str, tuple[str, str]]:
  """instruction name -> (opcode, op_name metadata), from compiled HLO text."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if m:
      src = _OP_NAME.search(line)
      out[m.group(1).lstrip("%")] = (m.group(2), src.group(1) if src else "")
  return out


def _self_times(events) -> collections.Counter:
  """Self time (us) per hlo_op: each event's duration less its directly nested events (same thread)."""
  by_tid = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {}):
      by_tid[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["args"]["hlo_op"]))
  self_us, calls = collections.Counter(), collections.Counter()
  for evs in by_tid.values():
    evs.sort(key=lambda t: (t[0], -t[1]))
    stack = []  # [end, name, self]
    for start, end, name in evs:
      while stack and stack[-1][0] <= start:
        e, n, s = stack.pop()
        self_us[n] += s
      if stack:
        stack[-1][2] -= end - start
      stack.append([end, name, end - start])
      calls[name] += 1
    for e, n, s in stack:
      self_us[n] += s
  return self_us, calls


def phase(src: str) -> str:
  """'backward' / 'forward' / 'other' (outside autodiff: the optimizer update) from an op's source."""
  return "backward" if "transpose(jvp" in src else "forward" if "jvp(" in src else "other"


def top_ops(call, hlo_text: str, *, calls: int = 1, n: int = 25, log_dir: str | None = None):
  """([(share of wall time, self ms per call, calls per call, name, opcode, source)] for the top n,
  traced wall ms per call, {(phase, 'dot' | 'other'): share of wall time} over every op)."""
  log_dir = log_dir or tempfile.mkdtemp(prefix="k2jax_trace_")
  t = time.perf_counter()
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    for _ in range(calls):
      call()
  wall_us = 1e6 * (time.perf_counter() - t)
  path = max(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True), key=os.path.getmtime)
  with gzip.open(path) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  self_us, ncalls = _self_times(events)
  index = hlo_index(hlo_text)
  rows, kinds = [], collections.Counter()
  for name, us in self_us.most_common():
    opcode, src = index.get(name, ("?", ""))
    is_dot = opcode == "dot" or (opcode == "fusion" and "dot_general" in src and name.startswith("ynn"))
    kinds[(phase(src), "dot" if is_dot else "other")] += us / wall_us
    if len(rows) < n:
      rows.append((us / wall_us, us / 1e3 / calls, ncalls[name] / calls, name, opcode, src))
  return rows, wall_us / 1e3 / calls, dict(kinds)


def print_top(label: str, rows, wall_ms: float, kinds: dict | None = None) -> None:
  print(f"{label}_profile_wall_ms={wall_ms:.1f} (top ops by self time; share of the traced wall time)")
  for share, ms, c, name, opcode, src in rows:
    print(f"  {share:6.1%} {ms:9.1f}ms x{c:<5g} {name:32.32s} {opcode:14.14s} {src[-90:]}")
  print(f"  {sum(r[0] for r in rows):6.1%} in these {len(rows)}")
  if kinds:
    print("  by phase and kind: " + " ".join(f"{p}_{k}={v:.1%}" for (p, k), v in sorted(kinds.items())), flush=True)
