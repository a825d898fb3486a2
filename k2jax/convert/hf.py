"""Stream a Hugging Face safetensors directory into k2jax parameters, and back.

Import is `reader.py` (each process reads only its own slices; block-FP8 dequantized per slice); its
entry points are re-exported here. Export is `writer.py` (the one HF writer: each process streams the
tensors its devices hold, bf16 / float32 / block-FP8); `save_hf` and `iter_hf_tensors` are re-exported
here for existing callers.
"""

from __future__ import annotations

from k2jax.convert.errors import CheckpointError
from k2jax.convert.hf_dir import (
  INDEX,
  SINGLE,
  abstract_state,
  check_shard_name,
  check_unexpected,
  get_path,
  read_config,
  set_path,
  weight_map,
)
from k2jax.convert.reader import load_hf, read_state
from k2jax.convert.writer import iter_hf_tensors, save_hf

__all__ = [
  "INDEX",
  "SINGLE",
  "CheckpointError",
  "abstract_state",
  "check_shard_name",
  "check_unexpected",
  "iter_hf_tensors",
  "load_hf",
  "read_config",
  "read_state",
  "save_hf",
  "weight_map",
]

_get, _set = get_path, set_path  # the names existing callers use
