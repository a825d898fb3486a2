"""Sample and group state carried across rollout iterations, and assembly of the trainer's RolloutBatch."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Future
from typing import Sequence

import numpy as np

from k2jax.agentic.rollout import Trajectory
from k2jax.rl.rollout_batch import RolloutBatch, pad_token_rows
from k2jax.grading.base import Completion, Prompt, RewardResult


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
  # Multi-turn episodes: the environment's first observation (the prompt actually sent), the loss mask over
  # the response (0 on tool results and user turns) and the episode's end (env_reward, end, env details).
  episode_prompt: tuple[int, ...] | None = None
  mask: list[int] | None = None
  info: dict = dataclasses.field(default_factory=dict)

  @property
  def prompt_ids(self) -> tuple[int, ...]:
    return self.episode_prompt if self.episode_prompt is not None else self.prompt.input_ids

  @property
  def done(self) -> bool:
    return self.finish is not None

  def reset(self) -> int:
    """Drops all generated tokens (stale beyond the bound); returns how many were dropped."""
    n = len(self.output_ids)
    self.output_ids, self.logprobs, self.versions, self.text_parts = [], [], [], []
    self.finish, self.truncated, self.segments = None, False, 0
    self.episode_prompt, self.mask, self.info = None, None, {}
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
  return Completion(tuple(sample.output_ids), text, sample.finish or "abort", sample.truncated, dict(sample.info))


def build_batch(
  groups: Sequence[Group],
  rewards: Sequence[Sequence[RewardResult]],
  *,
  pad_id: int,
  truncation_penalty: float,
  iteration: int,
  temperature: float,
) -> RolloutBatch:
  """Right-pads prompt+response of every sample; subtracts the truncation penalty (K2 §3.2.3 budget control).
  Episode samples keep their loss mask (environment tokens inside the response are not trained)."""
  samples = [s for g in groups for s in g.samples]
  rows = []
  for s in samples:
    P, R = len(s.prompt_ids), len(s.output_ids)
    rows.append(
      (
        list(s.prompt_ids) + s.output_ids,
        [0.0] * P + ([1.0] * R if s.mask is None else [float(m) for m in s.mask]),
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
    prompt_lengths_B=np.array([len(s.prompt_ids) for s in samples], np.int32),
    response_lengths_B=np.array([len(s.output_ids) for s in samples], np.int32),
    truncated_B=truncated_B,
    tasks=tuple(s.prompt.task for s in samples),
    iteration=iteration,
    temperature=temperature,
  )


def append_rollouts(path: str, batch: RolloutBatch, weight_version: int) -> None:
  """Appends every sample of `batch` to the jsonl at `path`: task, reward, prompt length, tokens and loss mask
  (prompt and response), so masks and rewards can be inspected per sample after a run."""
  with open(path, "a", encoding="utf-8") as f:
    for b in range(len(batch.rewards_B)):
      n = int(batch.prompt_lengths_B[b] + batch.response_lengths_B[b])
      record = {
        "iteration": batch.iteration,
        "weight_version": weight_version,
        "task": batch.tasks[b],
        "group": int(batch.group_ids_B[b]),
        "reward": float(batch.rewards_B[b]),
        "truncated": bool(batch.truncated_B[b]),
        "prompt_length": int(batch.prompt_lengths_B[b]),
        "tokens": batch.tokens_BT[b, :n].tolist(),
        "loss_mask": batch.loss_mask_BT[b, :n].astype(int).tolist(),
        "logprobs": batch.engine_logprobs_BT[b, :n].tolist(),  # the engine's, 0 on the prompt
        "weight_versions": batch.weight_versions_BT[b, :n].tolist(),  # -1 on the prompt
      }
      f.write(json.dumps(record) + "\n")


def to_rollout_batch(
  trajectories: Sequence[Trajectory],
  *,
  group_ids: Sequence[int] | None = None,
  pad_id: int = 0,
  iteration: int = 0,
  temperature: float = 1.0,
) -> RolloutBatch:
  """Right-padded `RolloutBatch`; loss mask 1 only on generated tokens (tool results and user turns 0).

  Failed trajectories (engine or environment errors) must be filtered out by the caller first: their
  reward says nothing about the policy.
  """
  bad = [t.task_id for t in trajectories if t.failed]
  if bad:
    raise ValueError(f"to_rollout_batch: failed trajectories {bad[:5]} must be dropped first")
  B = len(trajectories)
  rows = [(t.tokens, t.loss_mask, t.logprobs, t.versions) for t in trajectories]
  gids = np.arange(B, dtype=np.int32) if group_ids is None else np.asarray(group_ids, np.int32)
  return RolloutBatch(
    **pad_token_rows(rows, pad_id=pad_id),
    rewards_B=np.array([t.reward for t in trajectories], np.float32),
    group_ids_B=gids,
    prompt_lengths_B=np.array([t.prompt_length for t in trajectories], np.int32),
    response_lengths_B=np.array([len(t.tokens) - t.prompt_length for t in trajectories], np.int32),
    truncated_B=np.array([t.truncated for t in trajectories], bool),
    tasks=tuple(t.task for t in trajectories),
    iteration=iteration,
    temperature=temperature,
  )
