"""Top-level entry points: `k2jax.load(path)` and `k2jax.save_hf(model, dir)`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k2jax.convert import hf as hf_io
from k2jax.convert.export_dir import recover
from k2jax.model.config import K2Config
from k2jax.model.transformer import K2Model
from k2jax.train.init_from import source_config, source_state


def model_from_state(cfg: K2Config, state: dict) -> K2Model:
  """Build a model from a pure state dict without random-initialising it first (device arrays are kept
  where they are; host arrays go to the default device)."""
  abstract = nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  nnx.replace_by_pure_dict(abs_state, jax.tree.map(jnp.asarray, state))
  return nnx.merge(graphdef, abs_state)


def load(path: str, **k2jax_fields) -> K2Model:
  """A model from an HF directory (has config.json) or a k2jax workdir (has model_config.json).

  k2jax_fields override execution knobs, e.g. `load(p, compute_dtype='bfloat16', scan_layers=False)`.
  """
  recover(path)  # an export that died between its two renames on a filesystem without RENAME_EXCHANGE
  cfg = source_config(path, **k2jax_fields)
  return model_from_state(cfg, source_state(path, cfg))


def save_hf(model: K2Model, dst: str, *, dtype: str | None = None, max_shard_bytes: int = 4 << 30) -> None:
  """Write `model` to `dst` in the published Kimi-K2 HF layout (float32 or bfloat16)."""
  hf_io.save_hf(model.cfg, nnx.to_pure_dict(nnx.state(model)), dst, dtype=dtype, max_shard_bytes=max_shard_bytes)
