"""The trainer's record of finished rollouts (`RolloutBatch`) and the padding that builds it from token rows."""

from __future__ import annotations

import dataclasses

import numpy as np


def pad_token_rows(rows, *, pad_id: int) -> dict[str, np.ndarray]:
  """Right-pad per-sample token rows into RolloutBatch's [B, T] arrays.

  `rows`: (tokens, loss_mask, logprobs, versions) per sample, four sequences of one length each
  (prompt + response, with 0 / 0.0 / -1 on untrained positions). Returns tokens_BT, segment_ids_BT,
  loss_mask_BT, engine_logprobs_BT and weight_versions_BT.
  """
  B = len(rows)
  T = max((len(r[0]) for r in rows), default=1)
  out = dict(
    tokens_BT=np.full((B, T), pad_id, np.int32),
    segment_ids_BT=np.zeros((B, T), np.int32),
    loss_mask_BT=np.zeros((B, T), np.float32),
    engine_logprobs_BT=np.zeros((B, T), np.float32),
    weight_versions_BT=np.full((B, T), -1, np.int32),
  )
  for b, (tokens, mask, logprobs, versions) in enumerate(rows):
    n = len(tokens)
    out["tokens_BT"][b, :n], out["segment_ids_BT"][b, :n] = tokens, 1
    out["loss_mask_BT"][b, :n], out["engine_logprobs_BT"][b, :n] = mask, logprobs
    out["weight_versions_BT"][b, :n] = versions
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutBatch:
  """A trainer-ready batch of finished samples, right-padded to a common length T.

  Position t of `engine_logprobs_BT` holds log p(tokens[b, t] | tokens[b, :t]) as reported by the engine
  (0 on prompt and padding), so a trainer that recomputes logprobs must shift its logits by one.
  `group_ids_B` are dense 0..G-1; samples of one group answered the same prompt.
  """

  tokens_BT: np.ndarray  # int32 prompt + response ids, pad_id after
  segment_ids_BT: np.ndarray  # int32 1 on prompt+response, 0 on padding (model convention)
  loss_mask_BT: np.ndarray  # float32 1 on generated response tokens
  engine_logprobs_BT: np.ndarray  # float32 behaviour-policy logprobs from the engine
  weight_versions_BT: np.ndarray  # int32 policy version per response token, -1 elsewhere
  rewards_B: np.ndarray  # float32 final reward (truncation penalty included)
  group_ids_B: np.ndarray  # int32
  prompt_lengths_B: np.ndarray  # int32
  response_lengths_B: np.ndarray  # int32
  truncated_B: np.ndarray  # bool: hit the task token budget
  tasks: tuple[str, ...]
  iteration: int
  temperature: float

  def __post_init__(self):
    B, T = self.tokens_BT.shape
    for name in ("segment_ids_BT", "loss_mask_BT", "engine_logprobs_BT", "weight_versions_BT"):
      if getattr(self, name).shape != (B, T):
        raise ValueError(f"RolloutBatch.{name} has shape {getattr(self, name).shape}, want {(B, T)}")
    for name in ("rewards_B", "group_ids_B", "prompt_lengths_B", "response_lengths_B", "truncated_B"):
      if getattr(self, name).shape != (B,):
        raise ValueError(f"RolloutBatch.{name} has shape {getattr(self, name).shape}, want {(B,)}")
    if len(self.tasks) != B:
      raise ValueError(f"RolloutBatch.tasks has {len(self.tasks)} entries, want {B}")

  @property
  def num_groups(self) -> int:
    return int(self.group_ids_B.max()) + 1 if self.group_ids_B.size else 0
