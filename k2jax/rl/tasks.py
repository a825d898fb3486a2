"""RL tasks: prompts plus the reward that verifies them. Each task has `name` (selects the token budget),
`prompts(start)` (an endless stream, resumable by index), `all_prompts()` (for greedy evaluation),
`reward(prompt, completion)` and `format_examples` (warm start; the arithmetic task only).

`ArithmeticTask` generates digit arithmetic (`a+b=` by default) with an exact integer answer.

Prompt i is a pure function of (seed, i), so a resumed run continues the same stream by index. The
reward is exact match: 1.0 when the response (stop token removed) is exactly the decimal answer and the
sample stopped on its own, else 0.0. `format_examples` draws prompts with *uniformly random* answers:
supervised steps on them teach the output format (digits then the stop token) but carry no information
about which answer is right, so a model warm-started on them answers at chance and only RL can raise
its accuracy above that.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterator, Sequence

import numpy as np

from k2jax.data.chat import render_chat
from k2jax.data.sources import iter_jsonl_strict
from k2jax.data.tokenizer import Tokenizer
from k2jax.rl.rewards.base import Completion, Prompt, RewardResult
from k2jax.rl.rewards.math import math_reward

TASK_NAME = "arith"


@dataclasses.dataclass(frozen=True)
class ArithmeticTaskConfig:
  a_min: int = 0  # first operand range [a_min, a_max]
  a_max: int = 4
  b_min: int = 0  # second operand range [b_min, b_max]
  b_max: int = 4
  seed: int = 0  # prompt stream seed
  template: str = "{a}+{b}="  # prompt text; the answer is the decimal a+b

  def __post_init__(self):
    if not (0 <= self.a_min <= self.a_max and 0 <= self.b_min <= self.b_max):
      raise ValueError(f"ArithmeticTaskConfig: need 0 <= a_min <= a_max and 0 <= b_min <= b_max, got {self}")
    if "{a}" not in self.template or "{b}" not in self.template:
      raise ValueError(f"ArithmeticTaskConfig.template must contain {{a}} and {{b}}, got {self.template!r}")

  @property
  def answers(self) -> list[int]:
    return list(range(self.a_min + self.b_min, self.a_max + self.b_max + 1))


class ArithmeticTask:
  """Prompts, the exact-match reward and format-only warm-start examples for `a+b=`."""

  name = TASK_NAME

  def __init__(self, config: ArithmeticTaskConfig, encode: Callable[[str], list[int]], stop_id: int):
    self.config = config
    self._encode = encode
    self.stop_id = stop_id

  def prompt(self, index: int) -> Prompt:
    """The index-th prompt of the stream (operands drawn uniformly from the configured ranges)."""
    rng = np.random.default_rng([self.config.seed, index])
    a = int(rng.integers(self.config.a_min, self.config.a_max + 1))
    b = int(rng.integers(self.config.b_min, self.config.b_max + 1))
    return self._make(f"{TASK_NAME}/{index}", a, b)

  def prompts(self, start: int = 0) -> Iterator[Prompt]:
    """An endless stream from `start` (the number of prompts a resumed run had already drawn)."""
    return (self.prompt(i) for i in itertools.count(start))

  def all_prompts(self) -> list[Prompt]:
    """Every distinct (a, b) once, for greedy evaluation."""
    c = self.config
    return [
      self._make(f"{TASK_NAME}/eval/{a}+{b}", a, b)
      for a in range(c.a_min, c.a_max + 1)
      for b in range(c.b_min, c.b_max + 1)
    ]

  def format_examples(self, n: int, rng: np.random.Generator) -> list[tuple[list[int], list[int]]]:
    """n (prompt ids, response ids + stop) pairs whose answers are random, not the sums."""
    answers = self.config.answers
    out = []
    for _ in range(n):
      p = self.prompt(int(rng.integers(2**31)))
      wrong = answers[int(rng.integers(len(answers)))]
      out.append((list(p.input_ids), self._encode(str(wrong)) + [self.stop_id]))
    return out

  def _make(self, prompt_id: str, a: int, b: int) -> Prompt:
    text = self.config.template.format(a=a, b=b)
    return Prompt(prompt_id, TASK_NAME, tuple(self._encode(text)), text, {"answer": str(a + b)})

  @staticmethod
  def reward(prompt: Prompt, completion: Completion) -> RewardResult:
    return exact_answer_reward(prompt, completion)


class MathJsonlTask:
  """Math problems from a jsonl file of `{"question", "answer"}` records (optional `id`, `system`).

  Each question is rendered as a K2 chat user turn followed by the assistant generation prompt; the
  reward is `rewards.math.math_reward` (the last \\boxed{} answer against `answer`). The stream cycles
  through the file in order; `all_prompts` (greedy evaluation) is the first `eval_size` records.
  """

  name = "math"

  def __init__(self, path: str, tokenizer: Tokenizer, eval_size: int = 64):
    self._records = _read_math_records(path)
    self._tok = tokenizer
    self._eval_size = eval_size

  def prompt(self, index: int) -> Prompt:
    i = index % len(self._records)
    r = self._records[i]
    messages = ([{"role": "system", "content": r["system"]}] if r.get("system") else []) + [
      {"role": "user", "content": r["question"]}
    ]
    ids, _ = render_chat(messages, tokenizer=self._tok, add_generation_prompt=True)
    return Prompt(
      f"{self.name}/{r.get('id', i)}/{index}", self.name, tuple(ids), r["question"], {"answer": str(r["answer"])}
    )

  def prompts(self, start: int = 0) -> Iterator[Prompt]:
    return (self.prompt(i) for i in itertools.count(start))

  def all_prompts(self) -> list[Prompt]:
    return [self.prompt(i) for i in range(min(self._eval_size, len(self._records)))]

  def format_examples(self, n: int, rng: np.random.Generator):
    raise ValueError(
      "the math task has no format warm start: set warm_start.steps=0 (start from an SFT model with model.init_from)"
    )

  @staticmethod
  def reward(prompt: Prompt, completion: Completion) -> RewardResult:
    return math_reward(prompt, completion)


def _read_math_records(path: str) -> list[dict]:
  records = []
  for line_no, r in iter_jsonl_strict(path):
    if not isinstance(r, dict) or not isinstance(r.get("question"), str) or "answer" not in r:
      raise ValueError(f"{path}:{line_no}: a math record needs a string 'question' and an 'answer'")
    records.append(r)
  if not records:
    raise ValueError(f"{path}: no records")
  return records


def exact_answer_reward(prompt: Prompt, completion: Completion) -> RewardResult:
  """1.0 iff the response text, stripped, equals `prompt.data['answer']` and the sample stopped."""
  if "answer" not in prompt.data:
    raise KeyError(f"exact_answer_reward: prompt {prompt.prompt_id} has no data['answer']")
  got, want = completion.text.strip(), str(prompt.data["answer"])
  if completion.finish_reason != "stop":
    return RewardResult(0.0, f"did not stop ({completion.finish_reason})", {"extracted": got})
  return RewardResult(float(got == want), "exact match" if got == want else f"{got!r} != {want!r}", {"extracted": got})


def strip_stop(decode: Callable[[Sequence[int]], str], stop_ids: Sequence[int]) -> Callable[[Sequence[int]], str]:
  """A decoder that drops stop tokens first (rewards see the answer text, not '[EOS]')."""
  stop = set(stop_ids)
  return lambda ids: decode([t for t in ids if t not in stop])
