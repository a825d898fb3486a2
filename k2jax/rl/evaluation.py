"""Evaluation during RL: held-out benchmark tasks and the tasks' own prompts, through `k2jax.eval`'s runner
(the code `launch/eval.py` runs) on the rollout engine the learner already has.

The learner calls `Evaluator.run(iteration, version)` after the update's weights are pushed, so the engine
serves the current policy: nothing is copied. `engine_model` wraps that engine as the runner's `Model` (its
tokenizer, the run's stop tokens, a log-likelihood scorer over the same engine for multiple-choice tasks).

Tasks:
- `eval.tasks.<name>` (or an item of the JSON list `eval.tasks_file`): a file in one of `k2jax.eval.tasks.FORMATS`
  (gsm8k, math, humaneval, mbpp, mc, answer.KIND), with its own sampling (n, ks, temperature, max_tokens, chat,
  few-shot), checked at start (keys, files, every record). Metrics
  `eval/<name>/pass@k`, `maj@k` (voting formats), `mean@n`; multiple choice `acc`, `acc_norm`.
- `eval.train_prompts`: each RL task's own greedy-evaluation prompts (`all_prompts()`: every distinct a+b of
  the toy task, a jsonl task's first records), written once to `W/eval/data/<task>.jsonl` as an
  `answer.<reward kind>` file and run greedily with the task's token budget: `eval/<task>/pass@1`.
  `eval_accuracy` (the metric of earlier versions) is their mean over all those prompts, as before. The
  runner renders a prompt from its text (plain, or the chat template for a user turn); a task whose prompt
  ids it would not reproduce (a system prompt, `messages`) fails at start naming `eval.train_prompts`, and
  judged and agentic tasks are left out (as before).

Each evaluation writes `W/eval/<name>/<iteration>/` (`samples.jsonl`, `report.json`, `report.md`: the
runner's files, which `launch/plot.py` and `launch/eval.py` read); iteration 0 is the policy after the warm
start. The policy differs at every iteration, so a resumed run evaluates again from scratch (the samples
file is removed first) rather than reusing samples of a run whose weights it may not reproduce.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from k2jax.data.chat import render_chat
from k2jax.data.eval_tasks import GENERIC_FORMATS, task_entries
from k2jax.data.tokenizer import Tokenizer
from k2jax.engine.base import Engine
from k2jax.eval import inloop, runner
from k2jax.eval.store import write_atomic
from k2jax.model.config import ConfigError
from k2jax.rl.config import EvalSpec

TRAIN_PROMPTS_DIR = "data"  # W/eval/data/<task>.jsonl: the tasks' own prompts as answer.KIND files


def engine_model(engine: Engine, tokenizer: Tokenizer, stop_ids: tuple[int, ...], url: str = "") -> runner.Model:
  """The rollout engine as the eval runner's `Model` (k2jax.eval.inloop.engine_model)."""
  return inloop.engine_model(engine, tokenizer, stop_ids, url, what="rollout engine")


@dataclasses.dataclass(frozen=True)
class _Task:
  name: str
  config: runner.EvalConfig  # `out` and `model` are set per evaluation
  own: bool  # a task's own prompts (counted in eval_accuracy)


class Evaluator:
  """The run's eval tasks, checked at start (config keys, files, prompt rendering), run on demand."""

  def __init__(self, spec: EvalSpec, task_set, tokenizer: Tokenizer, model: runner.Model, workdir: str, budgets):
    """`task_set`: the run's `tasks.TaskSet`; `budgets(task_name)`: its response token budget."""
    self.root, self.model = os.path.join(workdir, "eval"), model
    names = [t.name for t in task_set.tasks]
    base = {"model": "", "out": "", "progress": False, "concurrency": spec.concurrency}
    largest = max(budgets(n) for n in names)
    self.tasks: list[_Task] = []
    if spec.train_prompts:
      for t in task_set.tasks:
        written = self._write_own(t, tokenizer)
        if written is not None:
          path, chat = written
          cfg = runner.EvalConfig(
            tasks=(runner.TaskSpec(t.name, path, f"answer.{t.reward_kind}"),),
            max_tokens=budgets(t.name),
            chat=chat,
            **base,
          )
          self.tasks.append(_Task(t.name, cfg, own=True))
    for key, name, e in task_entries(spec.tasks, spec.tasks_file):
      if name in names and spec.train_prompts:
        raise ConfigError(f"{key}: the name is an RL task's, whose own prompts eval.train_prompts logs: rename it")
      cfg = inloop.entry_config(
        key,
        name,
        e,
        scorer=model.scorer is not None,
        where=model.where,
        max_tokens=largest,
        concurrency=spec.concurrency,
      )
      self.tasks.append(_Task(name, cfg, own=False))
    if not self.tasks:
      raise ConfigError(
        f"eval.every: no eval task (eval.tasks is empty and no task of {names} has greedy-evaluation prompts):"
        " set eval.every=0 or add eval.tasks.<name>"
      )

  def _write_own(self, task, tok: Tokenizer) -> tuple[str, bool] | None:
    """`task`'s own prompts as an answer.KIND file (None: it has none the runner grades); (path, chat)."""
    fmt = f"answer.{task.reward_kind}"
    prompts = task.all_prompts() if fmt in GENERIC_FORMATS else []
    if not prompts:
      return None
    plain = all(tok.encode(p.text) == list(p.input_ids) for p in prompts)
    chat = not plain and all(
      render_chat([{"role": "user", "content": p.text}], tokenizer=tok, add_generation_prompt=True)[0]
      == list(p.input_ids)
      for p in prompts
    )
    if not (plain or chat):
      raise ConfigError(
        f"eval.train_prompts: task {task.name!r}'s prompts are not their text alone, plain or as one chat user turn"
        " (a system prompt or messages), which the eval runner would render otherwise: set eval.train_prompts=False"
        " and give its held-out file as eval.tasks.<name>"
      )
    path = os.path.join(self.root, TRAIN_PROMPTS_DIR, f"{task.name}.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = [json.dumps({**p.data, "id": p.prompt_id, "prompt": p.text}, ensure_ascii=False) for p in prompts]
    write_atomic(path, "\n".join(lines) + "\n")
    return path, chat

  def run(self, iteration: int, version: int) -> dict[str, Any]:
    """Every task on the engine's current weights: `eval/<task>/<metric>` (+ `eval_accuracy`, `eval_time_s`)."""
    t0, out, own = time.perf_counter(), {}, []
    for task in self.tasks:
      where = os.path.join(self.root, task.name, str(iteration))
      section = inloop.run_task(task.config, self.model, where, f"{self.model.where} (RL iteration {iteration})")
      out.update(inloop.metrics(task.name, section))
      if task.own:
        own.append((section["metrics"]["pass@1"], section["num_docs"]))
    if own:
      out["eval_accuracy"] = sum(p * n for p, n in own) / sum(n for _, n in own)
    out["eval_weight_version"] = version
    out["eval_time_s"] = time.perf_counter() - t0
    return out
