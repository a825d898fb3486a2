"""Top-level entry points: `k2jax.load(path)` and `k2jax.save_hf(model, dir)`."""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx

from k2jax.convert import hf as hf_io
from k2jax.convert import workdir as wd
from k2jax.convert.export_dir import recover
from k2jax.convert.tokenizer import export_tokenizer
from k2jax.model.config import K2Config
from k2jax.model.transformer import K2Model


def model_from_state(cfg: K2Config, state: dict) -> K2Model:
  """Build a model from a pure state dict without random-initialising it first."""
  abstract = nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  nnx.replace_by_pure_dict(abs_state, jax_tree_asarray(state))
  return nnx.merge(graphdef, abs_state)


def jax_tree_asarray(state: dict) -> dict:
  import jax

  return jax.tree.map(jnp.asarray, state)


def load(path: str, **k2jax_fields) -> K2Model:
  """A model from an HF directory (has config.json) or a k2jax workdir (has model_config.json).

  k2jax_fields override execution knobs, e.g. `load(p, compute_dtype='bfloat16', scan_layers=False)`.
  """
  recover(path)  # an export that died between its two renames on a filesystem without RENAME_EXCHANGE
  if wd.is_workdir(path):
    cfg = wd.read_model_config(path, **k2jax_fields)
    _, state = wd.restore_model_state(path, hf_io.abstract_state(cfg))
    return model_from_state(cfg, state)
  if os.path.isfile(os.path.join(path, "config.json")):
    cfg, state = hf_io.load_hf(path, **k2jax_fields)
    return model_from_state(cfg, state)
  raise FileNotFoundError(f"{path}: neither a k2jax workdir ({wd.MODEL_CONFIG}) nor an HF directory (config.json)")


def save_hf(
  model: K2Model,
  dst: str,
  *,
  dtype: str | None = None,
  max_shard_bytes: int = 4 << 30,
  tokenizer_from: str | None = None,
) -> None:
  """Write `model` to `dst` in the published Kimi-K2 HF layout (float32 or bfloat16), with its tokenizer.

  The tokenizer files (`k2jax/convert/tokenizer.py`) come from `tokenizer_from`'s `tiktoken.model` when
  it has one, else from the bundled BPE when the vocabulary fits, so the export serves text on its own.
  """
  hf_io.save_hf(model.cfg, nnx.to_pure_dict(nnx.state(model)), dst, dtype=dtype, max_shard_bytes=max_shard_bytes)
  export_tokenizer(dst, model.cfg.vocab_size, src=tokenizer_from)
