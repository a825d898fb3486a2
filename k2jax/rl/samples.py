"""Sample and group state carried across rollout iterations, and assembly of the trainer's RolloutBatch."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Sequence

import numpy as np

from k2jax.rl.rollout_batch import RolloutBatch, pad_token_rows
from k2jax.rl.rewards.base import Completion, Prompt, RewardResult


@dataclasses.dataclass
class Sample:
  """One response being generated; grows by appending engine segments (partial rollout)."""

  prompt: Prompt
  index: int  # position in its group
  seed: int  # sampling seed, kept across resumes
  output_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  text_parts: list[str] = dataclasses.field(default_factory=list)
  finish: str | None = None  # "stop" | "length" once done
  truncated: bool = False
  segments: int = 0  # engine calls that contributed tokens

  @property
  def done(self) -> bool:
    return self.finish is not None

  def reset(self) -> int:
    """Drops all generated tokens (stale beyond the bound); returns how many were dropped."""
    n = len(self.output_ids)
    self.output_ids, self.logprobs, self.versions, self.text_parts = [], [], [], []
    self.finish, self.truncated, self.segments = None, False, 0
    return n


@dataclasses.dataclass
class Group:
  """K samples of one prompt; complete when all are done; rewards are scored once, asynchronously."""

  uid: int
  prompt: Prompt
  samples: list[Sample]
  born_iteration: int
  rewards: Future | None = None  # Future[Sequence[RewardResult]]

  @property
  def complete(self) -> bool:
    return all(s.done for s in self.samples)


def completion_of(sample: Sample, decode) -> Completion:
  text = decode(sample.output_ids) if decode is not None else "".join(sample.text_parts)
  return Completion(tuple(sample.output_ids), text, sample.finish or "abort", sample.truncated)


def build_batch(
  groups: Sequence[Group],
  rewards: Sequence[Sequence[RewardResult]],
  *,
  pad_id: int,
  truncation_penalty: float,
  iteration: int,
  temperature: float,
) -> RolloutBatch:
  """Right-pads prompt+response of every sample; subtracts the truncation penalty (K2 §3.2.3 budget control)."""
  samples = [s for g in groups for s in g.samples]
  rows = []
  for s in samples:
    P, R = len(s.prompt.input_ids), len(s.output_ids)
    rows.append(
      (
        list(s.prompt.input_ids) + s.output_ids,
        [0.0] * P + [1.0] * R,
        [0.0] * P + list(s.logprobs),
        [-1] * P + list(s.versions),
      )
    )
  truncated_B = np.array([s.truncated for s in samples], bool)
  raw_B = np.array([r.reward for rs in rewards for r in rs], np.float32)
  return RolloutBatch(
    **pad_token_rows(rows, pad_id=pad_id),
    rewards_B=raw_B - truncation_penalty * truncated_B.astype(np.float32),
    group_ids_B=np.repeat(np.arange(len(groups), dtype=np.int32), [len(g.samples) for g in groups]),
    prompt_lengths_B=np.array([len(s.prompt.input_ids) for s in samples], np.int32),
    response_lengths_B=np.array([len(s.output_ids) for s in samples], np.int32),
    truncated_B=truncated_B,
    tasks=tuple(s.prompt.task for s in samples),
    iteration=iteration,
    temperature=temperature,
  )
