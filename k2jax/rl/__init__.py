"""RL post-training: engine interface, rollouts, rewards, the K2 objective, weight sync."""

from k2jax.rl.algo import (
  K2LossConfig,
  group_mean,
  k2_objective,
  k2_rl_loss,
  ptx_loss,
  rollout_metrics,
  select_old_logprobs,
  sequence_logprobs,
  token_logprobs,
)
from k2jax.rl.engine import Engine, GenerateRequest, GenerateResult, RolloutBatch, SamplingParams
from k2jax.rl.rollout import RolloutConfig, RolloutManager, TemperatureSchedule
from k2jax.rl.transport import InvalidResponse, RequestRejected, RetryPolicy, ServiceError, ServiceUnreachable
from k2jax.rl.weight_sync import WeightSync, WeightSyncConfig
