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
import re
import time
from typing import Any

from k2jax import configlib
from k2jax.data.chat import render_chat
from k2jax.data.tokenizer import Tokenizer
from k2jax.engine.base import Engine
from k2jax.engine.inference import InferenceEngine
from k2jax.eval import runner
from k2jax.eval.scoring import EngineScorer, HttpScorer
from k2jax.eval.store import SAMPLES, write_atomic
from k2jax.eval.tasks import GENERIC_FORMATS, get_format
from k2jax.model.config import ConfigError
from k2jax.rl.config import EvalSpec, EvalTaskEntry

TRAIN_PROMPTS_DIR = "data"  # W/eval/data/<task>.jsonl: the tasks' own prompts as answer.KIND files


def engine_model(engine: Engine, tokenizer: Tokenizer, stop_ids: tuple[int, ...], url: str = "") -> runner.Model:
  """The rollout engine as the eval runner's `Model` (the same object: no second copy of the weights).

  `url`: the engine's server (or router), when it is one. Log-likelihoods (multiple choice) come from the
  engine's own prompt logprobs: the embedded engine's prefill, or the server's /generate
  `input_token_logprobs`; sglang-jax's colocated engine gives none."""
  if url:
    return runner.Model(engine, tokenizer, tuple(stop_ids), HttpScorer(url), url)
  if isinstance(engine, InferenceEngine):
    where = "the embedded rollout engine"
    return runner.Model(engine, tokenizer, tuple(stop_ids), EngineScorer(engine), where, engine.config.max_seq_len)
  return runner.Model(engine, tokenizer, tuple(stop_ids), None, f"the rollout engine ({type(engine).__name__})")


@dataclasses.dataclass(frozen=True)
class _Task:
  name: str
  config: runner.EvalConfig  # `out` and `model` are set per evaluation
  own: bool  # a task's own prompts (counted in eval_accuracy)


def eval_tasks(spec: EvalSpec) -> list[tuple[str, str, EvalTaskEntry]]:
  """(config key, name, entry) of every held-out task: `eval.tasks.<name>`, then `eval.tasks_file`'s items
  (a JSON list of objects: `name` and the keys of an `eval.tasks.<name>` section, checked the same way)."""
  out = [(f"eval.tasks.{name}", name, e) for name, e in spec.tasks.items()]
  for name in spec.tasks:
    if not _NAME.fullmatch(name):
      raise ConfigError(f"eval.tasks.{name}: a task name is letters, digits, '_', '-' or '.' (it names metrics)")
  if not spec.tasks_file:
    return out
  try:
    with open(spec.tasks_file, encoding="utf-8") as f:
      items = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"eval.tasks_file: cannot read {spec.tasks_file!r}: {e}") from None
  if not isinstance(items, list):
    raise ConfigError(f"eval.tasks_file: {spec.tasks_file} must hold a JSON list of task objects")
  for i, item in enumerate(items):
    key = f"eval.tasks_file[{i}]"
    name = item.get("name") if isinstance(item, dict) else None
    if not isinstance(name, str) or not _NAME.fullmatch(name):
      raise ConfigError(f"{key}: each task needs a 'name' of letters, digits, '_', '-' or '.' ({spec.tasks_file})")
    try:
      entry = configlib.build(EvalTaskEntry, {k: v for k, v in item.items() if k != "name"}, key=key)
    except ValueError as e:
      raise ConfigError(f"{e} ({spec.tasks_file})") from None
    out.append((f"{key} ({name!r})", name, entry))
  names = [name for _, name, _ in out]
  if len(set(names)) != len(names):
    raise ConfigError(f"eval.tasks_file: task names repeat across eval.tasks and {spec.tasks_file}: {names}")
  return out


_NAME = re.compile(r"[A-Za-z0-9_.-]+")


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
    for key, name, e in eval_tasks(spec):
      if name in names and spec.train_prompts:
        raise ConfigError(f"{key}: the name is an RL task's, whose own prompts eval.train_prompts logs: rename it")
      for field, path in (("path", e.path), ("fewshot_file", e.fewshot_file)):
        if path and not os.path.isfile(path):
          raise ConfigError(f"{key}.{field}: no such file {path!r}")
      if get_format(e.format).kind == "choice" and model.scorer is None:
        raise ConfigError(f"{key}.format: {e.format!r} is scored by log-likelihood, which {model.where} cannot give")
      cfg = runner.EvalConfig(
        tasks=(runner.TaskSpec(name, e.path, e.format, fewshot_file=e.fewshot_file or None),),
        n=e.n,
        ks=tuple(e.ks),
        temperature=e.temperature,
        top_p=e.top_p,
        max_tokens=e.max_tokens or largest,
        seed=e.seed,
        num_fewshot=e.num_fewshot,
        limit=e.limit or None,
        chat=e.chat,
        system=e.system or None,
        **base,
      )
      try:
        runner.check_tasks(cfg)  # a bad record or few-shot file fails the run now, not at the first eval
      except (ValueError, OSError) as err:
        raise ConfigError(f"{key}: {err}") from None
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
      if os.path.exists(os.path.join(where, SAMPLES)):
        os.remove(os.path.join(where, SAMPLES))  # another run's policy at this iteration: evaluate afresh
      cfg = dataclasses.replace(task.config, out=where, model=f"{self.model.where} (RL iteration {iteration})")
      section = runner.run(cfg, self.model)["tasks"][task.name]
      out.update({f"eval/{task.name}/{k}": float(v) for k, v in section["metrics"].items()})
      if task.own:
        own.append((section["metrics"]["pass@1"], section["num_docs"]))
    if own:
      out["eval_accuracy"] = sum(p * n for p, n in own) / sum(n for _, n in own)
    out["eval_weight_version"] = version
    out["eval_time_s"] = time.perf_counter() - t0
    return out
