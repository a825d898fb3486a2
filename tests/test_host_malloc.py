"""k2jax.host_malloc: glibc keeps the buffers XLA:CPU frees (the launchers call it first thing)."""

import platform
import sys

import numpy as np
import pytest

from k2jax import host_malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_sets_glibc_thresholds_and_allocation_still_works():
  assert host_malloc.keep_freed_memory() is True
  # Blocks below the new mmap threshold come from the heap now; they still allocate, fill and free.
  for n in (1 << 20, 64 << 20):
    a = np.ones(n // 8)
    assert float(a.sum()) == n // 8
    del a


def test_keep_freed_memory_changes_nothing_off_linux(monkeypatch):
  monkeypatch.setattr(sys, "platform", "darwin")
  assert host_malloc.keep_freed_memory() is False
