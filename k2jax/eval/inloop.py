"""Benchmarks inside a training loop: `eval.tasks.<name>` entries (`k2jax.data.eval_tasks.EvalTaskEntry`) run
through this package's runner (what `launch/eval.py` runs) on an engine serving the loop's current weights.

Shared by RL (`k2jax.rl.evaluation`: its rollout engine) and pretraining / SFT (`TrainEvaluator`, which
`launch/train.py` hands to `k2jax.train.loop.run`: an embedded engine over the trainer's parameters):

- `engine_model`: an engine as the runner's `Model` (tokenizer, stop tokens, log-likelihood scorer);
- `entry_config`: one entry as a checked `runner.EvalConfig` (files exist, every record parses, a
  multiple-choice task has a scorer), failing with `ConfigError` naming the entry's key;
- `run_task`: one evaluation of one task into `out` (its samples file removed first: the weights differ at
  every step, so a resumed run evaluates afresh), returning the task's report section.

Metrics are `eval/<name>/<metric>`: pass@k and maj@k for each k (voting formats), mean@n, multiple choice
acc and acc_norm.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import SingleDeviceSharding

from k2jax.api import model_from_state
from k2jax.data.eval_tasks import EvalTaskEntry, task_entries
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, Tokenizer, load_tokenizer
from k2jax.engine.base import Engine
from k2jax.engine.inference import EngineConfig, InferenceEngine
from k2jax.eval import runner
from k2jax.eval.scoring import EngineScorer, HttpScorer
from k2jax.eval.store import SAMPLES
from k2jax.eval.tasks import get_format
from k2jax.model.config import ConfigError, K2Config
from k2jax.serve.server import eos_ids
from k2jax.train.config import TrainConfig


def engine_model(
  engine: Engine, tokenizer: Tokenizer, stop_ids: tuple[int, ...], url: str = "", what: str = "engine"
) -> runner.Model:
  """An engine as the eval runner's `Model` (the same object: no second copy of the weights).

  `url`: the engine's server (or router), when it is one. Log-likelihoods (multiple choice) come from the
  engine's own prompt logprobs: the embedded engine's prefill, or the server's /generate
  `input_token_logprobs`; sglang-jax's colocated engine gives none. `what` names it in errors."""
  if url:
    return runner.Model(engine, tokenizer, tuple(stop_ids), HttpScorer(url), url)
  if isinstance(engine, InferenceEngine):
    where = f"the embedded {what}"
    return runner.Model(engine, tokenizer, tuple(stop_ids), EngineScorer(engine), where, engine.config.max_seq_len)
  return runner.Model(engine, tokenizer, tuple(stop_ids), None, f"the {what} ({type(engine).__name__})")


def entry_config(
  key: str, name: str, e: EvalTaskEntry, *, scorer: bool, where: str, max_tokens: int, concurrency: int
) -> runner.EvalConfig:
  """Entry `e` (config key `key`, metrics `eval/<name>/...`) as the runner's config, checked now: a missing
  file, a bad record or few-shot file, or a multiple-choice task on an engine without a scorer (`scorer`
  False; `where` names the engine) fails the run at start. `max_tokens`: when the entry gives 0."""
  for field, path in (("path", e.path), ("fewshot_file", e.fewshot_file)):
    if path and not os.path.isfile(path):
      raise ConfigError(f"{key}.{field}: no such file {path!r}")
  if get_format(e.format).kind == "choice" and not scorer:
    raise ConfigError(f"{key}.format: {e.format!r} is scored by log-likelihood, which {where} cannot give")
  cfg = runner.EvalConfig(
    model="",
    out="",
    progress=False,
    concurrency=concurrency,
    tasks=(runner.TaskSpec(name, e.path, e.format, fewshot_file=e.fewshot_file or None),),
    n=e.n,
    ks=tuple(e.ks),
    temperature=e.temperature,
    top_p=e.top_p,
    max_tokens=e.max_tokens or max_tokens,
    seed=e.seed,
    num_fewshot=e.num_fewshot,
    limit=e.limit or None,
    chat=e.chat,
    system=e.system or None,
  )
  try:
    runner.check_tasks(cfg)  # a bad record or few-shot file fails the run now, not at the first eval
  except (ValueError, OSError) as err:
    raise ConfigError(f"{key}: {err}") from None
  return cfg


def run_task(cfg: runner.EvalConfig, model: runner.Model, out: str, label: str) -> dict[str, Any]:
  """`cfg`'s one task on `model` into `out` (`label` names the weights in the report); its report section."""
  if os.path.exists(os.path.join(out, SAMPLES)):
    os.remove(os.path.join(out, SAMPLES))  # another run's weights at this step: evaluate afresh
  cfg = dataclasses.replace(cfg, out=out, model=label)
  (name,) = (t.name for t in cfg.tasks)
  return runner.run(cfg, model)["tasks"][name]


def metrics(name: str, section: dict[str, Any]) -> dict[str, float]:
  """A task's report section as `eval/<name>/<metric>` numbers."""
  return {f"eval/{name}/{k}": float(v) for k, v in section["metrics"].items()}


class TrainEvaluator:
  """Pretraining / SFT's `eval.tasks`: each task's records through the runner on an embedded engine that
  serves the trainer's current parameters, called by the loop as `evaluator(step, state)` (`state`: the
  model's pure state dict, params and router bias, as the trainer shards it).

  The engine (`InferenceEngine`, one device: process 0's first) is built at the first evaluation and its
  weights replaced at each later one (`update_weights_from_params`), so its programs compile once. It serves
  a copy of the weights (the trainer donates its buffers to the next step). Several processes: every
  process takes part in gathering the sharded weights (`process_allgather`, so each holds them on the host
  for a moment); process 0 alone runs the engine and the tasks and returns the metrics, the others
  return {} (only process 0 writes metrics.jsonl). The engine holds the whole model on one device, as
  `launch/eval.py`'s embedded engine does: a model larger than one device is evaluated from its
  checkpoints by `launch/eval.py` against a server instead.

  Writes W/eval/<task>/<step>/ (samples.jsonl, report.json, report.md), as RL and launch/eval.py do.
  """

  def __init__(
    self,
    entries: Sequence[tuple[str, str, EvalTaskEntry]],
    model: K2Config,
    tokenizer: Tokenizer,
    workdir: str,
    *,
    max_tokens: int,
    concurrency: int,
    engine: EngineConfig,
  ):
    """`entries`: `k2jax.data.eval_tasks.task_entries`'s; `max_tokens`: the tasks' default response length."""
    if not entries:
      raise ValueError("TrainEvaluator: no eval tasks")
    self.cfg, self.tokenizer, self.engine_config = model, tokenizer, engine
    self.root = os.path.join(workdir, "eval")
    self.stop_ids = eos_ids(model, tokenizer)
    self.names = tuple(name for _, name, _ in entries)
    where = "the embedded eval engine"
    self.tasks = [
      (name, entry_config(key, name, e, scorer=True, where=where, max_tokens=max_tokens, concurrency=concurrency))
      for key, name, e in entries
    ]
    self.engine: InferenceEngine | None = None

  def __call__(self, step: int, state: dict) -> dict[str, float]:
    """Every task on `state`'s weights: `eval/<task>/<metric>` and `eval/tasks_seconds` ({} off process 0)."""
    t0 = time.perf_counter()
    served = self._serve(state)
    if served is None:
      return {}
    if self.engine is None:
      lm = model_from_state(self.cfg, served)
      self.engine = InferenceEngine(
        lm, self.engine_config, eos_token_ids=self.stop_ids, detokenize=self.tokenizer.decode
      )
    else:
      self.engine.update_weights_from_params(served, weight_version=step)
    model = engine_model(self.engine, self.tokenizer, self.stop_ids, what="eval engine")
    out = {}
    for name, cfg in self.tasks:
      where = os.path.join(self.root, name, str(step))
      out.update(metrics(name, run_task(cfg, model, where, f"{model.where} (training step {step})")))
    out["eval/tasks_seconds"] = time.perf_counter() - t0
    return out

  def _serve(self, state: dict) -> dict | None:
    """A copy of `state` on process 0's first device (None on the other processes)."""
    if jax.process_count() > 1:
      state = multihost_utils.process_allgather(state, tiled=True)  # numpy, on every process
      if jax.process_index() != 0:
        return None
    here = SingleDeviceSharding(jax.local_devices()[0])
    return jax.device_put(state, here, may_alias=False)

  def close(self) -> None:
    if self.engine is not None:
      self.engine.close()
      self.engine = None


def train_evaluator(tc: TrainConfig, workdir: str) -> TrainEvaluator:
  """`eval.tasks` / `eval.tasks_file` of a pretraining / SFT config as its `TrainEvaluator` (what
  launch/train.py hands `k2jax.train.loop.run`): training's tokenizer, `eval.max_tokens` for tasks that give
  none, an engine of `eval.engine_max_slots` x `eval.engine_max_seq_len`."""
  e = tc.eval
  engine = EngineConfig(
    max_slots=e.engine_max_slots, max_seq_len=e.engine_max_seq_len or tc.model.max_position_embeddings
  )
  return TrainEvaluator(
    task_entries(e.tasks, e.tasks_file),
    tc.model,
    load_tokenizer(tc.data.tokenizer_path or BUNDLED_TOKENIZER),
    workdir,
    max_tokens=e.max_tokens,
    concurrency=e.concurrency,
    engine=engine,
  )
