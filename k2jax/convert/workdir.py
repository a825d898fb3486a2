"""k2jax workdirs: `W/model_config.json` (HF config format) + orbax checkpoints in `W/checkpoints/<step>/`.

The model lives in the checkpoint item `model` (the model's pure state dict, balancing bias included);
the training loop adds `opt` and `data` items beside it. Restoring only `model` works on any of them.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from k2jax.convert.export_dir import ExportError, broadcast_text, write_export
from k2jax.model.config import K2Config

MODEL_CONFIG = "model_config.json"
CHECKPOINTS = "checkpoints"


def is_workdir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, MODEL_CONFIG))


def write_model_config(cfg: K2Config, workdir: str) -> None:
  os.makedirs(workdir, exist_ok=True)
  tmp = os.path.join(workdir, MODEL_CONFIG + ".tmp")
  with open(tmp, "w") as f:
    json.dump(cfg.to_hf_dict(), f, indent=2, sort_keys=True)
  os.replace(tmp, os.path.join(workdir, MODEL_CONFIG))


def read_model_config(workdir: str, **k2jax_fields) -> K2Config:
  return K2Config.from_json_file(os.path.join(workdir, MODEL_CONFIG), **k2jax_fields)


def checkpoint_manager(
  workdir: str, *, max_to_keep: int | None = None, save_interval_steps: int = 1, async_save: bool = False
) -> ocp.CheckpointManager:
  opts = ocp.CheckpointManagerOptions(
    max_to_keep=max_to_keep, save_interval_steps=save_interval_steps, enable_async_checkpointing=async_save, create=True
  )
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, CHECKPOINTS)), options=opts)


def save_model_only(cfg: K2Config, state: dict, workdir: str, step: int = 0) -> None:
  """Write a workdir holding just the model (e.g. after converting from HF) as an export: it replaces
  only an earlier such export that training has not added to, atomically (`export_dir`).

  Multi-process (every process calls it with the same sharded `state`): each process writes its own
  orbax shards into the one temporary directory process 0 creates (on a filesystem they all share);
  process 0 then marks and swaps it in, and every process returns (or raises) after that."""

  def write(tmp: str) -> None:
    if jax.process_index() == 0:
      write_model_config(cfg, tmp)
    with checkpoint_manager(tmp) as mgr:
      mgr.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave(state)), force=True)
      mgr.wait_until_finished()

  if jax.process_count() == 1:
    write_export(workdir, "workdir", write)
    return
  if jax.process_index() != 0:
    tmp = broadcast_text("")
    if tmp.startswith("\0"):
      raise ExportError(f"{workdir}: process 0 could not start the export: {tmp[1:]}")
    write(tmp)
    outcome = broadcast_text("")
    if outcome:
      raise ExportError(f"{workdir}: process 0 did not finish the export: {outcome}")
    return
  started = []

  def write0(tmp: str) -> None:
    broadcast_text(tmp)
    started.append(tmp)
    write(tmp)

  try:
    write_export(workdir, "workdir", write0)
  except BaseException as e:
    broadcast_text(f"{type(e).__name__}: {e}" if started else "\0" + f"{type(e).__name__}: {e}")
    raise
  broadcast_text("")  # done: the export is in place


def restore_model_state(workdir: str, abstract: dict, step: int | None = None) -> tuple[int, dict]:
  """Restore item `model` of the latest (or given) step into the structure of `abstract`: onto each leaf's
  `sharding` when it has one, else onto this process's first device (never onto the devices that saved
  it: a checkpoint written by several processes restores in one)."""
  with checkpoint_manager(workdir) as mgr:
    step = mgr.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"{os.path.join(workdir, CHECKPOINTS)}: no checkpoint found")
    here = SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None) or here), abstract
    )
    out = mgr.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(target)))
  return step, out["model"]
