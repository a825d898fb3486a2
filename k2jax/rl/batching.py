"""RolloutBatch -> the trainer's fixed-shape arrays, with every bad sample masked out and counted.

The train step compiles once for [B, T] = [target_groups * group_size, train.seq_len]; a batch is
right-padded to that shape (padding rows have sample_mask 0). A sample is *bad*, and gets sample_mask 0
so it contributes neither to its group's mean reward nor to the loss, when any of these hold:

  span         its segment ids are not exactly prompt + response as the lengths say, or its loss mask
               leaves that response span, or does not cover the response's first and last tokens
               (e.g. a logprob list shorter or longer than the response). Holes inside the span are
               allowed: multi-turn samples mask out tool results and user turns.
  logprob      an engine logprob on a response token is non-finite or > 0, or one is set off the response
  version      a trained (generated) response token has no weight version (-1) or one newer than the trainer's
  token        a token id is outside the vocabulary
  reward       the reward is not finite
  too_long     prompt + response do not fit train.seq_len
"""

from __future__ import annotations

import collections

import numpy as np

from k2jax.rl.rollout_batch import RolloutBatch

CHECKS = ("span", "logprob", "version", "token", "reward", "too_long")


def sample_problems(batch: RolloutBatch, b: int, *, vocab_size: int, seq_len: int, version: int) -> list[str]:
  """The names (from CHECKS) of every check sample `b` fails; empty when it is fit to train on."""
  P, R = int(batch.prompt_lengths_B[b]), int(batch.response_lengths_B[b])
  T = batch.tokens_BT.shape[1]
  problems = []
  want_mask = np.zeros(T, bool)
  want_mask[P : P + R] = True
  seg = batch.segment_ids_BT[b] > 0
  mask = batch.loss_mask_BT[b] > 0
  if (
    P < 1
    or R < 1
    or P + R > T
    or np.any(mask & ~want_mask)
    or not (mask[P] and mask[P + R - 1])
    or not np.array_equal(seg, np.arange(T) < P + R)
  ):
    problems.append("span")
  lp = batch.engine_logprobs_BT[b]
  resp = want_mask & (batch.loss_mask_BT[b] > 0)
  if not np.all(np.isfinite(lp[resp])) or np.any(lp[resp] > 1e-4) or np.any(lp[~want_mask] != 0):
    problems.append("logprob")
  v = batch.weight_versions_BT[b][resp]
  if v.size and (v.min() < 0 or v.max() > version):
    problems.append("version")
  tok = batch.tokens_BT[b][seg]
  if tok.size and (tok.min() < 0 or tok.max() >= vocab_size):
    problems.append("token")
  if not np.isfinite(batch.rewards_B[b]):
    problems.append("reward")
  if P + R > seq_len:
    problems.append("too_long")
  return problems


def empty_train_arrays(*, rows: int, seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
  """The train step's arrays with every row masked out (shapes and dtypes of `to_train_arrays`)."""
  return {
    "tokens_BT": np.full((rows, seq_len), pad_id, np.int32),
    "segment_ids_BT": np.zeros((rows, seq_len), np.int32),
    "loss_mask_BT": np.zeros((rows, seq_len), np.float32),
    "engine_logprobs_BT": np.zeros((rows, seq_len), np.float32),
    "rewards_B": np.zeros((rows,), np.float32),
    "group_ids_B": np.zeros((rows,), np.int32),
    "sample_mask_B": np.zeros((rows,), np.float32),
  }


def to_train_arrays(
  batch: RolloutBatch, *, rows: int, seq_len: int, vocab_size: int, version: int, pad_id: int = 0
) -> tuple[dict[str, np.ndarray], collections.Counter]:
  """Fixed-shape arrays for the train step and a Counter of dropped samples per failed check.

  Keys: tokens_BT, segment_ids_BT, loss_mask_BT, engine_logprobs_BT, rewards_B, group_ids_B,
  sample_mask_B. Bad samples keep their row (so groups stay aligned) but are zeroed and masked.
  """
  B = len(batch.rewards_B)
  if B > rows:
    raise ValueError(f"rollout batch has {B} samples but the train step takes {rows} rows (target_groups * group_size)")
  out = empty_train_arrays(rows=rows, seq_len=seq_len, pad_id=pad_id)
  dropped: collections.Counter = collections.Counter()
  for b in range(B):
    problems = sample_problems(batch, b, vocab_size=vocab_size, seq_len=seq_len, version=version)
    out["group_ids_B"][b] = batch.group_ids_B[b]
    if problems:
      dropped.update(problems)
      dropped["samples"] += 1
      continue
    n = min(seq_len, batch.tokens_BT.shape[1])
    out["tokens_BT"][b, :n] = batch.tokens_BT[b, :n]
    out["segment_ids_BT"][b, :n] = batch.segment_ids_BT[b, :n]
    out["loss_mask_BT"][b, :n] = batch.loss_mask_BT[b, :n]
    out["engine_logprobs_BT"][b, :n] = batch.engine_logprobs_BT[b, :n]
    out["rewards_B"][b] = batch.rewards_B[b]
    out["sample_mask_B"][b] = 1.0
  return out, dropped


def staleness(batch: RolloutBatch, version: int) -> dict[str, float]:
  """How many versions behind `version` the trained tokens were sampled (partial rollouts resume).

  Only versions the engine confirmed count; `unknown_version_token_frac` is the share of trained tokens
  whose server named no version. With none confirmed there is no staleness_* at all (unknown, not 0).
  """
  v_all = batch.weight_versions_BT[batch.loss_mask_BT > 0]
  v = v_all[v_all >= 0]
  out = {"unknown_version_token_frac": float(np.mean(v_all < 0)) if v_all.size else 0.0}
  if not v_all.size:
    return {**out, "staleness_mean": 0.0, "staleness_max": 0.0, "stale_token_frac": 0.0}
  if not v.size:
    return out
  lag = version - v
  return {
    **out,
    "staleness_mean": float(lag.mean()),
    "staleness_max": float(lag.max()),
    "stale_token_frac": float(np.mean(lag > 0)),
  }


def engine_logprob_gap(
  arrays: dict[str, np.ndarray], batch: RolloutBatch, trainer_logprobs_BT: np.ndarray, version: int
) -> float | None:
  """Max |engine - trainer| logprob over the trained tokens the engine sampled with weight version `version`
  (the weights the trainer holds while recomputing pi_old): ~0 for an engine that serves exactly the trainer's
  weights. None when no trained token comes from that version."""
  B, T = len(batch.rewards_B), min(arrays["tokens_BT"].shape[1], batch.tokens_BT.shape[1])
  fresh = (arrays["loss_mask_BT"][:B, :T] > 0) & (arrays["sample_mask_B"][:B, None] > 0)
  fresh &= batch.weight_versions_BT[:B, :T] == version
  if not fresh.any():
    return None
  gap = np.abs(np.asarray(trainer_logprobs_BT)[:B, :T] - arrays["engine_logprobs_BT"][:B, :T])
  return float(gap[fresh].max())
