"""Log-likelihood of a continuation given a context: what multiple-choice tasks (acc, acc_norm) are scored by.

A `Scorer` has one job, `score(context_ids, continuation_ids) -> float`: the summed log-probability of the
continuation's tokens, each given everything before it. Two implementations:
- `ForwardScorer`: the k2jax model's own forward pass over context + continuation (log_softmax, gather,
  sum): exact, and the reference the engine's prompt logprobs are tested against. Used with an embedded model.
- `HttpScorer`: an SGLang-compatible server's prompt logprobs (`/generate` with `return_logprob` and
  `logprob_start_len` = the context's length; `meta_info.input_token_logprobs`), which SGLang and
  `launch/serve.py` compute in the request's prefill. Used with a URL.
The embedded engine computes the same prompt logprobs (`GenerateRequest.logprob_start_len`,
`GenerateResult.input_logprobs`): `EngineScorer` scores through it instead of a separate forward.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k2jax.engine.base import Engine, GenerateRequest, SamplingParams
from k2jax.model.transformer import K2Model
from k2jax.transport import RetryPolicy, call_json

Pair = tuple[Sequence[int], Sequence[int]]


class Scorer(abc.ABC):
  def score(self, context_ids: Sequence[int], continuation_ids: Sequence[int]) -> float:
    """Sum over the continuation's tokens of log p(token | context and the continuation before it)."""
    return self.score_many([(context_ids, continuation_ids)])[0]

  @abc.abstractmethod
  def score_many(self, pairs: Sequence[Pair]) -> list[float]:
    """`score` of each (context, continuation) pair (implementations batch them)."""


def check_pair(context_ids: Sequence[int], continuation_ids: Sequence[int]) -> None:
  if not context_ids:
    raise ValueError("score: the context is empty (the first token has no logprob)")
  if not continuation_ids:
    raise ValueError("score: the continuation is empty")


class ForwardScorer(Scorer):
  """Scores with the model's full forward pass, pairs batched and padded to power-of-two shapes (few compiles).

  Padding goes on the right with segment id 0: attention is causal, so it cannot change a real position."""

  def __init__(self, model: K2Model, max_batch: int = 8, min_len: int = 16):
    self.max_len = model.cfg.max_position_embeddings
    self.max_batch, self.min_len = max_batch, min_len
    graphdef, state = nnx.split(model)

    def token_logprobs(state, ids_BT, segment_BT):
      logits_BTS = nnx.merge(graphdef, state)(ids_BT, segment_BT).logits
      logp_BTS = jax.nn.log_softmax(logits_BTS[:, :-1], axis=-1)
      return jnp.take_along_axis(logp_BTS, ids_BT[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]: token t+1

    self._state = state
    self._fn = jax.jit(token_logprobs)

  def score_many(self, pairs: Sequence[Pair]) -> list[float]:
    out = []
    for i in range(0, len(pairs), self.max_batch):
      out += self._batch(pairs[i : i + self.max_batch])
    return out

  def _batch(self, pairs: Sequence[Pair]) -> list[float]:
    seqs = []
    for ctx, cont in pairs:
      check_pair(ctx, cont)
      seqs.append(list(ctx) + list(cont))
    longest = max(len(s) for s in seqs)
    if longest > self.max_len:
      raise ValueError(f"score: {longest} tokens exceed the model's {self.max_len} positions")
    T = min(_pow2(max(longest, self.min_len)), self.max_len)
    B = _pow2(len(seqs))
    ids_BT, seg_BT = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b, s in enumerate(seqs):
      ids_BT[b, : len(s)], seg_BT[b, : len(s)] = s, 1
    lp_BT = np.asarray(self._fn(self._state, jnp.asarray(ids_BT), jnp.asarray(seg_BT)), np.float64)
    # Token p's logprob sits at column p - 1; the continuation is positions len(ctx) .. len(seq) - 1.
    return [float(lp_BT[b, len(ctx) - 1 : len(s) - 1].sum()) for b, ((ctx, _), s) in enumerate(zip(pairs, seqs))]


class EngineScorer(Scorer):
  """Scores with an engine's prompt logprobs (`logprob_start_len`), computed in the request's prefill.

  An engine that queues requests (`InferenceEngine.submit_many`, then `wait`) gets every pair at once, so
  it admits them a batch of slots at a time and prefills each batch in one scored program; any other
  `Engine` is asked one `generate` at a time."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._calls = itertools.count()  # request ids stay distinct across calls (and threads)

  def score_many(self, pairs: Sequence[Pair]) -> list[float]:
    call = next(self._calls)
    requests = []
    for i, (ctx, cont) in enumerate(pairs):
      check_pair(ctx, cont)
      requests.append(
        GenerateRequest(
          f"score/{id(self)}/{call}/{i}",
          tuple(ctx) + tuple(cont),
          SamplingParams(max_new_tokens=0, temperature=0.0),
          logprob_start_len=len(ctx),
          input_top_logprobs_num=0,  # the tokens' own logprobs only: the cheaper scored program
        )
      )
    submit_many = getattr(self.engine, "submit_many", None)
    if submit_many is None:
      results = [self.engine.generate(r) for r in requests]
    else:
      handles = submit_many(requests)
      try:
        for h in handles:
          if isinstance(h, Exception):
            raise h
        results = [self.engine.wait(h) for h in handles]
      except BaseException:  # nothing keeps running for a caller that is gone
        self.engine.abort([r.rid for r, h in zip(requests, handles) if not isinstance(h, Exception)])
        raise
    out = []
    for (_, cont), result in zip(pairs, results):
      lps = result.input_logprobs
      if len(lps) != len(cont) or any(lp is None for lp in lps):
        raise ValueError(f"score: the engine gave {len(lps)} prompt logprobs for {len(cont)} continuation tokens")
      out.append(float(sum(lps)))
    return out


class HttpScorer(Scorer):
  """Scores through an SGLang-compatible server's `/generate` prompt logprobs (SGLang, `launch/serve.py`)."""

  def __init__(self, url: str, headers: dict | None = None, timeout_s: float = 300.0, retry: RetryPolicy | None = None):
    self.url, self.headers, self.timeout_s = url.rstrip("/"), headers or {}, timeout_s
    self.retry = retry or RetryPolicy()

  def score_many(self, pairs: Sequence[Pair]) -> list[float]:
    return [self._one(ctx, cont) for ctx, cont in pairs]

  def _one(self, ctx: Sequence[int], cont: Sequence[int]) -> float:
    check_pair(ctx, cont)
    payload = {
      "input_ids": list(ctx) + list(cont),
      "return_logprob": True,
      "logprob_start_len": len(ctx),
      # One sampled token: SGLang versions differ on max_new_tokens 0; the sampled one is not read.
      "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
    }

    def parse(body):
      entries = body["meta_info"]["input_token_logprobs"] if isinstance(body, dict) else None
      if not isinstance(entries, list) or len(entries) != len(cont):
        raise ValueError(f"input_token_logprobs: expected {len(cont)} entries, got {entries!r:.200}")
      if [e[1] for e in entries] != list(cont) or any(e[0] is None for e in entries):
        raise ValueError(f"input_token_logprobs do not match the continuation {list(cont)[:8]}")
      return float(sum(e[0] for e in entries))

    return call_json(
      f"{self.url}/generate", payload, timeout_s=self.timeout_s, retry=self.retry, headers=self.headers, validate=parse
    )


def _pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()
