"""Shared by the sharding tests: tiny models filled from numpy (no per-op compiles) and a loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k2jax.model import K2Model, presets

BATCH, LENGTH = 8, 16


@functools.cache
def tiny_model_state(n_experts: int = 8, dead_experts: tuple[int, ...] = (), seed: int = 0):
  """(graphdef, state) of the tiny preset with `n_experts`; random values from numpy.

  `dead_experts` get a balancing bias of -100, so no token ever selects them: the device holding
  only such experts receives no tokens at all.
  """
  cfg = presets.get("tiny", n_routed_experts=n_experts)
  abstract = nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  rng = np.random.default_rng(seed)

  def fill(path, x):
    name = jax.tree_util.keystr(path)
    if "router" in name and "bias" in name:
      bias = np.zeros(x.shape, np.float32)
      bias[..., list(dead_experts)] = -100.0
      return jnp.asarray(bias)
    if name.endswith("scale']") or ".scale" in name:
      return jnp.asarray(1.0 + 0.1 * rng.standard_normal(x.shape), x.dtype)
    return jnp.asarray(0.05 * rng.standard_normal(x.shape), x.dtype)

  return graphdef, jax.tree_util.tree_map_with_path(fill, state)


def batch(seed: int = 1):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, presets.get("tiny").vocab_size, (BATCH, LENGTH)).astype(np.int32)
  cot = rng.standard_normal((BATCH, LENGTH, presets.get("tiny").vocab_size)).astype(np.float32)
  return jnp.asarray(ids), jnp.asarray(cot)


def split_params(graphdef, state):
  model = nnx.merge(graphdef, state)
  return nnx.split(model, nnx.Param, ...)


def loss_and_outputs(graphdef, params, rest, ids, cot):
  """<logits, cot>: every logit gets its own random weight, so every gradient path is exercised."""
  out = nnx.merge(graphdef, params, rest)(ids)
  return jnp.sum(out.logits * cot), out


def next_token_loss(graphdef, params, rest, ids):
  """Mean cross-entropy of predicting ids[:, 1:] (the two-process test's loss)."""
  out = nnx.merge(graphdef, params, rest)(ids)
  logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))
