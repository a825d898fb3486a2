"""The engine's device work as a command stream, so several JAX processes issue identical programs.

A serving mesh that spans processes runs each compiled step as one SPMD program: every process must call
the same steps with the same host inputs in the same order. Process 0 (the leader) owns the request
queue and makes every scheduling decision; each device operation it decides on is one command, which it
broadcasts (`multihost_utils.broadcast_one_to_all` of one fixed-shape int32 array: one compile, one small
all-reduce per command) and then runs; every other process (a follower) runs a loop that receives the
next command and runs it. Both sides run a command through the same `_run`, so they cannot disagree.

  SAVE    slot, entry          copy a finished slot's cache row into prefix entry `entry`
  KEEP    n, entries[n]        drop every prefix row but these (LRU eviction, flushes)
  PREFILL A; per row: slot, entry, start, n, sampling[5]; then the A rows' tokens, concatenated
          (the requests admitted in one step, one program; entry >= 0: copy its row into the slot first)
  DECODE  sampling and token/position per slot
  UPDATE  version, flush, n; the weights' path (n bytes of UTF-8): every process reads its own shards
          of it (`on_update`, the engine's; a process that cannot read it fails the update everywhere)
  PAUSE / CLOSE                the followers' loop returns (between RL phases / at shutdown)

With one process nothing is broadcast: the leader just runs each command.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from k2jax.engine.runner import ModelRunner
from k2jax.engine.sampling import Sampled, SamplingArrays, sampling_arrays

log = logging.getLogger(__name__)

SAVE, KEEP, PREFILL, DECODE, PAUSE, CLOSE, UPDATE = range(1, 8)
_HEADER = 16
_ROW = 9  # a PREFILL row's fields: slot, entry, start, n, 5 sampling words


class Executor:
  """Runs commands on `runner`; the leader broadcasts each one first when `processes` > 1."""

  def __init__(self, runner: ModelRunner, *, prefix_entries: int, leader: bool, processes: int):
    self.runner, self.leader, self.processes = runner, leader, processes
    self.rows: dict[int, dict] = {}  # prefix entry id -> cache row (device arrays)
    self.on_update = None  # (path, version, flush_cache) -> version: runs an UPDATE (the engine's)
    n = runner.num_slots
    self._width = _HEADER + max(_ROW * n + runner.max_prefill_tokens, 7 * n, prefix_entries)

  # ---- leader side ------------------------------------------------------------------------------
  def save(self, slot: int, entry: int) -> None:
    self._send([SAVE, slot, entry])

  def keep(self, entries) -> None:
    entries = sorted(entries)
    if set(entries) != set(self.rows):
      self._send([KEEP, len(entries)], entries)

  def prefill(self, rows: list[tuple[int, int, int, list[int]]], s: SamplingArrays) -> Sampled:
    """Prefills `rows` ((slot, entry, start, tokens) each; entry -1 = no prefix row) in one program;
    `s` holds a sampling row per row. Returns the sampled rows, in order."""
    fields = [[slot, entry, start, len(tokens), *_bits(s, i)] for i, (slot, entry, start, tokens) in enumerate(rows)]
    payload = [v for f in fields for v in f] + [t for *_, tokens in rows for t in tokens]
    return self._send([PREFILL, len(rows)], payload)

  def decode(self, tokens_N: np.ndarray, positions_N: np.ndarray, s: SamplingArrays) -> Sampled:
    n = self.runner.num_slots
    payload = np.concatenate([tokens_N, positions_N] + [_as_int32(np.asarray(a)) for a in s]).astype(np.int32)
    assert payload.size == 7 * n
    return self._send([DECODE], payload)

  def update(self, path: str, version: int, flush_cache: bool) -> int:
    raw = path.encode()
    words = np.frombuffer(raw + b"\0" * (-len(raw) % 4), np.int32)
    if words.size > self._width - _HEADER:
      raise ValueError(
        f"weights path of {len(raw)} bytes: the engine's commands carry at most {4 * (self._width - _HEADER)}"
      )
    return self._send([UPDATE, version, int(flush_cache), len(raw)], words)

  def pause(self) -> None:
    self._send([PAUSE])

  def close(self) -> None:
    self._send([CLOSE])

  def _send(self, head, payload=()):
    msg = np.zeros(self._width, np.int32)
    msg[: len(head)] = head
    payload = np.asarray(payload, np.int32)
    msg[_HEADER : _HEADER + payload.size] = payload
    if self.processes > 1:
      self._broadcast(msg)
    return self._run(msg)

  # ---- follower side ----------------------------------------------------------------------------
  def follow(self) -> int:
    """Runs the leader's commands until it pauses or closes; returns PAUSE or CLOSE."""
    while True:
      msg = self._broadcast(np.zeros(self._width, np.int32))
      kind = int(msg[0])
      if kind in (PAUSE, CLOSE):
        return kind
      try:
        self._run(msg)
      except Exception:
        # The leader ran this same command (same program, same inputs) and met the same error; it decides
        # what comes next (fails the request, prefills a failed batch one row at a time), and this loop
        # runs that. A follower whose loop ended here would leave the leader's next broadcast hanging.
        log.exception("engine command %d failed on process %d; following the leader", kind, jax.process_index())

  def _broadcast(self, msg: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(msg, is_source=self.leader))

  # ---- both sides -------------------------------------------------------------------------------
  def _run(self, msg: np.ndarray):
    kind, body = int(msg[0]), msg[_HEADER:]
    r = self.runner
    if kind == SAVE:
      row = r.read_row(int(msg[1]))
      # Across processes every program with collectives finishes before the next starts (several in
      # flight at once deadlocked CPU processes over gloo, jax 0.10.2); prefill/decode block on their output.
      self.rows[int(msg[2])] = jax.block_until_ready(row) if self.processes > 1 else row
    elif kind == KEEP:
      keep = {int(e) for e in body[: int(msg[1])]}
      for e in [e for e in self.rows if e not in keep]:
        del self.rows[e]
    elif kind == PREFILL:
      return self._prefill(int(msg[1]), body)
    elif kind == DECODE:
      n = r.num_slots
      cols = body[: 7 * n].reshape(7, n)
      s = sampling_arrays(cols[2].view(np.float32), cols[3].view(np.float32), cols[4], cols[5].view(np.uint32), cols[6])
      return r.decode(cols[0], cols[1], s)
    elif kind == UPDATE:
      path = body.view(np.uint8)[: int(msg[3])].tobytes().decode()
      return self.on_update(path, int(msg[1]), bool(msg[2]))
    elif kind not in (PAUSE, CLOSE):
      raise ValueError(f"unknown engine command {kind}")
    return None

  def _prefill(self, A: int, body: np.ndarray) -> Sampled:
    r = self.runner
    fields = body[: _ROW * A].reshape(A, _ROW)
    n_A = fields[:, 3]
    tokens_AL = np.full((A, int(n_A.max())), -1, np.int32)
    offset = _ROW * A
    for i, (slot, entry, _, n) in enumerate(fields[:, :4]):
      if entry >= 0:
        r.write_row(int(slot), self.rows[int(entry)])
      tokens_AL[i, :n] = body[offset : offset + n]
      offset += n
    s = fields[:, 4:]
    s = np.ascontiguousarray(s.T)
    sampling = sampling_arrays(s[0].view(np.float32), s[1].view(np.float32), s[2], s[3].view(np.uint32), s[4])
    return r.prefill(fields[:, 0], tokens_AL, fields[:, 2], sampling)


def _as_int32(a: np.ndarray) -> np.ndarray:
  """The 32 bits of `a` (float32, uint32 or int32) as int32, so one int array carries them all."""
  return np.ascontiguousarray(a).view(np.int32) if a.dtype.itemsize == 4 else a.astype(np.int32)


def _bits(s: SamplingArrays, row: int) -> list[int]:
  return [int(_as_int32(np.asarray(a)[row : row + 1])[0]) for a in s]
