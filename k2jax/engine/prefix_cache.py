"""A small LRU of finished sequences' cache rows, keyed by the tokens whose keys/values they hold.

Multi-turn agents resend the whole conversation every turn, so a new request usually starts with a
previous request's prompt + answer. The engine looks up the entry sharing the longest token prefix,
copies its row into the new slot and prefills only the rest (attention is causal: positions before the
common prefix hold exactly what this request would have computed).

A linear scan over a handful of entries is enough here (SGLang's radix tree pays off with thousands
of cached sequences and shared pages; each entry here is one whole cache row).
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np


class PrefixCache:
  """token tuple -> cache row (an opaque device pytree), least recently used evicted first."""

  def __init__(self, capacity: int):
    if capacity < 0:
      raise ValueError(f"PrefixCache capacity must be >= 0, got {capacity}")
    self.capacity = capacity
    self._entries: collections.OrderedDict[tuple[int, ...], Any] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._entries)

  def insert(self, tokens: Sequence[int], row: Any) -> None:
    """Stores `row` for `tokens`; drops entries that are prefixes of it (the new row covers them)."""
    if self.capacity == 0 or not tokens:
      return
    key = tuple(int(t) for t in tokens)
    for old in [k for k in self._entries if len(k) <= len(key) and key[: len(k)] == k]:
      del self._entries[old]
    self._entries[key] = row
    while len(self._entries) > self.capacity:
      self._entries.popitem(last=False)

  def lookup(self, tokens: Sequence[int]) -> tuple[int, Any]:
    """(length of the longest shared prefix, its row), or (0, None); marks the entry recently used."""
    best_len, best_key = 0, None
    query = np.asarray(tokens, np.int64)
    for key in self._entries:
      n = min(len(key), len(query))
      if n <= best_len:
        continue
      diff = np.flatnonzero(np.asarray(key[:n], np.int64) != query[:n])
      common = int(diff[0]) if diff.size else n
      if common > best_len:
        best_len, best_key = common, key
    if best_key is None:
      return 0, None
    self._entries.move_to_end(best_key)
    return best_len, self._entries[best_key]

  def values(self) -> list[Any]:
    return list(self._entries.values())

  def clear(self) -> None:
    self._entries.clear()
