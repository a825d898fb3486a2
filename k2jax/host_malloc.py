"""Keep the buffers XLA:CPU frees in the process heap (glibc malloc options), for the launchers and bench/.

XLA:CPU mallocs a step's temporaries and frees them when the step ends. glibc serves blocks above its mmap
threshold (128 KiB, raised on the fly up to 32 MiB) with fresh `mmap`s and unmaps them on free, and gives
the heap's free top back to the OS past its trim threshold (128 KiB): so every step page-faults its
temporaries in again, as zero-filled pages from the kernel. Which blocks are mmapped depends on the
process's allocation history (the dynamic threshold), so two runs of one program could differ by a third.
Measured (`bench/moe.py --one_device --reps=7`, 2 cores, fwd+bwd per call, 3 processes each): the tiny
MoE layer 2.9, 2.9 and 2.1 ms with glibc's defaults, 2.1, 2.0 and 2.2 ms with both thresholds at 1 GiB;
the small layer 766, 767 and 741 ms against 696, 695 and 709 ms.

The cost: memory freed by a step stays with the process (its RSS stays at its peak), what a training
process holding its working set for hours wants anyway. `mallopt` is glibc's documented interface
(mallopt(3)); the `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` environment variables do the same,
but only for a process started with them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30


def keep_freed_memory(threshold: int = THRESHOLD) -> bool:
  """Raise glibc's mmap and trim thresholds to `threshold` bytes; False where that is not glibc (or it
  refused), changing nothing."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):  # musl and other libcs have no mallopt
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  return bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD, threshold))
