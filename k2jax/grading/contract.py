"""The one reward contract: every reward kind is a `GroupRewardFn`, `(Prompt, [Completion] * K) -> [RewardResult]
* K`, built by `make_reward(kind, config, judge)`. A task names its kind; what the reward reads comes from
the prompt's task data, and a missing field is an error naming the prompt, the kind and the field:

  exact        data["answer"]: the stripped response equals it and the sample stopped (generated arithmetic)
  math         data["answer"]: the last \\boxed{} answer is equivalent to it (grading.math); a reference
               math-verify cannot read is bad data (ValueError); `info["timed_out"]` marks a timed-out grade
  code         data["tests"]: pass rate of the response's last fenced program in the sandbox (k2jax.sandbox)
  instruction  data["constraints"]: [{"kind": "word_count", "max_words": 50}, ...]; share met, 0 when the
               response claims compliance it lacks (grading.instruction, K2 hack-check)
  judge        data["criteria"] (else `RewardConfig.judge_criteria`): an LLM judge's "SCORE: n/10" / 10
  rubric       data["rubrics"] (optional human rubrics): K2 self-critique pairwise ranking within the group
  env          completion.info["env_reward"]: the environment's reward at the end of a multi-turn episode

The judge is anything with `text(messages) -> str`: `llm_client.ChatClient` (an OpenAI-compatible endpoint) or
`EngineJudge` (the rollout engine itself, e.g. the embedded engine, greedy and token-level).

A reward raises KeyError or ValueError when the prompt's task data is wrong (a missing field, a test the grader
cannot split, an unknown constraint): that is the run's input, and it stops the run naming the prompt. Any
other exception is the grader failing (the parser, the sandbox, a judge endpoint that does not answer): an
infrastructure verdict, reward NaN with `info["infra_error"]` saying why, for that completion (the whole group
for the rubric kind), which the RL batch masks and counts (`dropped_reward`, `reward_infra_errors`), never a
crash of the rollout; past `RolloutConfig.max_infra_error_frac` of a batch the rollout stops the run with
the causes (a grader that fails on every sample leaves nothing to train on).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from typing import Callable, Protocol, Sequence

from k2jax.data.chat import render_chat
from k2jax.data.tokenizer import Tokenizer
from k2jax.engine.base import Engine, GenerateRequest, SamplingParams
from k2jax.grading import instruction
from k2jax.grading.base import Completion, GroupRewardFn, Prompt, RewardResult, per_sample
from k2jax.grading.code import code_reward
from k2jax.grading.judge import llm_judge_reward
from k2jax.grading.math import GradingBudget, math_reward
from k2jax.grading.rubric import RubricRewardConfig, rubric_group_reward
from k2jax.sandbox.code import CodeRewardConfig

REWARD_KINDS = ("exact", "math", "code", "instruction", "judge", "rubric", "env")
JUDGE_KINDS = ("judge", "rubric")
DATA_ERRORS = (KeyError, ValueError)  # the prompt's task data is wrong: raised, never masked

log = logging.getLogger(__name__)


class ChatJudge(Protocol):
  def text(self, messages: Sequence[dict]) -> str: ...


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  code: CodeRewardConfig = CodeRewardConfig()
  rubric: RubricRewardConfig = RubricRewardConfig()
  judge_criteria: str = "The response is correct, helpful and answers the prompt directly."


def make_reward(
  kind: str,
  config: RewardConfig = RewardConfig(),
  judge: ChatJudge | None = None,
  budget: GradingBudget | None = None,
) -> GroupRewardFn:
  """The group reward of `kind` (one of REWARD_KINDS); `judge` is required by the judge and rubric kinds;
  `budget` bounds the math kind's grading seconds per RL batch (the rollout manager opens each batch)."""
  if kind not in REWARD_KINDS:
    raise ValueError(f"unknown reward kind {kind!r}; known: {REWARD_KINDS}")
  if kind in JUDGE_KINDS and judge is None:
    raise ValueError(f"reward kind {kind!r} needs a judge (an LLM endpoint or the rollout engine)")
  if kind == "rubric":
    return _group_verdicts(kind, rubric_group_reward(judge, config.rubric))
  needs = {"exact": "answer", "math": "answer", "code": "tests", "instruction": "constraints"}
  per_completion: dict[str, Callable[[Prompt, Completion], RewardResult]] = {
    "exact": exact_answer_reward,
    "math": lambda p, c: math_reward(p, c, budget),
    "code": lambda p, c: code_reward(p, c, config.code),
    "instruction": lambda p, c: instruction.instruction_reward(
      c.text, instruction.constraints_from_dicts(p.data["constraints"])
    ),
    "judge": lambda p, c: llm_judge_reward(judge, p.text, c.text, str(p.data.get("criteria") or config.judge_criteria)),
    "env": env_reward,
  }
  fn = per_completion[kind]
  if kind in needs:
    inner = fn

    def fn(p: Prompt, c: Completion) -> RewardResult:
      _need(p, kind, needs[kind])
      return inner(p, c)

  return per_sample(_verdict(kind, fn))


def exact_answer_reward(prompt: Prompt, completion: Completion) -> RewardResult:
  """1.0 iff the response text, stripped, equals `prompt.data['answer']` and the sample stopped."""
  got, want = completion.text.strip(), str(_need(prompt, "exact", "answer"))
  if completion.finish_reason != "stop":
    return RewardResult(0.0, f"did not stop ({completion.finish_reason})", {"extracted": got})
  return RewardResult(float(got == want), "exact match" if got == want else f"{got!r} != {want!r}", {"extracted": got})


def env_reward(prompt: Prompt, completion: Completion) -> RewardResult:
  """The environment's end-of-episode reward, carried on the completion by the multi-turn rollout."""
  if "env_reward" not in completion.info:
    raise KeyError(f"env reward: completion of prompt {prompt.prompt_id} has no info['env_reward'] (not an episode)")
  end = completion.info.get("end", "env_done")
  return RewardResult(float(completion.info["env_reward"]), f"episode ended: {end}", dict(completion.info))


def _verdict(
  kind: str, fn: Callable[[Prompt, Completion], RewardResult]
) -> Callable[[Prompt, Completion], RewardResult]:
  """`fn`, with a grader failure (any exception but DATA_ERRORS) turned into a NaN infrastructure verdict."""

  def verdict(prompt: Prompt, completion: Completion) -> RewardResult:
    try:
      return fn(prompt, completion)
    except DATA_ERRORS:
      raise
    except Exception as e:  # noqa: BLE001  anything else is the grader's failure, not the completion's
      return _infra_verdict(kind, prompt, e)

  return verdict


def _group_verdicts(kind: str, fn: GroupRewardFn) -> GroupRewardFn:
  """`fn` over a group, with a grader failure turned into a NaN infrastructure verdict for every completion."""

  def verdicts(prompt: Prompt, completions: Sequence[Completion]) -> Sequence[RewardResult]:
    try:
      return fn(prompt, completions)
    except DATA_ERRORS:
      raise
    except Exception as e:  # noqa: BLE001  as in _verdict
      return [_infra_verdict(kind, prompt, e)] * len(completions)

  return verdicts


def _infra_verdict(kind: str, prompt: Prompt, error: Exception) -> RewardResult:
  why = f"{kind} grader raised {type(error).__name__}: {error}"[:500]
  log.warning("reward of prompt %s (task %r): %s", prompt.prompt_id, prompt.task, why)
  return RewardResult(math.nan, f"infrastructure error (masked, not a verdict): {why}", {"infra_error": why})


def _need(prompt: Prompt, kind: str, field: str):
  if field not in prompt.data:
    raise KeyError(f"{kind} reward: prompt {prompt.prompt_id} (task {prompt.task!r}) has no data[{field!r}]")
  return prompt.data[field]


class EngineJudge:
  """A judge served by an RL `Engine` (the policy's own engine in agentic_tiny: no separate endpoint).

  Messages are rendered with the K2 chat template and answered greedily up to `max_new_tokens`."""

  def __init__(self, engine: Engine, tokenizer: Tokenizer, max_new_tokens: int = 64):
    self.engine, self.tok, self.max_new_tokens = engine, tokenizer, max_new_tokens
    sp = tokenizer.special_ids
    self._stop = (sp["<|im_end|>"], tokenizer.eos_id)
    self._ids = itertools.count()  # next() on a count is atomic in CPython: unique request ids across threads

  def text(self, messages: Sequence[dict]) -> str:
    ids, _ = render_chat(list(messages), tokenizer=self.tok, add_generation_prompt=True)
    sampling = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, stop_token_ids=self._stop)
    res = self.engine.generate(GenerateRequest(f"judge/{id(self)}/{next(self._ids)}", tuple(ids), sampling))
    return self.tok.decode([t for t in res.output_ids if t not in self._stop])
