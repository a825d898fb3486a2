"""Multi-turn agentic rollouts, token-in/token-out through an RL `Engine` (`TokenAgent`, the RL agent of
the one tool loop, `agentic.loop.run_tool_loop`).

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
environment's at the end (task rubric or verifier). The RL side turns trajectories into its
`RolloutBatch` (`k2jax.rl.samples.to_rollout_batch`; the rollout manager runs episodes through
`EpisodeRunner`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import zlib
from typing import Any, Callable, Mapping, Sequence

from k2jax.data.chat import parse_assistant, render_chat
from k2jax.data.tokenizer import Tokenizer
from k2jax.engine.base import Engine, GenerateRequest, SamplingParams
from k2jax.agentic.envs.base import Environment
from k2jax.agentic.loop import EpisodeEnd, StopEpisode, run_tool_loop
from k2jax.transport import ServiceError

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
  """Runs episodes of `env_factory()` environments against `engine` through `run_tool_loop`."""

  def __init__(
    self,
    engine: Engine,
    tokenizer: Tokenizer,
    env_factory: Callable[[], Environment],
    config: MultiTurnConfig = MultiTurnConfig(),
  ):
    self.engine, self.tok, self.env_factory, self.config = engine, tokenizer, env_factory, config

  def run(self, tasks: Sequence[Mapping[str, Any]], rid_prefix: str = "ep") -> list[Trajectory]:
    """Runs every task (in parallel, `config.concurrency` at a time); results in task order."""
    workers = max(1, min(self.config.concurrency, len(tasks)))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="episode") as pool:
      return list(pool.map(lambda it: self.run_episode(it[1], f"{rid_prefix}-{it[0]}"), enumerate(tasks)))

  def run_episode(
    self,
    task: Mapping[str, Any],
    rid: str,
    *,
    temperature: float | None = None,
    seed: int | None = None,
    response_budget: int | None = None,
  ) -> Trajectory:
    """One episode. `temperature` and `seed` override the config's; `response_budget` caps the tokens after
    the prompt (generated turns and environment answers together: the task's K2 token budget). An environment
    that raises (its grader, its service) ends the episode with `env_error` and the error, which the RL batch
    drops and counts; an invalid task (ValueError or KeyError) propagates."""
    cfg = self.config
    agent = TokenAgent(
      self.engine,
      self.tok,
      rid,
      task,
      max_new_tokens_per_turn=cfg.max_new_tokens_per_turn,
      max_total_tokens=cfg.max_total_tokens,
      response_budget=response_budget,
      temperature=cfg.temperature if temperature is None else temperature,
      top_p=cfg.top_p,
      seed=cfg.seed if seed is None else seed,
    )
    env = self.env_factory()
    try:
      result = run_tool_loop(agent, env, task, int(task.get("max_turns", cfg.max_turns)))
    except (ValueError, KeyError):
      raise  # an invalid task: the caller's data
    except Exception as e:  # noqa: BLE001  the environment failed (e.g. its grader): no verdict, never a crash
      why = f"{type(e).__name__}: {e}"[:500]
      log.warning("episode %s: the environment raised %s", rid, why)
      result = EpisodeEnd("env_error", 0.0, len(agent.trajectory.turns), {"error": why})
    finally:
      env.close()
    traj = agent.trajectory
    traj.end, traj.reward, traj.info = result.end, result.reward, dict(result.info)
    return traj


class TokenAgent:
  """The RL side of `run_tool_loop`: ONE growing token list, token-in/token-out through an `Engine`.

  Turn `i` sends the whole list as `input_ids` (request id `{rid}-t{i}`) and appends exactly the generated
  ids (loss mask 1); `observe` renders the environment's messages with the chat template and appends them
  with loss mask 0, then the next assistant header."""

  def __init__(
    self,
    engine: Engine,
    tokenizer: Tokenizer,
    rid: str,
    task: Mapping[str, Any],
    *,
    max_new_tokens_per_turn: int,
    max_total_tokens: int,
    response_budget: int | None,
    temperature: float,
    top_p: float,
    seed: int,
  ):
    self.engine, self.tok, self.rid = engine, tokenizer, rid
    self.max_new_tokens_per_turn, self.max_total_tokens = max_new_tokens_per_turn, max_total_tokens
    self.response_budget, self.temperature, self.top_p, self.seed = response_budget, temperature, top_p, seed
    sp = tokenizer.special_ids
    self.im_end = sp["<|im_end|>"]
    self.stop_ids = (self.im_end, tokenizer.eos_id)
    self.header = [sp["<|im_assistant|>"], *tokenizer.encode("assistant"), sp["<|im_middle|>"]]
    self.trajectory = Trajectory(str(task.get("id", rid)), str(task.get("task", "agentic")), [], [], [], [], 0)

  def start(self, observation: Mapping[str, Any]) -> None:
    ids, _ = render_chat(
      observation["messages"], observation.get("tools"), tokenizer=self.tok, add_generation_prompt=True
    )
    self._append(ids, trained=False)
    self.trajectory.prompt_length = len(ids)
    if self.response_budget is not None:
      self.max_total_tokens = min(self.max_total_tokens, len(ids) + self.response_budget)

  def act(self, turn: int) -> dict:
    traj = self.trajectory
    budget = self.max_total_tokens - len(traj.tokens) - 1  # keep room for a closing <|im_end|>
    if budget <= 0:
      raise StopEpisode("budget")
    sampling = SamplingParams(
      max_new_tokens=min(self.max_new_tokens_per_turn, budget),
      temperature=self.temperature,
      top_p=self.top_p,
      stop_token_ids=self.stop_ids,
      seed=(self.seed * 1_000_003 + zlib.crc32(self.rid.encode()) + turn) % 2**31,
    )
    try:
      res = self.engine.generate(GenerateRequest(f"{self.rid}-t{turn}", tuple(traj.tokens), sampling))
    except (ServiceError, RuntimeError, ValueError) as e:
      raise StopEpisode("engine_error", {"error": str(e)[:500]}) from None
    out = list(res.output_ids)
    traj.turns.append(Turn(len(traj.tokens), tuple(out), res.finish_reason))
    traj.tokens += out
    traj.loss_mask += [1] * len(out)
    traj.logprobs += list(res.output_logprobs)
    traj.versions += list(res.weight_versions)
    if res.finish_reason == "abort":
      raise StopEpisode("abort")
    if not out or out[-1] != self.im_end:  # close the turn: not generated, not trained
      self._append([self.im_end], trained=False)
    body = out[:-1] if out and out[-1] in self.stop_ids else out
    try:
      return parse_assistant(body, tokenizer=self.tok)
    except (ValueError, TypeError) as e:  # ids the tokenizer cannot decode: the env reports it
      return {"role": "assistant", "content": "", "tool_call_error": f"undecodable turn: {e}"}

  def observe(self, messages: list[dict]) -> None:
    if not messages:
      self._append(self.header, trained=False)
      return
    ids, _ = render_chat(messages, tokenizer=self.tok, add_generation_prompt=True)
    self._append(ids, trained=False)

  def _append(self, ids: Sequence[int], trained: bool) -> None:
    traj = self.trajectory
    traj.tokens += list(ids)
    traj.loss_mask += [int(trained)] * len(ids)
    traj.logprobs += [0.0] * len(ids)
    traj.versions += [-1] * len(ids)


class EpisodeRunner:
  """RL episodes by environment name: `runner(task, env, rid, engine, temperature=, seed=, budget=)`.

  The engine is passed per call so the RL rollout manager can hand in its own wrapper (it tracks request
  ids to abort them); `env_factories` maps environment names to `Environment` factories (`EnvServices`)."""

  def __init__(
    self, tokenizer: Tokenizer, env_factories: Mapping[str, Callable[[], Environment]], config: MultiTurnConfig
  ):
    self.tok, self.factories, self.config = tokenizer, dict(env_factories), config

  def __call__(
    self,
    task: Mapping[str, Any],
    env: str,
    rid: str,
    engine: Engine,
    *,
    temperature: float,
    seed: int,
    budget: int,
  ) -> Trajectory:
    if env not in self.factories:
      raise KeyError(f"no environment service for {env!r} (have {sorted(self.factories)})")
    runner = MultiTurnRunner(engine, self.tok, self.factories[env], self.config)
    return runner.run_episode(task, rid, temperature=temperature, seed=seed, response_budget=budget)
