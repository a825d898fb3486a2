"""RL tasks: prompts plus the reward kind that verifies them, and `make_tasks(config, tokenizer)`, the one call
that builds a run's task set (one task, or a mix of several task types in every batch).

A task has `name` (its task type: selects its token budget, K2 §3.2.3, and names its metrics), `reward`
(a kind of the one reward contract, `grading.contract.REWARD_KINDS`), `prompts(start)` (an endless
stream, resumable by index), `all_prompts()` (greedy evaluation) and `format_examples` (warm start).

- `ArithmeticTask` generates digit arithmetic (`a+b=` by default) with an exact integer answer. Prompt i
  is a pure function of (seed, i), so a resumed run continues the same stream by index. The reward is
  exact match (`exact`). `format_examples` draws prompts with *uniformly random* answers: supervised steps
  on them teach the output format (digits then the stop token) but carry no information about which answer
  is right, so a model warm-started on them answers at chance and only RL can raise its accuracy.
- `JsonlTask` reads chat prompts from a jsonl file (`{"prompt"|"question"|"messages", "system"?, "id"?,
  ...reward data}`), for any single-turn reward kind (math, code, instruction, judge, rubric).
- `AgenticTask` reads environment tasks (`agentic.envs`: `{"id", "instruction", ...}`) for multi-turn
  episodes against an environment service; the reward is the environment's (`env`). Records may carry a
  `demo` assistant message: the warm start then teaches the tool-call format on it.
- `TaskSet` mixes tasks: prompt i comes from the task at position i of a weighted cycle (`weight` prompts
  of each task per cycle), again a pure function of i.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from ml_collections import config_dict

from k2jax.data.chat import render_chat
from k2jax.data.sources import iter_jsonl_strict
from k2jax.data.tokenizer import Tokenizer
from k2jax.model.config import ConfigError
from k2jax.grading.base import Completion, GroupRewardFn, Prompt, RewardResult
from k2jax.grading.math import GradingBudget
from k2jax.grading.contract import (
  JUDGE_KINDS,
  REWARD_KINDS,
  ChatJudge,
  RewardConfig,
  exact_answer_reward,
  make_reward,
)

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

  reward_kind = "exact"

  def __init__(
    self, config: ArithmeticTaskConfig, encode: Callable[[str], list[int]], stop_id: int, name: str = TASK_NAME
  ):
    self.config, self.name = config, name
    self._encode = encode
    self.stop_id = stop_id

  def prompt(self, index: int) -> Prompt:
    """The index-th prompt of the stream (operands drawn uniformly from the configured ranges)."""
    rng = np.random.default_rng([self.config.seed, index])
    a = int(rng.integers(self.config.a_min, self.config.a_max + 1))
    b = int(rng.integers(self.config.b_min, self.config.b_max + 1))
    return self._make(f"{self.name}/{index}", a, b)

  def prompts(self, start: int = 0) -> Iterator[Prompt]:
    """An endless stream from `start` (the number of prompts a resumed run had already drawn)."""
    return (self.prompt(i) for i in itertools.count(start))

  def all_prompts(self) -> list[Prompt]:
    """Every distinct (a, b) once, for greedy evaluation."""
    c = self.config
    return [
      self._make(f"{self.name}/eval/{a}+{b}", a, b)
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
    return Prompt(prompt_id, self.name, tuple(self._encode(text)), text, {"answer": str(a + b)})

  @staticmethod
  def reward(prompt: Prompt, completion: Completion) -> RewardResult:
    return exact_answer_reward(prompt, completion)


class JsonlTask:
  """Chat prompts from a jsonl file, scored by reward kind `reward`.

  A record holds the prompt as `prompt` or `question` (one user turn, after an optional `system`) or as
  `messages`; every other field is reward data (`answer`, `tests`, `constraints`, `criteria`, `rubrics`).
  Prompts end with the assistant generation header. The stream cycles through the file in order;
  `all_prompts` (greedy evaluation) is the first `eval_size` records.
  """

  def __init__(self, name: str, path: str, tokenizer: Tokenizer, reward: str, eval_size: int = 64):
    if reward not in REWARD_KINDS or reward == "env":
      raise ValueError(f"task {name!r}: reward {reward!r} is not a single-turn reward kind {REWARD_KINDS[:-1]}")
    self.name, self.reward_kind = name, reward
    self._records = _read_records(path, reward, _NEEDS.get(reward, ()), prompt_required=True)
    self._tok = tokenizer
    self._eval_size = eval_size

  def prompt(self, index: int) -> Prompt:
    i = index % len(self._records)
    r = self._records[i]
    text = r.get("prompt", r.get("question"))
    if "messages" in r:
      messages = list(r["messages"])
      text = next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")
    else:
      messages = ([{"role": "system", "content": r["system"]}] if r.get("system") else []) + [
        {"role": "user", "content": text}
      ]
    ids, _ = render_chat(messages, tokenizer=self._tok, add_generation_prompt=True)
    data = {k: v for k, v in r.items() if k not in ("prompt", "question", "messages", "system", "id")}
    if "answer" in data:
      data["answer"] = str(data["answer"])
    return Prompt(f"{self.name}/{r.get('id', i)}/{index}", self.name, tuple(ids), text, data)

  def prompts(self, start: int = 0) -> Iterator[Prompt]:
    return (self.prompt(i) for i in itertools.count(start))

  def all_prompts(self) -> list[Prompt]:
    return [self.prompt(i) for i in range(min(self._eval_size, len(self._records)))]

  def reward(self, prompt: Prompt, completion: Completion) -> RewardResult:
    """This task's reward for one completion (judge-free kinds; greedy evaluation)."""
    return _single_reward(self.reward_kind, prompt, completion)

  def format_examples(self, n: int, rng: np.random.Generator):
    raise ValueError(
      f"task {self.name!r} has no format warm start: set warm_start.steps=0 (start from an SFT model with"
      " model.init_from)"
    )


class MathJsonlTask(JsonlTask):
  """`{"question", "answer"}` records scored by the \\boxed{} math reward (task type "math")."""

  name = "math"

  def __init__(self, path: str, tokenizer: Tokenizer, eval_size: int = 64):
    super().__init__(MathJsonlTask.name, path, tokenizer, "math", eval_size)


class AgenticTask:
  """Environment tasks from a jsonl file, run as multi-turn episodes against environment `env`.

  Prompts carry the record in `data["episode"]` and the environment name in `data["env"]`; their token ids
  are the environment's first observation, rendered by the rollout when the episode starts (the prompt's
  own `input_ids` are empty). `format_examples` renders each `demo` (an assistant message, e.g. one tool
  call) after the observation an in-process environment of the same kind gives for the record."""

  reward_kind = "env"

  def __init__(self, name: str, path: str, env: str, tokenizer: Tokenizer):
    self.name, self.env, self._tok = name, env, tokenizer
    self._records = _read_records(path, "agentic", ("instruction",), prompt_required=False)

  def prompt(self, index: int) -> Prompt:
    i = index % len(self._records)
    r = self._records[i]
    episode = {k: v for k, v in r.items() if k != "demo"}
    episode.setdefault("id", f"{self.name}/{i}")
    return Prompt(
      f"{self.name}/{r.get('id', i)}/{index}", self.name, (), r["instruction"], {"episode": episode, "env": self.env}
    )

  def prompts(self, start: int = 0) -> Iterator[Prompt]:
    return (self.prompt(i) for i in itertools.count(start))

  def all_prompts(self) -> list[Prompt]:
    return []  # greedy single-turn evaluation does not apply to episodes

  def format_examples(self, n: int, rng: np.random.Generator) -> list[tuple[list[int], list[int]]]:
    from k2jax.agentic.envs.service import env_factories
    from k2jax.agentic.guards import Guard

    demos = [r for r in self._records if isinstance(r.get("demo"), dict)]
    if not demos:
      raise ValueError(f"task {self.name!r}: no record has a 'demo' assistant message for the warm start")
    make_env = env_factories()[self.env]
    out = []
    for _ in range(n):
      r = demos[int(rng.integers(len(demos)))]
      env = make_env(Guard())
      try:
        obs = env.reset({k: v for k, v in r.items() if k != "demo"})
      finally:
        env.close()  # an environment may hold a workspace or a sandbox per episode
      prompt, _ = render_chat(obs["messages"], obs.get("tools"), tokenizer=self._tok, add_generation_prompt=True)
      full, _ = render_chat(
        obs["messages"] + [{"role": "assistant", **r["demo"]}], obs.get("tools"), tokenizer=self._tok
      )
      if full[: len(prompt)] != prompt:
        raise ValueError(f"task {self.name!r}: the demo's rendering does not extend the prompt's")
      out.append((prompt, full[len(prompt) :]))
    return out


class TaskSet:
  """Several tasks in one stream: a cycle of `weight` prompts per task, in task order, repeated."""

  name = "mix"

  def __init__(self, tasks: Sequence[tuple[Any, int]]):
    if not tasks or any(w < 1 for _, w in tasks):
      raise ValueError(f"TaskSet needs at least one task and weights >= 1, got {[(t.name, w) for t, w in tasks]}")
    names = [t.name for t, _ in tasks]
    if len(set(names)) != len(names):
      raise ValueError(f"TaskSet: task names must be unique, got {names}")
    self.tasks = [t for t, _ in tasks]
    self._cycle = [(k, j) for k, (_, w) in enumerate(tasks) for j in range(w)]
    self._weights = [w for _, w in tasks]
    self.by_name = {t.name: t for t in self.tasks}

  def prompt(self, index: int) -> Prompt:
    k, j = self._cycle[index % len(self._cycle)]
    return self.tasks[k].prompt((index // len(self._cycle)) * self._weights[k] + j)

  def prompts(self, start: int = 0) -> Iterator[Prompt]:
    return (self.prompt(i) for i in itertools.count(start))

  def all_prompts(self) -> list[Prompt]:
    """Greedy-evaluation prompts of the tasks with pass/fail rewards (not judged, not episodes)."""
    prompts = [p for t in self.tasks if t.reward_kind not in JUDGE_KINDS for p in t.all_prompts()]
    if not prompts:
      raise ValueError(
        f"eval.every: no task of {[t.name for t in self.tasks]} has greedy-evaluation prompts (set eval.every=0)"
      )
    return prompts

  def format_examples(self, n: int, rng: np.random.Generator) -> list[tuple[list[int], list[int]]]:
    """Warm-start examples from the tasks that have them, in turn (none: the warm start cannot run)."""
    able = [t for t in self.tasks if _has_format_examples(t)]
    if not able:
      raise ValueError(
        f"no task of {[t.name for t in self.tasks]} has format warm-start examples: set warm_start.steps=0"
      )
    per = [n // len(able) + (i < n % len(able)) for i in range(len(able))]
    return [ex for t, m in zip(able, per) if m for ex in t.format_examples(m, rng)]

  @property
  def envs(self) -> list[str]:
    return sorted({t.env for t in self.tasks if isinstance(t, AgenticTask)})

  @property
  def reward_kinds(self) -> dict[str, str]:
    return {t.name: t.reward_kind for t in self.tasks}

  @property
  def needs_judge(self) -> bool:
    return any(k in JUDGE_KINDS for k in self.reward_kinds.values())

  def reward_fn(
    self, config: RewardConfig = RewardConfig(), judge: ChatJudge | None = None, budget: GradingBudget | None = None
  ) -> GroupRewardFn:
    """One group reward for the whole mix: each prompt is scored by its task's reward kind (the math kinds
    share `budget`, the grading seconds of one batch)."""
    by_task = {name: make_reward(kind, config, judge, budget) for name, kind in self.reward_kinds.items()}

    def reward(prompt: Prompt, completions: Sequence[Completion]) -> Sequence[RewardResult]:
      if prompt.task not in by_task:
        raise KeyError(f"prompt {prompt.prompt_id}: task {prompt.task!r} is not in this run ({sorted(by_task)})")
      return by_task[prompt.task](prompt, completions)

    return reward

  def reward(self, prompt: Prompt, completion: Completion) -> RewardResult:
    """The prompt's task's reward for one completion (judge-free kinds; greedy evaluation)."""
    return _single_reward(self.by_name[prompt.task].reward_kind, prompt, completion)


def _single_reward(kind: str, prompt: Prompt, completion: Completion) -> RewardResult:
  return make_reward(kind)(prompt, [completion])[0]


def _has_format_examples(task) -> bool:
  return isinstance(task, ArithmeticTask) or (
    isinstance(task, AgenticTask) and any(isinstance(r.get("demo"), dict) for r in task._records)
  )


_NEEDS = {"exact": ("answer",), "math": ("answer",), "code": ("tests",), "instruction": ("constraints",)}


def _read_records(path: str, kind: str, needs: Sequence[str], *, prompt_required: bool) -> list[dict]:
  records = []
  for line_no, r in iter_jsonl_strict(path):
    if not isinstance(r, dict):
      raise ValueError(f"{path}:{line_no}: a task record must be a JSON object")
    has_prompt = isinstance(r.get("prompt", r.get("question")), str) or isinstance(r.get("messages"), list)
    if prompt_required and not has_prompt:
      raise ValueError(f"{path}:{line_no}: a {kind} record needs a string 'prompt' (or 'question') or 'messages'")
    missing = [f for f in needs if f not in r]
    if missing:
      raise ValueError(f"{path}:{line_no}: a {kind} record needs {missing}")
    records.append(r)
  if not records:
    raise ValueError(f"{path}: no records")
  return records


def task_specs(config: config_dict.ConfigDict, *, check_files: bool = True) -> list[dict]:
  """The run's task types from the RL config: `tasks.<name>` sections when any, else the single `task`.

  A `tasks.<name>` section: kind ("arith" | "jsonl" | "agentic"), reward (REWARD_KINDS; agentic: "env"),
  path (jsonl records), env (agentic: environment name), budget (response tokens per sample), weight
  (prompts of this task per cycle of the mix). `check_files=False`: the paths need not exist yet (compiling
  for a TPU slice, `k2jax.rl.aot`)."""
  if len(config.tasks):
    specs = []
    for name, t in sorted(config.tasks.items()):
      spec = {"name": name, "kind": t.kind, "reward": t.get("reward", ""), "path": t.get("path", "")}
      spec.update(env=t.get("env", ""), budget=int(t.budget), weight=int(t.get("weight", 1)))
      if spec["kind"] == "arith":
        spec["reward"] = spec["reward"] or "exact"
      if spec["kind"] == "agentic":
        spec["reward"] = spec["reward"] or "env"
      specs.append(spec)
  else:
    t = config.task
    if t.kind not in ("arith", "math_jsonl"):
      raise ConfigError(f"task.kind: {t.kind!r} is not one of arith, math_jsonl (or use tasks.<name> sections)")
    kind, name = ("arith", TASK_NAME) if t.kind == "arith" else ("jsonl", MathJsonlTask.name)
    reward = "exact" if t.kind == "arith" else "math"
    specs = [{"name": name, "kind": kind, "reward": reward, "path": t.path, "env": "", "budget": t.budget, "weight": 1}]
  for s in specs:
    where = f"tasks.{s['name']}" if len(config.tasks) else "task"
    if s["kind"] not in ("arith", "jsonl", "agentic"):
      raise ConfigError(f"{where}.kind: {s['kind']!r} is not one of arith, jsonl, agentic")
    if s["reward"] not in REWARD_KINDS or (s["reward"] == "env") != (s["kind"] == "agentic"):
      raise ConfigError(f"{where}.reward: {s['reward']!r} does not fit kind {s['kind']!r} (kinds: {REWARD_KINDS})")
    if check_files and s["kind"] != "arith" and not os.path.isfile(s["path"]):
      raise ConfigError(f"{where}.path: no file {s['path']!r}")
    if s["budget"] < 1 or s["weight"] < 1:
      raise ConfigError(f"{where}: budget and weight must be >= 1, got {s['budget']} and {s['weight']}")
  return specs


def task_budgets(config: config_dict.ConfigDict, *, check_files: bool = True) -> tuple[tuple[str, int], ...]:
  """(task type, total response tokens per sample) for every task of the run (K2 §3.2.3 budget control)."""
  return tuple((s["name"], s["budget"]) for s in task_specs(config, check_files=check_files))


def make_tasks(config: config_dict.ConfigDict, tokenizer: Tokenizer) -> TaskSet:
  """Every task of the RL config, mixed in one prompt stream (a single task is a set of one)."""
  tasks = []
  for s in task_specs(config):
    if s["kind"] == "arith":
      t = config.task
      cfg = ArithmeticTaskConfig(t.a_min, t.a_max, t.b_min, t.b_max, t.seed, t.template)
      task = ArithmeticTask(cfg, tokenizer.encode, tokenizer.eos_id, name=s["name"])
    elif s["kind"] == "jsonl":
      task = JsonlTask(s["name"], s["path"], tokenizer, s["reward"])
    else:
      task = AgenticTask(s["name"], s["path"], s["env"], tokenizer)
    tasks.append((task, s["weight"]))
  return TaskSet(tasks)


def stop_ids(tasks: TaskSet, tokenizer: Tokenizer) -> tuple[int, ...]:
  """EOS; chat-templated tasks also end an answer at the end of the assistant turn."""
  if all(isinstance(t, ArithmeticTask) for t in tasks.tasks):
    return (tokenizer.eos_id,)
  return (tokenizer.eos_id, tokenizer.special_ids["<|im_end|>"])


def strip_stop(decode: Callable[[Sequence[int]], str], stop_ids: Sequence[int]) -> Callable[[Sequence[int]], str]:
  """A decoder that drops stop tokens first (rewards see the answer text, not '[EOS]')."""
  stop = set(stop_ids)
  return lambda ids: decode([t for t in ids if t not in stop])
