"""RL post-training: rollouts, rewards, the K2 objective, weight sync (engines live in `k2jax.engine`)."""

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
from k2jax.rl.rollout_batch import RolloutBatch
from k2jax.rl.rollout import RolloutConfig, RolloutManager, TemperatureSchedule
from k2jax.rl.weight_sync import WeightSync, WeightSyncConfig
