"""Saving and restoring the data iterator with the training checkpoint (grain + orbax).

The iterator state is grain's small JSON dict (indices, not data); restoring it into a freshly built
iterator of the same pipeline (same config, process count and grain version) continues the stream
exactly. With an orbax `CheckpointManager`, put the iterator in the composite as one item:

  mngr.save(step, args=ocp.args.Composite(state=..., data=save_args(it)))
  mngr.restore(step, args=ocp.args.Composite(state=..., data=restore_args(it)))

grain's `CheckpointHandler` writes one `process_{i}-of-{n}.json` per JAX process.
"""

from __future__ import annotations

import json
import os

import grain
from etils import epath


def save_args(it: grain.DatasetIterator):
  """Orbax save args for the data iterator (`grain.checkpoint.CheckpointSave`)."""
  return grain.checkpoint.CheckpointSave(it)


def restore_args(it: grain.DatasetIterator):
  """Orbax restore args that set `it`'s state in place (`grain.checkpoint.CheckpointRestore`)."""
  return grain.checkpoint.CheckpointRestore(it)


def save_state(it: grain.DatasetIterator, directory: str) -> None:
  """Writes `it`'s state into `directory` without orbax (same files as the orbax handler)."""
  os.makedirs(directory, exist_ok=True)
  grain.checkpoint.CheckpointHandler().save(epath.Path(directory), item=it)


def restore_state(it: grain.DatasetIterator, directory: str) -> grain.DatasetIterator:
  """Sets `it`'s state from `directory`; raises FileNotFoundError naming it if nothing is there."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no data-iterator checkpoint directory: {directory}")
  try:
    return grain.checkpoint.CheckpointHandler().restore(epath.Path(directory), item=it)
  except ValueError as e:
    raise FileNotFoundError(f"data-iterator checkpoint in {directory}: {e}") from e


def state_to_json(it: grain.DatasetIterator) -> str:
  return json.dumps(it.get_state())


def state_from_json(it: grain.DatasetIterator, text: str) -> None:
  it.set_state(json.loads(text))
