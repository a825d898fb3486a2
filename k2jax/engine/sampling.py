"""Per-row token sampling (temperature, top-k, top-p, seeds) with the logprobs the API reports.

Reported logprobs follow SGLang's default: log-softmax of logits / temperature, before top-k/top-p
truncation (greedy rows, temperature 0, report the plain log-softmax). At temperature 1 these are the
model's log-probabilities, which is what RL's pi_old needs.

Randomness: row b draws with key fold_in(key(seed_b), position_b), where position_b is the index of the
token being sampled in its whole sequence (prompt included). A request's samples therefore depend only on
its seed and its own logits, not on which other requests share the batch (continuous batching stays
reproducible), and a request resumed from `prompt + generated` with the same seed draws exactly what the
uninterrupted request would have drawn next (partial rollout; sglang-jax's `multinomial_with_seed` is
keyed by (seed, position) too).

The noise is drawn per token id (Gumbel-max over the vocabulary in id order; top-k/top-p only mask), so a
sample is continuous in the logits: logits that differ by rounding (another device layout, process count or
batch shape gives 1-ulp differences) change it only where the two best perturbed scores are that close, about
1e-6 of draws. Noise drawn per sorted rank handed a near-tied pair's draws to each other whenever rounding
swapped their order: 14 of 10240 draws flipped under +-5e-7 logit noise at the tiny model's logit spread
(0 per id), and tests/rl/test_rl_colocated.py's 2-process rollouts lost a token to it on a 2-core AMD host.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class SamplingArrays(NamedTuple):
  """Per-row sampling parameters, as device arrays [B]."""

  temperature: jnp.ndarray  # float32; <= 0 means greedy
  top_p: jnp.ndarray  # float32 in (0, 1]
  top_k: jnp.ndarray  # int32; <= 0 means no limit
  seed: jnp.ndarray  # uint32
  position: jnp.ndarray  # int32: index of the token being sampled in its sequence (prompt + output)


class Sampled(NamedTuple):
  tokens: jnp.ndarray  # [B] int32
  logprobs: jnp.ndarray  # [B] float32
  top_ids: jnp.ndarray  # [B, N] int32: the N most likely tokens
  top_logprobs: jnp.ndarray  # [B, N] float32


def sampling_arrays(temperature, top_p, top_k, seed, position) -> SamplingArrays:
  """Host lists/arrays -> SamplingArrays with the dtypes the compiled steps expect."""
  return SamplingArrays(
    np.asarray(temperature, np.float32),
    np.asarray(top_p, np.float32),
    np.asarray(top_k, np.int32),
    np.asarray(seed, np.uint32),
    np.asarray(position, np.int32),
  )


def sample(logits_BS: jnp.ndarray, params: SamplingArrays, num_top: int) -> Sampled:
  """Draws one token per row; jit-friendly (all parameters are arrays)."""
  S = logits_BS.shape[-1]
  greedy_B = params.temperature <= 0
  temp_B = jnp.where(greedy_B, 1.0, params.temperature)
  scaled_BS = logits_BS / temp_B[:, None]
  logp_BS = jax.nn.log_softmax(scaled_BS, axis=-1)
  argmax_B = jnp.argmax(logits_BS, axis=-1)

  def drawn():
    # top-k/top-p on the sorted distribution; one sort serves both filters.
    order_BS = jnp.argsort(-scaled_BS, axis=-1)
    sorted_BS = jnp.take_along_axis(scaled_BS, order_BS, axis=-1)
    probs_BS = jax.nn.softmax(sorted_BS, axis=-1)
    mass_before_BS = jnp.cumsum(probs_BS, axis=-1) - probs_BS
    k_B = jnp.where(params.top_k > 0, params.top_k, S)
    keep_BS = (jnp.arange(S)[None] < k_B[:, None]) & (mass_before_BS < params.top_p[:, None])
    # The kept set goes back to token-id order, and the noise is drawn there (module docstring: per id).
    rows_B1 = jnp.arange(keep_BS.shape[0])[:, None]
    keep_ids_BS = jnp.zeros_like(keep_BS).at[rows_B1, order_BS].set(keep_BS)
    masked_BS = jnp.where(keep_ids_BS, scaled_BS, -jnp.inf)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(params.seed, params.position)
    return jax.vmap(jax.random.categorical)(keys, masked_BS).astype(argmax_B.dtype)

  # An all-greedy step (greedy decoding, prompt scoring) skips the sort over the vocabulary: it is most of
  # a step's sampling cost, and every row takes the argmax anyway.
  sampled_B = jax.lax.cond(jnp.all(greedy_B), lambda: argmax_B, drawn)
  tokens_B = jnp.where(greedy_B, argmax_B, sampled_B).astype(jnp.int32)
  logprobs_B = jnp.take_along_axis(logp_BS, tokens_B[:, None], axis=-1)[:, 0]
  top_lp_BN, top_ids_BN = jax.lax.top_k(logp_BS, num_top)
  return Sampled(tokens_B, logprobs_B, top_ids_BN.astype(jnp.int32), top_lp_BN)
