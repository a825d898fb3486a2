"""K2 self-critique rubric reward (K2 §3.2.2, Appendix F): a judge ranks a group's answers pairwise.

For every pair (i, j) of the K responses to one prompt the judge model sees both answers and the rubrics
(core, prescriptive anti-reward-hacking, and prompt-specific human rubrics) and names the better one as
[[A]], [[B]] or [[TIE]]. With `both_orders` each pair is judged in both positions to cancel position bias.
Reward_i = (wins + ties/2) / comparisons, in [0, 1]; the group-centred RL loss only uses differences.

The judge's prompt layout is `RubricRewardConfig.layout` (JUDGE_LAYOUTS; `reward.judge_layout` in configs/rl.py):
`rubric` (the default, for real judges) is PAIRWISE_TEMPLATE above, instruction, rubrics and answers; `short`
(SHORT_TEMPLATE) is the prompt, the two answers labelled [[A]] and [[B]] and the question "[[A]] or [[B]]?", no
rubrics (~40 tokens with one-digit answers), the layout a tiny judge learns (docs/rl.md "The critic"). The closed-loop critic
(k2jax/rl/critic.py) trains and scores in whichever layout the rubric reward uses.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from k2jax.llm_client import ChatClient
from k2jax.grading.base import Completion, GroupRewardFn, Prompt, RewardResult

CORE_RUBRICS = (  # K2 Appendix F.1, paraphrased
  "Clarity and relevance: the answer is concise, addresses the user's intent and stays on topic.",
  "Conversational fluency and engagement: natural, coherent dialogue that engages the user appropriately.",
  "Objective and grounded interaction: factual, no meta-commentary about itself, no flattery.",
)
PRESCRIPTIVE_RUBRICS = (  # K2 Appendix F.2: anti-reward-hacking
  "No initial praise: do not open with compliments such as 'Good question!' or 'Great idea!'.",
  "No explicit justification: do not explain why the answer is good or how it follows the instructions.",
)

PAIRWISE_TEMPLATE = """Compare two answers to the same prompt using the rubrics. Rubrics marked MANDATORY must
be satisfied; weigh the others with your judgement.
[Prompt]
{prompt}
[Rubrics]
{rubrics}
[Answer A]
{a}
[Answer B]
{b}
Reason briefly, then give the verdict as exactly one of [[A]], [[B]] or [[TIE]]."""

SHORT_TEMPLATE = """{prompt}
[[A]] {a}
[[B]] {b}
[[A]] or [[B]]?"""

JUDGE_LAYOUTS = ("rubric", "short")  # RubricRewardConfig.layout: PAIRWISE_TEMPLATE | SHORT_TEMPLATE

_VERDICT = re.compile(r"\[\[(A|B|TIE)\]\]")


@dataclasses.dataclass(frozen=True)
class RubricRewardConfig:
  core: tuple[str, ...] = CORE_RUBRICS
  prescriptive: tuple[str, ...] = PRESCRIPTIVE_RUBRICS
  mandatory: tuple[str, ...] = PRESCRIPTIVE_RUBRICS  # subset of the above that must hold
  both_orders: bool = True
  max_parallel: int = 8
  layout: str = "rubric"  # the judge's prompt layout, one of JUDGE_LAYOUTS

  def __post_init__(self):
    if self.layout not in JUDGE_LAYOUTS:
      raise ValueError(f"RubricRewardConfig.layout: unknown judge layout {self.layout!r}; choices: {JUDGE_LAYOUTS}")


def rubric_group_reward(judge: ChatClient, config: RubricRewardConfig = RubricRewardConfig()) -> GroupRewardFn:
  """A group reward; human rubrics come from `prompt.data['rubrics']` (a list of strings) when present."""

  def reward(prompt: Prompt, completions: Sequence[Completion]) -> list[RewardResult]:
    rubrics = format_rubrics(config, tuple(prompt.data.get("rubrics", ())))
    question, layout = judged_question(prompt), config.layout
    K = len(completions)
    jobs = [(i, j) for i, j in itertools.permutations(range(K), 2) if config.both_orders or i < j]

    def judge_pair(ij):
      i, j = ij
      return (
        i,
        j,
        parse_verdict(
          judge.text(pairwise_messages(question, rubrics, completions[i].text, completions[j].text, layout))
        ),
      )

    with ThreadPoolExecutor(max(1, min(config.max_parallel, len(jobs)))) as pool:
      verdicts = list(pool.map(judge_pair, jobs))
    return _score(K, verdicts)

  return reward


def judged_question(prompt: Prompt) -> str:
  """The prompt text the judge sees."""
  return prompt.text or str(prompt.data.get("question", ""))


def pairwise_messages(question: str, rubrics: str, a: str, b: str, layout: str = "rubric") -> list[dict]:
  """The chat the judge answers for one ordered pair (answer `a` shown as A, `b` as B) in `layout` (one of
  JUDGE_LAYOUTS); `rubrics` from `format_rubrics` (the short layout shows none). The closed-loop critic
  (k2jax/rl/critic.py) trains the policy on exactly these."""
  if layout == "rubric":
    return [{"role": "user", "content": PAIRWISE_TEMPLATE.format(prompt=question, rubrics=rubrics, a=a, b=b)}]
  if layout == "short":
    return [{"role": "user", "content": SHORT_TEMPLATE.format(prompt=question, a=a, b=b)}]
  raise ValueError(f"pairwise_messages: unknown judge layout {layout!r}; choices: {JUDGE_LAYOUTS}")


def parse_verdict(reply: str) -> str | None:
  """The judge's last verdict in `reply`: "A", "B", "TIE", or None when it gave none."""
  found = _VERDICT.findall(reply)
  return found[-1] if found else None


def format_rubrics(config: RubricRewardConfig, human: tuple[str, ...]) -> str:
  lines = [f"- {'MANDATORY: ' if r in config.mandatory else ''}{r}" for r in config.core + config.prescriptive + human]
  return "\n".join(lines)


def _score(K: int, verdicts) -> list[RewardResult]:
  points, games, invalid = [0.0] * K, [0] * K, 0
  for i, j, v in verdicts:
    if v is None:
      invalid += 1
      continue
    share = {"A": (1.0, 0.0), "B": (0.0, 1.0), "TIE": (0.5, 0.5)}[v]
    points[i] += share[0]
    points[j] += share[1]
    games[i] += 1
    games[j] += 1
  out = []
  for k in range(K):
    if games[k] == 0:
      out.append(RewardResult(0.0, "no valid pairwise verdicts", {"invalid_verdicts": invalid}))
    else:
      out.append(
        RewardResult(
          points[k] / games[k], f"won {points[k]:g} of {games[k]} comparisons", {"invalid_verdicts": invalid}
        )
      )
  return out
