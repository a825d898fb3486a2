"""Conversion between Hugging Face (Kimi-K2 layout) directories, k2jax workdirs and models."""

from k2jax.convert.export_dir import ExportError
from k2jax.convert.hf import CheckpointError, load_hf
from k2jax.convert.writer import save_hf
from k2jax.convert.workdir import is_workdir, restore_model_state, save_model_only

__all__ = [
  "CheckpointError",
  "ExportError",
  "is_workdir",
  "load_hf",
  "restore_model_state",
  "save_hf",
  "save_model_only",
]
