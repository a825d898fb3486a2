"""Reward functions: plain functions returning `RewardResult`; group rewards score K completions together."""

from k2jax.rl.rewards.base import Completion, GroupRewardFn, Prompt, RewardResult, per_sample
from k2jax.rl.rewards.code import code_reward
from k2jax.rl.rewards.contract import REWARD_KINDS, EngineJudge, RewardConfig, make_reward
from k2jax.sandbox.code import CodeRewardConfig, run_tests
from k2jax.rl.rewards.instruction import instruction_reward
from k2jax.rl.rewards.judge import llm_judge_reward
from k2jax.rl.rewards.math import GRADER_VERSION, equivalent, extract_boxed, math_reward, same_answer
from k2jax.rl.rewards.rubric import RubricRewardConfig, rubric_group_reward
from k2jax.sandbox.runner import SandboxConfig, SandboxResult, run_python
