"""Top-level entry points: `k2jax.load(path)` and `k2jax.save_hf(model, dir)`, and the model-source resolver
every loop uses (workdir | HF dir; re-exported by `k2jax.train`)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from k2jax.convert import hf as hf_io
from k2jax.convert import workdir as wd
from k2jax.convert import writer
from k2jax.convert.export_dir import recover
from k2jax.convert.reader import READ_BUDGET_BYTES
from k2jax.convert.tokenizer import export_tokenizer
from k2jax.model.config import EXEC_FIELDS, K2Config
from k2jax.model.transformer import K2Model


def source_kind(src: str) -> str:
  """'workdir' or 'hf' for a model directory; FileNotFoundError naming both markers otherwise."""
  if wd.is_workdir(src):
    return "workdir"
  if os.path.isfile(os.path.join(src, "config.json")):
    return "hf"
  raise FileNotFoundError(f"{src}: neither a k2jax workdir ({wd.MODEL_CONFIG}) nor an HF directory (config.json)")


def source_config(src: str, **exec_kw) -> K2Config:
  """The architecture stored in `src` (workdir or HF dir), with execution knobs `exec_kw` applied."""
  if source_kind(src) == "workdir":
    return wd.read_model_config(src, **exec_kw)
  return hf_io.read_config(src, **exec_kw)


def source_state(
  src: str, cfg: K2Config, shardings: dict | None = None, *, read_budget_bytes: int = READ_BUDGET_BYTES
) -> dict:
  """The model's full pure state dict (Params + RouterBias) stored in `src`, as `cfg` lays it out, as
  jax.Arrays placed per `shardings` (a tree like the state; None: this process's first device). Each
  process reads only its own shards: orbax for a workdir, `convert.reader` for an HF directory (which
  holds at most `read_budget_bytes` of host buffers in flight beyond them)."""
  abstract = hf_io.abstract_state(cfg)
  if shardings is not None:
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  if source_kind(src) == "workdir":
    return wd.restore_model_state(src, abstract)[1]
  return hf_io.read_state(src, cfg, abstract, read_budget_bytes=read_budget_bytes)


def model_from_state(cfg: K2Config, state: dict) -> K2Model:
  """Build a model from a pure state dict without random-initialising it first (device arrays are kept
  where they are; host arrays go to the default device)."""
  abstract = nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  nnx.replace_by_pure_dict(abs_state, jax.tree.map(jnp.asarray, state))
  return nnx.merge(graphdef, abs_state)


def load(path: str, *, read_budget_bytes: int = READ_BUDGET_BYTES, **k2jax_fields) -> K2Model:
  """A model from an HF directory (has config.json; bf16/fp32 or the release's block-FP8) or a k2jax
  workdir (has model_config.json), on this process's first device.

  k2jax_fields override execution knobs, e.g. `load(p, compute_dtype='bfloat16', scan_layers=False)`.
  """
  recover(path)  # an export that died between its two renames on a filesystem without RENAME_EXCHANGE
  cfg = source_config(path, **k2jax_fields)
  return model_from_state(cfg, source_state(path, cfg, read_budget_bytes=read_budget_bytes))


def save_hf(
  model: K2Model,
  dst: str,
  *,
  dtype: str | None = None,
  max_shard_bytes: int = 4 << 30,
  tokenizer_from: str | None = None,
) -> None:
  """Write `model` to `dst` in the published Kimi-K2 HF layout, with its tokenizer (`k2jax.convert.writer`).

  dtype: None (the param dtype), 'float32', 'bfloat16', or 'fp8' (the release's block-FP8 layout, what
  SGLang and vLLM serve). A model sharded over several processes is written by all of them (call it on
  every process; each writes the tensors its devices hold, `dst` on a filesystem they share).
  The tokenizer files (`k2jax/convert/tokenizer.py`) come from `tokenizer_from`'s `tiktoken.model` when
  it has one, else from the bundled BPE when the vocabulary fits, so the export serves text on its own.
  """
  state = nnx.to_pure_dict(nnx.state(model))
  tokenizer = lambda tmp: export_tokenizer(tmp, model.cfg.vocab_size, src=tokenizer_from)  # noqa: E731
  writer.save_hf(model.cfg, state, dst, dtype=dtype, max_shard_bytes=max_shard_bytes, write_extra=tokenizer)
