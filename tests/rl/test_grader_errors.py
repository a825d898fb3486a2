"""A grader that raises is an infrastructure verdict, never a crash of the rollout: the completion's reward is
NaN with `info["infra_error"]` (an episode whose environment raises ends with `env_error`), the batch masks it
and the rollout counts it. Task data that is wrong (a missing field, a test the grader cannot split) still
raises, naming the prompt."""

import json
import math
import os

import numpy as np
import pytest

from k2jax.agentic.envs.simulated import SimToolsEnv
from k2jax.agentic.rollout import EpisodeRunner, MultiTurnConfig
from k2jax.data.tokenizer import load_tokenizer
from k2jax.rl import batching
from k2jax.grading import contract
from k2jax.grading import math as grader
from k2jax.grading.base import Completion, Prompt
from k2jax.rl.rollout import RolloutConfig, RolloutManager
from k2jax.rl.tasks import AgenticTask, JsonlTask, TaskSet
from k2jax.sandbox import code
from k2jax.transport import ServiceUnreachable
from tests.rl.test_reward_contract import CALL, ScriptedJudge, ScriptEngine, rl_configs

TOK = load_tokenizer()
MISMATCH = "AST constructor recursion depth mismatch (before=27, after=14)"  # CPython gh-106905


def _c(text):
  return Completion((), text, "stop", False)


def _math_that_fails_on(text):
  real = contract.math_reward

  def math_reward(prompt, completion, budget=None):
    if text in completion.text:
      raise SystemError(MISMATCH)
    return real(prompt, completion, budget)

  return math_reward


def test_a_grader_error_is_a_nan_verdict_for_that_completion_only(monkeypatch):
  monkeypatch.setattr(contract, "math_reward", _math_that_fails_on("boom"))
  p = Prompt("q", "t", (1,), "2+3", {"answer": "5"})
  ok, failed = contract.make_reward("math")(p, [_c("\\boxed{5}"), _c("boom")])
  assert ok.reward == 1.0 and "infra_error" not in ok.info
  assert math.isnan(failed.reward)
  assert failed.info["infra_error"] == f"math grader raised SystemError: {MISMATCH}"
  assert failed.reason.startswith("infrastructure error (masked, not a verdict)")


def test_a_code_grader_error_is_nan_and_bad_test_data_still_raises(monkeypatch):
  p = Prompt("c", "code", (1,), "add", {"tests": ["assert add(2, 3) == 5"]})
  real_split = code.split_test

  def split_test(source, *a, **kw):
    raise SystemError(MISMATCH)

  monkeypatch.setattr(code, "split_test", split_test)
  (r,) = contract.make_reward("code")(p, [_c("def add(a, b):\n  return a + b\n")])
  assert math.isnan(r.reward) and r.info["infra_error"] == f"code grader raised SystemError: {MISMATCH}"
  monkeypatch.setattr(code, "split_test", real_split)
  bad = Prompt("c", "code", (1,), "add", {"tests": ["add(2, 3)"]})  # no assert: the data's fault
  with pytest.raises(ValueError, match="no top-level assert"):
    contract.make_reward("code")(bad, [_c("def add(a, b):\n  return a + b\n")])
  with pytest.raises(KeyError, match=r"code reward: prompt c \(task 'code'\) has no data\['tests'\]"):
    contract.make_reward("code")(Prompt("c", "code", (1,), "add", {}), [_c("x")])


def test_a_judge_that_does_not_answer_gives_the_whole_rubric_group_nan():
  class Down(ScriptedJudge):
    def text(self, messages):
      raise ServiceUnreachable("http://judge:8000/v1: no answer after 3 attempts")

  p = Prompt("r", "t", (1,), "Q")
  results = contract.make_reward("rubric", judge=Down())(p, [_c("good"), _c("bad"), _c("ok")])
  assert len(results) == 3 and all(math.isnan(r.reward) for r in results)
  assert (
    results[0].info["infra_error"]
    == "rubric grader raised ServiceUnreachable: http://judge:8000/v1: no answer after 3 attempts"
  )
  (j,) = contract.make_reward("judge", judge=Down())(p, [_c("good")])
  assert math.isnan(j.reward) and "ServiceUnreachable" in j.info["infra_error"]


class GraderDown(SimToolsEnv):
  """The simulated tools environment whose grading at the end of the episode raises (as SWE's grade did)."""

  def score(self, task, state, final):
    raise SystemError(MISMATCH)


def test_the_rollout_keeps_its_batch_when_graders_raise(tmp_path, monkeypatch):
  """A math group whose grader raises and an episode group whose environment's grader raises: the batch
  comes back, those samples are masked (reward NaN; the episode keeps no tokens) and counted."""
  monkeypatch.setattr(contract, "math_reward", _math_that_fails_on("boxed{2}"))
  math_path = tmp_path / "m.jsonl"
  math_path.write_text(json.dumps({"question": "1+1?", "answer": 2}) + "\n")
  agentic = AgenticTask("sim", os.path.join(rl_configs.TASK_DATA, "sim_tools.jsonl"), "sim_tools", TOK)
  mix = TaskSet([(JsonlTask("math", str(math_path), TOK, "math"), 1), (agentic, 1)])

  def script(req):
    if "-t0" in req.rid:
      return TOK.encode_with_specials(CALL)
    if "-t1" in req.rid:
      return TOK.encode_with_specials("notes.txt is there.<|im_end|>")
    return TOK.encode_with_specials("1 + 1 = \\boxed{2}<|im_end|>")

  stop = (TOK.eos_id, TOK.special_ids["<|im_end|>"])
  cfg = RolloutConfig(
    group_size=2, target_groups=2, launch_groups=2, task_budgets=(("math", 16), ("sim", 64)), stop_token_ids=stop
  )
  episodes = EpisodeRunner(TOK, {"sim_tools": GraderDown}, MultiTurnConfig(max_turns=3, max_total_tokens=512))
  manager = RolloutManager(
    cfg, ScriptEngine(script), mix.prompts(0), mix.reward_fn(), decode=TOK.decode, episodes=episodes
  )
  try:
    batch, stats = manager.collect(1)
  finally:
    manager.close()
  assert sorted(batch.tasks) == ["math", "math", "sim", "sim"]
  is_math = np.array([t == "math" for t in batch.tasks])
  assert np.isnan(batch.rewards_B[is_math]).all() and (batch.response_lengths_B[~is_math] == 0).all()
  assert stats["reward_infra_errors"] == 2 and stats["episode_env_errors"] == 2
  arrays, dropped = batching.to_train_arrays(
    batch, rows=4, seq_len=batch.tokens_BT.shape[1], vocab_size=TOK.vocab_size, version=1
  )
  assert dropped["samples"] == 4 and dropped["reward"] == 2 and dropped["span"] == 2
  assert not arrays["sample_mask_B"].any() and np.isfinite(arrays["rewards_B"]).all()


def _math_rollout(tmp_path, reward_fn_of, **cfg):
  """One batch of two math groups of two answering `\\boxed{2}` to `1+1?`, scored by `reward_fn_of(mix)`."""
  math_path = tmp_path / "m.jsonl"
  math_path.write_text(json.dumps({"question": "1+1?", "answer": 2}) + "\n")
  mix = TaskSet([(JsonlTask("math", str(math_path), TOK, "math"), 1)])
  engine = ScriptEngine(lambda req: TOK.encode_with_specials("1 + 1 = \\boxed{2}<|im_end|>"))
  stop = (TOK.eos_id, TOK.special_ids["<|im_end|>"])
  config = RolloutConfig(
    group_size=2, target_groups=2, launch_groups=2, task_budgets=(("math", 16),), stop_token_ids=stop, **cfg
  )
  budget = grader.GradingBudget(5.0)
  manager = RolloutManager(
    config, engine, mix.prompts(0), reward_fn_of(mix, budget), decode=TOK.decode, grading_budget=budget
  )
  try:
    return manager.collect(1), budget
  finally:
    manager.close()


def test_a_grader_failing_on_every_sample_stops_the_run_naming_the_cause(tmp_path, monkeypatch):
  monkeypatch.setattr(contract, "math_reward", _math_that_fails_on("boxed{2}"))
  with pytest.raises(RuntimeError) as e:
    _math_rollout(tmp_path, lambda mix, budget: mix.reward_fn(budget=budget))
  message = str(e.value)
  assert "4 of 4 samples have no verdict, past reward.max_infra_error_frac=0.5" in message
  assert f"4 x task 'math': math grader raised SystemError: {MISMATCH}" in message
  (batch, stats), _ = _math_rollout(tmp_path, lambda mix, budget: mix.reward_fn(budget=budget), max_infra_error_frac=1)
  assert stats["reward_infra_errors"] == 4 and np.isnan(batch.rewards_B).all()  # allowed: masked and counted


def test_timeouts_are_counted_per_task_and_the_budget_opens_with_each_batch(tmp_path):
  def spent_reward(mix, budget):
    inner = mix.reward_fn(budget=budget)

    def reward(prompt, completions):
      budget.spend(budget.left())  # the batch's budget is gone before this group is graded
      return inner(prompt, completions)

    return reward

  grader._CACHE.clear()
  (batch, stats), budget = _math_rollout(tmp_path, spent_reward)
  assert stats["reward_timeouts"] == 4 and stats["reward_timeouts/math"] == 4
  assert (batch.rewards_B == 0).all() and stats["reward_infra_errors"] == 0  # timeouts are verdicts: 0, trained
  (batch, stats), _ = _math_rollout(tmp_path, lambda mix, budget: mix.reward_fn(budget=budget))
  assert stats["reward_timeouts"] == 0 and (batch.rewards_B == 1).all()


def test_a_math_grader_failure_in_evaluation_names_the_math_grader(monkeypatch):
  from k2jax.eval import grading
  from k2jax.eval.records import Doc
  from k2jax.sandbox.code import CodeRewardConfig

  monkeypatch.setattr(contract, "math_reward", _math_that_fails_on("boxed"))
  doc = Doc("d", "1+1?", "", {"answer": "2"})
  with pytest.raises(RuntimeError, match=f"eval: the math grader could not grade: math grader raised SystemError"):
    grading.grade("answer.math", "t", doc, "\\boxed{2}", "stop", CodeRewardConfig())
