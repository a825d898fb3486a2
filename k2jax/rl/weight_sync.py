"""Push trainer weights to an engine: HF safetensors on shared storage, then `/update_weights_from_disk`.

Only tensors whose content changed since the last successful push are written (per-tensor blake2b digest),
as a small sharded checkpoint `<root>/v<version>/` with a `model.safetensors.index.json`; SGLang's disk
loader loads whatever tensors the directory holds, so a delta directory updates just those (slime's
`from_disk_delta`, reference §3.1). The first push (and `push(full=True)`, e.g. for a fresh engine replica)
writes every tensor. Versions increase by one per push that changed something.

The engine must see `root` at the same path (shared filesystem) and must not be generating during the
update (reference §2.4: updates run between rollout phases).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Mapping

import numpy as np
from safetensors.numpy import save_file

from k2jax.engine.base import Engine

INDEX_NAME = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class WeightSyncConfig:
  root: str  # shared directory visible to trainer and engine
  max_shard_bytes: int = 4 * 2**30  # split a push into files of at most this size (one tensor may exceed)
  keep_last: int = 2  # version directories kept on disk (older ones are deleted)

  def __post_init__(self):
    if self.keep_last < 1 or self.max_shard_bytes <= 0:
      raise ValueError(f"invalid WeightSyncConfig {self}")


class WeightSync:
  """Tracks what the engine holds (digest per tensor) and the monotonically increasing weight version."""

  def __init__(self, config: WeightSyncConfig, engine: Engine, initial_version: int = 0):
    self.config = config
    self.engine = engine
    self.version = initial_version
    self._digests: dict[str, str] = {}
    os.makedirs(config.root, exist_ok=True)

  def push(self, params: Mapping[str, np.ndarray], full: bool = False) -> int:
    """Writes changed tensors (all if `full` or first push), updates the engine, returns the version."""
    arrays = {name: np.ascontiguousarray(np.asarray(a)) for name, a in params.items()}
    missing = sorted(set(self._digests) - set(arrays))
    if missing:
      raise ValueError(f"WeightSync.push: tensors pushed before are missing now: {missing[:5]}")
    digests = {name: _digest(a) for name, a in arrays.items()}
    changed = [n for n in sorted(arrays) if full or not self._digests or self._digests.get(n) != digests[n]]
    if not changed:
      return self.version  # the engine already holds exactly these weights
    version = self.version + 1
    path = os.path.join(self.config.root, f"v{version:08d}")
    _write_checkpoint(
      path,
      {n: arrays[n] for n in changed},
      self.config.max_shard_bytes,
      {"k2jax_weight_version": str(version), "k2jax_delta": str(len(changed) < len(arrays))},
    )
    try:
      self.engine.update_weights(path, version)
    except BaseException:
      shutil.rmtree(path, ignore_errors=True)
      raise
    self.version = version
    self._digests.update({n: digests[n] for n in changed})
    self._prune()
    return version

  def _prune(self) -> None:
    dirs = sorted(d for d in os.listdir(self.config.root) if d.startswith("v") and d[1:].isdigit())
    for d in dirs[: -self.config.keep_last]:
      shutil.rmtree(os.path.join(self.config.root, d), ignore_errors=True)


def _digest(a: np.ndarray) -> str:
  h = hashlib.blake2b(digest_size=16)
  h.update(f"{a.dtype.str}{a.shape}".encode())
  h.update(memoryview(a.reshape(-1).view(np.uint8)))
  return h.hexdigest()


def _write_checkpoint(path: str, arrays: dict[str, np.ndarray], max_shard_bytes: int, metadata: dict[str, str]) -> None:
  """Writes HF sharded safetensors atomically (into a temp dir renamed at the end)."""
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, a in arrays.items():
    if shards[-1] and size + a.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = a
    size += a.nbytes
  tmp = path + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
    weight_map.update({n: fname for n in shard})
  index = {"metadata": {"total_size": sum(a.nbytes for a in arrays.values()), **metadata}, "weight_map": weight_map}
  with open(os.path.join(tmp, INDEX_NAME), "w") as f:
    json.dump(index, f, indent=1, sort_keys=True)
  if os.path.exists(path):  # left over from a failed push of the same version
    shutil.rmtree(path)
  os.replace(tmp, path)
