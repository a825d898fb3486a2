"""Multi-turn agentic rollouts, token-in/token-out through an RL `Engine`.

One episode keeps ONE growing token list. Each turn sends the whole list to the engine (`input_ids`)
and appends exactly the ids it generated, with loss mask 1. The environment's answer (tool results or
the next user turn) is rendered with the K2 chat template and appended with loss mask 0, followed by
the next `<|im_assistant|>assistant<|im_middle|>` header. Nothing already in the list is ever
re-templated or re-tokenised, so the trained ids are exactly the generated ids (reference
k2-rl-and-serving.md §4.1; verl and Agent-R1 saw decode -> re-encode drift). If a turn stops without
`<|im_end|>` (length, EOS) the runner closes it with an `<|im_end|>` that is not trained.

Since each request's prompt is the previous request plus a few tokens, engines with prefix reuse
(SGLang's radix cache, k2jax.engine's prefix cache) prefill only the new tokens. Episodes run
concurrently on a thread pool (the engine clients are blocking and thread-safe); the reward is the
environment's at the end (task rubric or verifier). `to_rollout_batch` turns trajectories into the
RL learner's `RolloutBatch` (loss mask = generated tokens only).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import zlib
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from k2jax.data.chat import parse_assistant, render_chat
from k2jax.data.tokenizer import Tokenizer
from k2jax.engine.base import Engine, GenerateRequest, SamplingParams
from k2jax.rl.rollout_batch import RolloutBatch, pad_token_rows
from k2jax.transport import ServiceError

if TYPE_CHECKING:  # k2jax.rl.envs imports k2jax.agentic: a runtime import here would be circular
  from k2jax.rl.envs.base import Environment

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
  max_turns: int = 8  # assistant turns per episode
  max_new_tokens_per_turn: int = 256
  max_total_tokens: int = 4096  # prompt + every turn; the episode is truncated beyond it
  temperature: float = 1.0
  top_p: float = 1.0
  concurrency: int = 64  # episodes in flight
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class Turn:
  start: int  # index of the turn's first generated token in Trajectory.tokens
  output_ids: tuple[int, ...]  # exactly what the engine returned
  finish_reason: str


@dataclasses.dataclass
class Trajectory:
  task_id: str
  task: str
  tokens: list[int]
  loss_mask: list[int]
  logprobs: list[float]
  versions: list[int]
  prompt_length: int
  turns: list[Turn] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  end: str = ""  # env_done | max_turns | budget | abort | env_error | engine_error
  info: dict = dataclasses.field(default_factory=dict)

  @property
  def failed(self) -> bool:
    return self.end in ("env_error", "engine_error")

  @property
  def truncated(self) -> bool:
    return self.end in ("max_turns", "budget")


class MultiTurnRunner:
  """Runs episodes of `env_factory()` environments against `engine`."""

  def __init__(
    self,
    engine: Engine,
    tokenizer: Tokenizer,
    env_factory: Callable[[], Environment],
    config: MultiTurnConfig = MultiTurnConfig(),
  ):
    self.engine, self.tok, self.env_factory, self.config = engine, tokenizer, env_factory, config
    sp = tokenizer.special_ids
    self.im_end = sp["<|im_end|>"]
    self.stop_ids = (self.im_end, tokenizer.eos_id)
    self.header = [sp["<|im_assistant|>"], *tokenizer.encode("assistant"), sp["<|im_middle|>"]]

  def run(self, tasks: Sequence[Mapping[str, Any]], rid_prefix: str = "ep") -> list[Trajectory]:
    """Runs every task (in parallel, `config.concurrency` at a time); results in task order."""
    workers = max(1, min(self.config.concurrency, len(tasks)))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="episode") as pool:
      return list(pool.map(lambda it: self.run_episode(it[1], f"{rid_prefix}-{it[0]}"), enumerate(tasks)))

  def run_episode(self, task: Mapping[str, Any], rid: str) -> Trajectory:
    env = self.env_factory()
    try:
      try:
        obs = env.reset(task)
      except ServiceError as e:  # the environment service failed (a pool restarts it): skip this episode
        return Trajectory(
          str(task.get("id", rid)),
          str(task.get("task", "agentic")),
          [],
          [],
          [],
          [],
          0,
          end="env_error",
          info={"error": str(e)[:500]},
        )
      ids, _ = render_chat(obs["messages"], obs.get("tools"), tokenizer=self.tok, add_generation_prompt=True)
      traj = Trajectory(
        str(task.get("id", rid)),
        str(task.get("task", "agentic")),
        list(ids),
        [0] * len(ids),
        [0.0] * len(ids),
        [-1] * len(ids),
        len(ids),
      )
      self._loop(env, traj, rid)
      return traj
    finally:
      env.close()

  def _loop(self, env: Environment, traj: Trajectory, rid: str) -> None:
    cfg = self.config
    for turn in range(cfg.max_turns):
      budget = cfg.max_total_tokens - len(traj.tokens) - 1  # keep room for a closing <|im_end|>
      if budget <= 0:
        traj.end = "budget"
        return
      sampling = SamplingParams(
        max_new_tokens=min(cfg.max_new_tokens_per_turn, budget),
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        stop_token_ids=self.stop_ids,
        seed=(cfg.seed * 1_000_003 + zlib.crc32(rid.encode()) + turn) % 2**31,
      )
      try:
        res = self.engine.generate(GenerateRequest(f"{rid}-t{turn}", tuple(traj.tokens), sampling))
      except (ServiceError, RuntimeError, ValueError) as e:
        traj.end, traj.info["error"] = "engine_error", str(e)[:500]
        return
      out = list(res.output_ids)
      traj.turns.append(Turn(len(traj.tokens), tuple(out), res.finish_reason))
      traj.tokens += out
      traj.loss_mask += [1] * len(out)
      traj.logprobs += list(res.output_logprobs)
      traj.versions += list(res.weight_versions)
      if res.finish_reason == "abort":
        traj.end = "abort"
        return
      if not out or out[-1] != self.im_end:  # close the turn: not generated, not trained
        traj.tokens, traj.loss_mask = traj.tokens + [self.im_end], traj.loss_mask + [0]
        traj.logprobs, traj.versions = traj.logprobs + [0.0], traj.versions + [-1]
      step = env.step(self._action(out))
      if "env_error" in step.info:
        traj.end, traj.info["error"] = "env_error", step.info["env_error"]
        return
      if step.done:
        traj.reward, traj.end, traj.info = step.reward, "env_done", dict(step.info)
        return
      obs_ids = self._observation_ids(step.observation.get("messages") or [])
      traj.tokens += obs_ids
      traj.loss_mask += [0] * len(obs_ids)
      traj.logprobs += [0.0] * len(obs_ids)
      traj.versions += [-1] * len(obs_ids)
    traj.end = "max_turns"

  def _action(self, out: list[int]) -> dict:
    body = out[:-1] if out and out[-1] in self.stop_ids else out
    try:
      return parse_assistant(body, tokenizer=self.tok)
    except (ValueError, TypeError) as e:  # ids the tokenizer cannot decode: the env reports it
      return {"role": "assistant", "content": "", "tool_call_error": f"undecodable turn: {e}"}

  def _observation_ids(self, messages: list[dict]) -> list[int]:
    if not messages:
      return list(self.header)
    ids, _ = render_chat(messages, tokenizer=self.tok, add_generation_prompt=True)
    return ids


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
