"""Hand the trainer's weights to the rollout engine after an update, without a host round trip.

Colocated (an engine in this process with `update_weights_from_params`, e.g. `k2jax.engine.InferenceEngine`):
the engine gets the trainer's arrays themselves and places them on its own devices (`jax.device_put`, a
no-op when the engine serves on the trainer's placement, a reshard when it does not). Nothing goes to the
host or to disk, and nothing is copied that need not be. The engine may therefore hold the trainer's own
buffers: a trainer that hands its weights to a colocated engine must not donate them to its next step
(`WeightSync.shares_buffers`; `k2jax.train.core.Core.jit(..., donate_params=False)`).

Remote (SGLang over HTTP): HF safetensors on storage both sides see, then `/update_weights_from_disk`.
The files are written by `k2jax.convert.writer` (the one HF writer): every JAX process streams only the
tensors its devices hold into `model-p<process>-<k>.safetensors`, computing each tensor's CRC-32 on the
way; when the CRC equals the one of the weights the engine already holds, the tensor is cut from the
file again (skipped; never on the first push or `push(full=True)`; RL updates change every tensor, so
the write is rarely wasted). After a barrier process 0 writes the index from the files' headers and calls
the engine's `update_weights(dir, version)`. `WeightSyncConfig.dtype='fp8'` pushes the release's
block-FP8 layout (F8_E4M3 + float32 `weight_scale_inv` per 128x128 block, what slime sends SGLang engines
serving the FP8 release): about half the bytes of bfloat16 per push; the engine must serve with the
release's `quantization_config` (it loads the same layout at start-up).
Versions increase by one per push that changed something. The directory `<root>/v<version>/` holds only
changed tensors (slime's `from_disk_delta`, reference §3.1); SGLang's disk loader takes the files listed in
the index. The engine must not be generating during the update (updates run between rollout phases).
A CRC-32 collision (2^-32 per changed tensor) leaves that tensor one push stale: the next push compares it
again.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import jax
import numpy as np

from k2jax import distributed
from k2jax.convert import writer as hf_writer
from k2jax.model.config import K2Config

INDEX_NAME = hf_writer.INDEX


@dataclasses.dataclass(frozen=True)
class WeightSyncConfig:
  root: str  # shared directory visible to trainer and engine (remote engines only)
  max_shard_bytes: int = 4 * 2**30  # each process splits its tensors into files of at most this size
  keep_last: int = 2  # version directories kept on disk (older ones are deleted)
  dtype: str | None = None  # remote pushes: None (param dtype), 'bfloat16', 'float32' or 'fp8' (block-FP8)
  threads: int = 0  # remote pushes: host threads casting / quantizing the tensors (0: two per core)

  def __post_init__(self):
    bad_threads = isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0
    if self.keep_last < 1 or self.max_shard_bytes <= 0 or self.dtype not in (None, *hf_writer.DTYPES) or bad_threads:
      raise ValueError(f"invalid WeightSyncConfig {self}")


class WeightSync:
  """Tracks what the engine holds and the monotonically increasing weight version (see module docstring).

  `engine` is None on the processes of a multi-process run that do not talk to the engine (all but 0).
  """

  def __init__(self, config: WeightSyncConfig, engine: Any, model: K2Config, *, initial_version: int = 0):
    self.config, self.engine, self.model = config, engine, model
    self.version = initial_version
    self.colocated = callable(getattr(engine, "update_weights_from_params", None))
    self._crcs: dict[str, int] = {}  # CRC-32 of each tensor this process wrote, as the engine holds it
    self._writer = hf_writer.Writer(
      model, config.dtype, config.max_shard_bytes, naming="process", threads=config.threads
    )
    self.bytes_written = 0  # tensor bytes of the last remote push, all processes together (process 0)

  @property
  def shares_buffers(self) -> bool:
    """Whether the engine may serve the pushed arrays themselves (the trainer must not donate them); an
    engine on a serving mesh copies them into its own layout (`shares_pushed_buffers` False)."""
    return self.colocated and getattr(self.engine, "shares_pushed_buffers", True)

  def push(self, state: dict, full: bool = False) -> int:
    """Hands `state` (the model's pure state dict, sharded device arrays) to the engine; returns the version."""
    if self.colocated:
      self.version += 1
      self.engine.update_weights_from_params(state, self.version)
      return self.version
    return self._push_remote(state, full)

  # ---- remote: per-process streamed safetensors ----------------------------------------------------
  def _push_remote(self, state: dict, full: bool) -> int:
    version = self.version + 1
    path = os.path.join(self.config.root, f"v{version:08d}")
    tmp = path + ".tmp"
    primary = jax.process_index() == 0
    if primary:
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(tmp)
    distributed.barrier(f"weight_sync_mkdir_{version}")
    try:
      crcs = self._writer.write(state, tmp, skip=lambda name, crc: not full and self._crcs.get(name) == crc)
    except BaseException:  # every process raises (the writer agrees on failures); nothing is served
      if primary:
        shutil.rmtree(tmp, ignore_errors=True)
      raise
    n_written = _global_sum(len(crcs))
    if n_written == 0:  # the engine already holds exactly these weights
      if primary:
        shutil.rmtree(tmp, ignore_errors=True)
      return self.version
    distributed.barrier(f"weight_sync_written_{version}")
    try:
      if primary:
        meta = {"k2jax_weight_version": str(version), "k2jax_delta": str(n_written < self._writer.n_tensors)}
        self.bytes_written = hf_writer.write_index(tmp, meta)
        if os.path.exists(path):  # left over from a failed push of the same version
          shutil.rmtree(path)
        os.replace(tmp, path)
        self.engine.update_weights(path, version)
    except BaseException:
      shutil.rmtree(path, ignore_errors=True)
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    self.version = version
    self._crcs.update(crcs)
    if primary:
      self._prune()
    return version

  def _prune(self) -> None:
    dirs = sorted(d for d in os.listdir(self.config.root) if d.startswith("v") and d[1:].isdigit())
    for d in dirs[: -self.config.keep_last]:
      shutil.rmtree(os.path.join(self.config.root, d), ignore_errors=True)


def _global_sum(n: int) -> int:
  """`n` summed over the JAX processes (a collective: every process calls it)."""
  if jax.process_count() == 1:
    return n
  from jax.experimental import multihost_utils

  return int(np.sum(multihost_utils.process_allgather(np.int32(n))))
