"""What RL rollouts need besides the engine and the prompts: the one group reward of the run's task mix
(with the judge the judge and rubric kinds call) and, for agentic tasks, the episode runner with the
environment services it talks to (started here, on free ports, when the config gives no URL).

Config sections (configs/rl.py): `reward.*` (judge endpoint and reward knobs) and `agentic.*` (env service
URLs, local workers, turn limits). `TaskRuntime.close()` stops what it started.
"""

from __future__ import annotations

import dataclasses

from ml_collections import config_dict

from k2jax.agentic.envs.services import EnvServices, EnvServicesConfig, parse_urls
from k2jax.agentic.rollout import EpisodeRunner, MultiTurnConfig
from k2jax.data.tokenizer import Tokenizer
from k2jax.llm_client import ChatClient, ChatConfig
from k2jax.model.config import ConfigError
from k2jax.engine.base import Engine
from k2jax.grading.base import GroupRewardFn
from k2jax.grading.contract import EngineJudge, RewardConfig
from k2jax.grading.math import GradingBudget
from k2jax.grading.rubric import RubricRewardConfig
from k2jax.rl.tasks import TaskSet


@dataclasses.dataclass(frozen=True)
class TaskRuntimeConfig:
  reward: RewardConfig = RewardConfig()
  math_budget_s: float = 0.0  # seconds of math grading per RL batch (grading.math.GradingBudget; 0 = unbounded)
  judge_url: str = ""  # OpenAI-compatible endpoint root; "" = the rollout engine judges (greedy)
  judge_model: str = "default"
  judge_max_tokens: int = 64
  env_services: EnvServicesConfig = EnvServicesConfig()
  multi_turn: MultiTurnConfig = MultiTurnConfig()


def runtime_config(c: config_dict.ConfigDict) -> TaskRuntimeConfig:
  """The `reward` and `agentic` sections of the RL config (errors name the key)."""
  r, a = c.reward, c.agentic
  try:
    urls = parse_urls(a.env_urls)
  except ValueError as e:
    raise ConfigError(f"agentic.env_urls: {e}") from None
  for key, ok in (
    ("reward.judge_url", not r.judge_url or r.judge_url.startswith(("http://", "https://"))),
    ("reward.judge_max_tokens", r.judge_max_tokens >= 1),
    ("agentic.local_workers", a.local_workers >= 1),
    ("agentic.max_turns", a.max_turns >= 1),
    ("agentic.max_new_tokens_per_turn", a.max_new_tokens_per_turn >= 1),
  ):
    if not ok:
      raise ConfigError(f"{key}: invalid value in the RL config")
  return TaskRuntimeConfig(
    reward=RewardConfig(
      rubric=RubricRewardConfig(layout=r.judge_layout),
      judge_criteria=r.judge_criteria or RewardConfig.judge_criteria,
    ),
    math_budget_s=r.math_budget_s,
    judge_url=r.judge_url,
    judge_model=r.judge_model,
    judge_max_tokens=r.judge_max_tokens,
    env_services=EnvServicesConfig(
      urls=urls,
      local_workers=a.local_workers,
      reset_timeout_s=a.step_timeout_s,
      step_timeout_s=a.step_timeout_s,
    ),
    multi_turn=MultiTurnConfig(
      max_turns=a.max_turns,
      max_new_tokens_per_turn=a.max_new_tokens_per_turn,
      max_total_tokens=c.engine.max_seq_len,
    ),
  )


class TaskRuntime:
  def __init__(self, tasks: TaskSet, config: TaskRuntimeConfig, engine: Engine, tokenizer: Tokenizer):
    judge = None
    if tasks.needs_judge:
      judge = (
        ChatClient(
          ChatConfig(config.judge_url, model=config.judge_model, temperature=0.0, max_tokens=config.judge_max_tokens)
        )
        if config.judge_url
        else EngineJudge(engine, tokenizer, config.judge_max_tokens)
      )
    self.grading_budget = GradingBudget(config.math_budget_s)  # the rollout manager opens each batch's
    self.reward_fn: GroupRewardFn = tasks.reward_fn(config.reward, judge, self.grading_budget)
    self.services: EnvServices | None = None
    self.episodes: EpisodeRunner | None = None
    if tasks.envs:
      self.services = EnvServices(tasks.envs, config.env_services)
      self.episodes = EpisodeRunner(tokenizer, self.services.factories, config.multi_turn)

  def close(self) -> None:
    if self.services is not None:
      self.services.close()
