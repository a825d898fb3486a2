"""The graders RL and evaluation share, below both (imports point one way): plain functions returning
`RewardResult`; group rewards score K completions together."""

from k2jax.grading.base import Completion, GroupRewardFn, Prompt, RewardResult, per_sample
from k2jax.grading.code import code_reward
from k2jax.grading.contract import REWARD_KINDS, EngineJudge, RewardConfig, make_reward
from k2jax.sandbox.code import CodeRewardConfig, run_tests
from k2jax.grading.instruction import instruction_reward
from k2jax.grading.judge import llm_judge_reward
from k2jax.grading.math import GRADER_VERSION, equivalent, extract_boxed, math_reward, same_answer
from k2jax.grading.rubric import RubricRewardConfig, rubric_group_reward
from k2jax.sandbox.runner import SandboxConfig, SandboxResult, run_python
