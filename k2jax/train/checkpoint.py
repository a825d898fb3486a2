"""Training checkpoints: orbax `CheckpointManager` items beside the workdir's `model` item.

  W/checkpoints/<step>/model   the model's full pure state dict (Params + RouterBias): `k2jax.load(W)`
                  /opt     {"opt_state", "step", "skipped_steps"}
                  /data    grain iterator state, one `process_{i}-of-{n}.json` per JAX process
                           (absent for loops without a grain iterator, e.g. RL)
                  /meta    JSON: host-side state (spike detector window, RL iteration counters, ...)
                           plus `checkpoint_step`, the directory's step (RL counts iterations, not
                           optimizer steps, so the step number is not always `opt.step`)

Saves are asynchronous (arrays are copied to host, then written in the background); a step directory
appears only once complete, so a crash mid-write leaves the previous checkpoints intact. The restore
order lives in `restore_latest`: newest step first; a step that fails to read is reported by path and
the next older one is tried. Once one restores, the newer unreadable ones are moved to
`W/checkpoints_corrupt/` (later saves of those step numbers must not collide with them). When none
restores, nothing is moved: `UnreadableCheckpoints` names each one and why it failed, unless the run asked
for `checkpoint.on_unreadable='fresh'`, which moves them all aside and starts from step 0.

Arrays restore straight into the target shapes, shardings and dtypes, so a checkpoint written on one
mesh shape restores onto another, and one written with another `model.param_dtype` is cast (params and
optimizer state alike, to the dtypes a fresh run with this config would have; a log line says so).
"""

from __future__ import annotations

import collections
import glob
import json
import logging
import os
import re
import shutil
from typing import Any, NamedTuple

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from k2jax import distributed
from k2jax.convert import workdir as wd
from k2jax.train.config import ON_UNREADABLE
from k2jax.train.metrics import say
from k2jax.train.step import TrainState


class UnreadableCheckpoints(RuntimeError):
  """Every checkpoint of a workdir failed to restore (and the run did not ask to start fresh)."""


class Restored(NamedTuple):
  state: TrainState
  meta: dict
  data_restored: bool  # False when the saved iterator was from a different process count


class _FrozenIteratorState:
  """The iterator state taken at save time: the async writer must not see later batches."""

  def __init__(self, it: grain.DatasetIterator):
    self._text = json.dumps(it.get_state(), indent=1)

  def get_state(self) -> bytes:
    return self._text.encode()


class Checkpointer:
  """Save / restore of the whole training state (see module docstring)."""

  def __init__(self, workdir: str, *, keep: int, async_save: bool):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, wd.CHECKPOINTS)
    self._keep, self._async = keep, async_save
    self.mgr = self._manager()

  def _manager(self) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(max_to_keep=self._keep, enable_async_checkpointing=self._async, create=True)
    return ocp.CheckpointManager(self.directory, options=opts)

  def save(self, step: int, state: TrainState, data_iter, meta: dict) -> None:
    """Start saving `state` at `step` (returns once arrays are on host, unless async is off).
    `data_iter` is the grain iterator to resume, or None for a loop that keeps its data position in `meta`."""
    items = dict(
      model=ocp.args.StandardSave(merge_dicts(state.params, state.bias)),
      opt=ocp.args.StandardSave(
        {"opt_state": state.opt_state, "step": state.step, "skipped_steps": state.skipped_steps}
      ),
      meta=ocp.args.JsonSave({**meta, "checkpoint_step": step}),
    )
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(_FrozenIteratorState(data_iter))
    self.mgr.save(step, args=ocp.args.Composite(**items), force=True)

  def reached_preemption(self, step: int) -> bool:
    """True on every host once the cluster saw a preemption notice (multi-host SIGTERM sync)."""
    return self.mgr.reached_preemption(step)

  def wait(self) -> None:
    self.mgr.wait_until_finished()

  def close(self) -> None:
    self.mgr.wait_until_finished()
    self.mgr.close()

  def restore_latest(self, abstract: TrainState, data_iter=None, *, on_unreadable: str) -> Restored | None:
    """Restore the newest readable checkpoint into `abstract`'s shapes, shardings and dtypes; None when
    there is none. `data_iter` (when given) is restored in place. When checkpoints exist but none restores:
    `on_unreadable='error'` raises UnreadableCheckpoints (nothing moved), `'fresh'` moves them aside."""
    if on_unreadable not in ON_UNREADABLE:
      raise ValueError(f"checkpoint.on_unreadable: one of {ON_UNREADABLE}, got {on_unreadable!r}")
    start = data_iter.get_state() if data_iter is not None else None  # a failed attempt may have moved it
    failed: list[tuple[int, str]] = []
    for step in sorted(self.mgr.all_steps(), reverse=True):
      try:
        restored = self._restore(step, abstract, data_iter)
      except Exception as e:  # orbax/tensorstore raise many types for truncated or corrupt files.
        failed.append((step, _why(e)))
        logging.error("checkpoint %s is unreadable (%s)", self._path(step), failed[-1][1])
        continue
      if failed:
        say(
          f"checkpoint(s) {', '.join(self._path(s) for s, _ in failed)} unreadable; resuming from the newest "
          f"readable one, {self._path(step)}"
        )
      for bad, _ in failed:
        self._quarantine(bad)
      return restored
    if not failed:
      return None
    listing = "\n".join(f"  {self._path(s)}: {why}" for s, why in failed)
    if on_unreadable == "error":
      raise UnreadableCheckpoints(
        f"no checkpoint in {self.directory} restores; nothing was moved or overwritten:\n{listing}\n"
        "Fix the cause above (a config that changed the model's shapes, a missing or damaged file), or start "
        "over from step 0 with --config.checkpoint.on_unreadable=fresh (moves them to "
        f"{os.path.join(self.workdir, 'checkpoints_corrupt')})"
      )
    say(f"no checkpoint restores (checkpoint.on_unreadable='fresh'): starting from step 0\n{listing}")
    for bad, _ in failed:
      self._quarantine(bad)
    if data_iter is not None:
      data_iter.set_state(start)
    return None

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _restore(self, step: int, abstract: TrainState, data_iter) -> Restored:
    model_abs = merge_dicts(abstract.params, abstract.bias)
    opt_abs = {"opt_state": abstract.opt_state, "step": abstract.step, "skipped_steps": abstract.skipped_steps}
    items = dict(
      model=ocp.args.StandardRestore(model_abs), opt=ocp.args.StandardRestore(opt_abs), meta=ocp.args.JsonRestore()
    )
    data_ok = data_iter is not None and self._data_matches(step)
    if data_ok:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    out = self.mgr.restore(step, args=ocp.args.Composite(**items))
    params, bias = split_dict(out["model"], abstract.params)
    opt = out["opt"]
    state = TrainState(
      step=opt["step"], params=params, bias=bias, opt_state=opt["opt_state"], skipped_steps=opt["skipped_steps"]
    )
    saved_step = out["meta"].get("checkpoint_step", int(state.step))
    if saved_step != step:
      raise ValueError(f"meta.checkpoint_step={saved_step} does not match the directory step {step}")
    cast = _dtype_changes(os.path.join(self._path(step), "model"), model_abs)
    if cast:
      say(
        f"checkpoint {self._path(step)}: model stored as {cast}; restored cast to this run's model.param_dtype, "
        "the optimizer state cast to match (the dtypes a fresh run of this config has)"
      )
    return Restored(state, dict(out["meta"]), data_ok)

  def _data_matches(self, step: int) -> bool:
    """Whether the saved iterator states fit this run's process count (else data restarts)."""
    files = glob.glob(os.path.join(self.directory, str(step), "data", "process_*-of-*.json"))
    counts = {int(m.group(1)) for f in files if (m := re.search(r"-of-(\d+)\.json$", f))}
    if not files:
      raise FileNotFoundError(f"{os.path.join(self.directory, str(step), 'data')}: no iterator state")
    if counts != {jax.process_count()}:
      logging.warning(
        "checkpoint %s: data iterator saved by %s processes, this run has %d; the "
        "data pipeline restarts with a step-offset seed instead of resuming exactly",
        os.path.join(self.directory, str(step)),
        sorted(counts),
        jax.process_count(),
      )
      return False
    return True

  def _quarantine(self, step: int) -> None:
    """Move a bad step aside so later saves of that step number do not collide with it."""
    if jax.process_index() == 0:
      dst = os.path.join(self.workdir, "checkpoints_corrupt", str(step))
      if os.path.exists(dst):
        shutil.rmtree(dst)
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), dst)
      logging.error("moved unreadable checkpoint to %s", dst)
    distributed.barrier(f"quarantine_{step}")
    self.mgr.close()
    self.mgr = self._manager()


def _dtype_changes(item_dir: str, target: Any) -> str:
  """'float32 -> bfloat16 (31 arrays)' for the stored arrays whose dtype differs from `target`'s; '' if none."""
  stored = jax.tree_util.tree_flatten_with_path(ocp.StandardCheckpointHandler().metadata(epath.Path(item_dir)))[0]
  want = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
  pairs = collections.Counter(
    (str(m.dtype), str(want[k])) for p, m in stored if (k := jax.tree_util.keystr(p)) in want and m.dtype != want[k]
  )
  return ", ".join(f"{a} -> {b} ({n} arrays)" for (a, b), n in sorted(pairs.items()))


def _why(e: Exception) -> str:
  """`Type: first line` of an exception (orbax's messages run to pages)."""
  first = str(e).strip().splitlines()[0] if str(e).strip() else ""
  return f"{type(e).__name__}: {first}" if first else type(e).__name__


def merge_dicts(a: dict, b: dict) -> dict:
  """Deep union of two nested dicts with disjoint leaves (params + bias -> the model's state dict)."""
  out = dict(a)
  for k, v in b.items():
    out[k] = merge_dicts(out[k], v) if k in out and isinstance(v, dict) else v
  return out


def split_dict(full: dict, like: dict) -> tuple[dict, dict]:
  """(the part of `full` with `like`'s keys, the rest): the inverse of merge_dicts."""
  inside, rest = {}, {}
  for k, v in full.items():
    if k in like and isinstance(v, dict):
      inside[k], r = split_dict(v, like[k])
      if r:
        rest[k] = r
    elif k in like:
      inside[k] = v
    else:
      rest[k] = v
  return inside, rest


def abstract_like(tree: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the target shardings (orbax restores straight into them)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
