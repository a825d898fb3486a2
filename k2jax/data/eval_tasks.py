"""The config of a benchmark task run inside a loop: one `eval.tasks.<name>` section (`EvalTaskEntry`), the
format names it may give, and `task_entries`, which resolves a loop's `eval.tasks` and `eval.tasks_file` into
checked entries.

It lives in the data layer so that every loop's config declares the same section: RL (`k2jax.rl.config`),
pretraining and SFT (`k2jax.train.config`). What runs an entry (prompts, engine, grading) is `k2jax.eval`'s,
a layer above both the trainer and this module; `k2jax.eval.tasks` parses each of `FORMATS`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping

from ml_collections import config_dict as mlc

from k2jax import configlib
from k2jax.configlib import knob
from k2jax.model.config import ConfigError

REWARD_KINDS = ("exact", "math", "code", "instruction")  # answer.KIND: graded by that RL reward
GENERIC_FORMATS = tuple(f"answer.{kind}" for kind in REWARD_KINDS)
FORMATS = ("gsm8k", "math", "humaneval", "mbpp", "mc") + GENERIC_FORMATS
NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a task name names its metrics: eval/<name>/<metric>
_POSITIVE = {"check": lambda v: v >= 1, "rule": "must be >= 1"}
_NON_NEGATIVE = {"check": lambda v: v >= 0, "rule": "must be >= 0"}


@dataclasses.dataclass(frozen=True)
class EvalTaskEntry:
  """One `eval.tasks.<name>` section: a held-out benchmark file run by k2jax.eval's runner (launch/eval.py's)."""

  format: str = knob("answer.exact", "task format (k2jax/eval/tasks.py)", choices=FORMATS)
  path: str = knob("", "the task's JSONL (or .jsonl.gz) file in its published field names, never trained on")
  n: int = knob(1, "samples per doc", **_POSITIVE)
  ks: tuple[int, ...] = knob((1,), "pass@k and maj@k for each k <= n (mean@n always)")
  temperature: float = knob(0.0, "sampling temperature (0 = greedy, then n must be 1)", **_NON_NEGATIVE)
  top_p: float = knob(1.0, "nucleus sampling (1 = off)")
  max_tokens: int = knob(
    0,
    "response tokens per sample (0 = the loop's default: RL's largest task budget, training's eval.max_tokens)",
    **_NON_NEGATIVE,
  )
  limit: int = knob(0, "the file's first docs only (0 = all)", **_NON_NEGATIVE)
  chat: bool = knob(False, "prompts in the K2 chat template (as jsonl RL tasks') instead of plain text")
  system: str = knob("", "chat: a system message first ('' = none)")
  num_fewshot: int = knob(
    0, "few-shot examples before each prompt (the first records of fewshot_file)", **_NON_NEGATIVE
  )
  fewshot_file: str = knob("", "num_fewshot > 0: the examples' file (never the task's own)")
  seed: int = knob(0, "sample i of a doc is seeded by hash(seed, task, doc, i)")

  def validate(self):
    configlib.need(bool(self.path), "path", "required: the task's held-out file")
    configlib.need(bool(self.ks) and all(k >= 1 for k in self.ks), "ks", f"each k must be >= 1, got {self.ks}")
    configlib.need(
      self.temperature > 0 or self.n == 1, "n", f"{self.n} greedy samples are all the same: temperature > 0"
    )
    configlib.need(self.num_fewshot == 0 or bool(self.fewshot_file), "fewshot_file", "needed with num_fewshot > 0")


def eval_task_section(**values) -> mlc.ConfigDict:
  """An `eval.tasks.<name>` section for a preset: EvalTaskEntry's defaults with `values` set."""
  return configlib.item_config_dict(EvalTaskEntry, **values)


def task_entries(tasks: Mapping[str, EvalTaskEntry], tasks_file: str) -> list[tuple[str, str, EvalTaskEntry]]:
  """(config key, name, entry) of every held-out task: `eval.tasks.<name>`, then `eval.tasks_file`'s items
  (a JSON list of objects: `name` and the keys of an `eval.tasks.<name>` section, checked the same way)."""
  out = [(f"eval.tasks.{name}", name, e) for name, e in tasks.items()]
  for name in tasks:
    if not NAME.fullmatch(name):
      raise ConfigError(f"eval.tasks.{name}: a task name is letters, digits, '_', '-' or '.' (it names metrics)")
  if not tasks_file:
    return out
  try:
    with open(tasks_file, encoding="utf-8") as f:
      items = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"eval.tasks_file: cannot read {tasks_file!r}: {e}") from None
  if not isinstance(items, list):
    raise ConfigError(f"eval.tasks_file: {tasks_file} must hold a JSON list of task objects")
  for i, item in enumerate(items):
    key = f"eval.tasks_file[{i}]"
    name = item.get("name") if isinstance(item, dict) else None
    if not isinstance(name, str) or not NAME.fullmatch(name):
      raise ConfigError(f"{key}: each task needs a 'name' of letters, digits, '_', '-' or '.' ({tasks_file})")
    try:
      entry = configlib.build(EvalTaskEntry, {k: v for k, v in item.items() if k != "name"}, key=key)
    except ValueError as e:
      raise ConfigError(f"{e} ({tasks_file})") from None
    out.append((f"{key} ({name!r})", name, entry))
  names = [name for _, name, _ in out]
  if len(set(names)) != len(names):
    raise ConfigError(f"eval.tasks_file: task names repeat across eval.tasks and {tasks_file}: {names}")
  return out
