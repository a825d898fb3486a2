"""Prompt scoring in the prefill: the program that prefills whole prompts and returns, from the same forward
pass, each prompt token's logprob and every position's top logprobs (what `/v1/completions` echo, `/generate`
`logprob_start_len` and `k2jax.eval.scoring.EngineScorer` read); `requests.apply_scores` hands its output to
the requests.

A scored row always starts at position 0 of its slot (no prefix reuse: every position's logits come from
this pass), so the program reads no cache row: each token attends to the new tokens before it only
(`decode.hidden_fresh`, attention over the bucket's T tokens rather than the row's max_len), and the new
tokens' cache entries are then written at positions 0..n-1 of their slots, so decoding continues from the
prompt exactly as after a plain prefill. Log-softmax is never written out as [R, T, S]: the logits are shifted
by each position's logsumexp only where they are read (the next token's logit, the top logits); with one top
logprob asked for (lm-eval's `logprobs: 1`) the top is the max the logsumexp computes anyway and its argmax,
not a top_k. Single device only (`ModelRunner.scores_prompts`).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from k2jax.engine import decode
from k2jax.engine.sampling import sample


def jit_scored(graphdef, num_top: int) -> dict[int, Callable]:
  """The scored prefill jitted per count of prompt top logprobs: 1 (likelihood scoring) and num_top.
  Each: (state, cache, slots_R, tokens_RT, positions_RT, last_index_R, sampling) ->
  ((Sampled, (token_lp [R, T-1], top_ids [R, T, k], top_lp [R, T, k])), cache), the cache donated."""
  return {
    k: jax.jit(functools.partial(scored_prefill, graphdef, num_top, k), donate_argnums=(1,))
    for k in sorted({1, max(num_top, 1)})
  }


def scored_prefill(
  graphdef, num_top, prompt_top, state, cache, slots_R, tokens_RT, positions_RT, last_index_R, sampling
):
  """Prefills R whole prompts (positions 0..n-1, padding at max_len) into slots_R and scores them.

  The sampled row is the one at last_index_R (what the plain prefill samples there, from the same logits
  up to rounding); next_RT[r, t] is the logprob of token t + 1 given tokens 0..t; the top logprobs of
  position t are the distribution over token t + 1 (prompt_top of them, most likely first)."""
  model = nnx.merge(graphdef, state)
  max_len = jax.tree.leaves(cache)[0].shape[2]
  dtype = jax.tree.leaves(cache)[0].dtype
  x_RTD, entries = decode.hidden_fresh(model, tokens_RT, positions_RT, max_len, dtype)
  cache = write_fresh(cache, entries, slots_R, positions_RT < max_len)
  logits_RTS = decode.lm_logits(model, x_RTD)
  logits_RS = jnp.take_along_axis(logits_RTS, last_index_R[:, None, None], axis=1)[:, 0]
  max_RT, argmax_RT = max_argmax(logits_RTS) if prompt_top == 1 else (jnp.max(logits_RTS, axis=-1), None)
  lse_RT = max_RT + jnp.log(jnp.sum(jnp.exp(logits_RTS - max_RT[..., None]), axis=-1))
  next_RT = jnp.take_along_axis(logits_RTS[:, :-1], tokens_RT[:, 1:, None], axis=-1)[..., 0] - lse_RT[:, :-1]
  if prompt_top == 1:
    top_ids = argmax_RT[..., None]
    top_lp = (max_RT - lse_RT)[..., None]
  else:
    top_logits, top_ids = jax.lax.top_k(logits_RTS, prompt_top)
    top_lp = top_logits - lse_RT[..., None]
  return (sample(logits_RS, sampling, num_top), (next_RT, top_ids, top_lp)), cache


def max_argmax(x, block: int = 64):
  """(max, argmax) over the last axis, the argmax the first index holding the max (`jnp.argmax`'s), exact.

  XLA's CPU argmax is a two-operand (value, index) reduction, about as slow again as the max and logsumexp
  passes over the logits together (bench/eval.py's [8, 64, 4096]: 2.5 ms of 15). Here the one pass over
  the logits is a plain max over blocks of `block` entries; the argmax then runs on the block maxima (the
  first block holding the max) and on that block's entries alone: 1/block of the work each."""
  V = x.shape[-1]
  if V % block or V <= block:
    return jnp.max(x, axis=-1), jnp.argmax(x, axis=-1).astype(jnp.int32)
  blocks = x.reshape(*x.shape[:-1], V // block, block)
  block_max = jnp.max(blocks, axis=-1)
  b = jnp.argmax(block_max, axis=-1).astype(jnp.int32)
  inside = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]
  return jnp.max(block_max, axis=-1), b * block + jnp.argmax(inside, axis=-1).astype(jnp.int32)


def write_fresh(cache: dict, entries: dict, slots_R, valid_RT) -> dict:
  """Writes each row's new cache entries ([L, R, T, X]) at positions 0..T-1 of slot slots_R[r], keeping the
  row's old values where valid_RT is False (padding tokens: the plain prefill drops their writes too).
  Padding rows (all invalid) repeat a real row's slot and write its old values back, before the real rows."""
  R, T = valid_RT.shape

  def put(a, new):
    for r in reversed(range(R)):
      start = (0, slots_R[r], 0, 0)
      old = jax.lax.dynamic_slice(a, start, (a.shape[0], 1, T, a.shape[3]))
      row = jnp.where(valid_RT[r][None, None, :, None], new[:, r : r + 1].astype(a.dtype), old)
      a = jax.lax.dynamic_update_slice(a, row, start)
    return a

  return {name: jax.tree.map(put, cache[name], entries[name]) for name in cache}
