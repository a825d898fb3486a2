"""`run(config, workdir)`: pretraining / SFT from a configs/k2.py ConfigDict, in named phases:
config -> optimizer and data -> the training core (mesh, sharded state, restore; `k2jax.train.core`,
shared with RL) -> step -> loop.

The loop dispatches step n+1 before it reads step n's metrics, so the host never stalls the device
on a metrics fetch. A SIGTERM (or a multi-host preemption notice) saves a checkpoint at the current
step and returns.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from typing import Any, Callable

import jax
import optax
from ml_collections import config_dict

from k2jax import distributed
from k2jax.optim import QKClipSpec, muonclip, wsd_schedule
from k2jax.data.corpus import BUNDLED_CORPUS
from k2jax.data.tokenizer import BUNDLED_TOKENIZER
from k2jax.train import core, heldout, inputs
from k2jax.model.config import ConfigError
from k2jax.train.checkpoint import Checkpointer, merge_dicts
from k2jax.train.config import TrainConfig, check_runtime, eval_rows, from_config_dict, pipeline_spec
from k2jax.train.counting import flops_per_token
from k2jax.train.init_from import model_config_for_run
from k2jax.train.metrics import MetricsLogger, SpikeDetector, measure_peak_flops, say, to_record
from k2jax.train.step import TrainState, make_train_step


# `eval.tasks`' evaluator: `evaluate(step, state) -> {"eval/<task>/<metric>": value}`, called on every
# process at each evaluation with the model's pure state dict (params and router bias, sharded as trained).
TaskEval = Callable[[int, dict], dict]


def run(
  config: config_dict.ConfigDict, workdir: str, task_eval: Callable[[TrainConfig, str], TaskEval] | None = None
) -> dict:
  """Train per `config` in `workdir` (resuming from its latest checkpoint). Returns final metrics.

  `task_eval(tc, workdir)`: builds `eval.tasks`' evaluator (launch/train.py passes
  `k2jax.eval.inloop.train_evaluator`; this package sits below k2jax.eval and cannot build it). Called once
  before anything compiles (so a bad task fails the run at start); the evaluator then runs at the held-out
  loss's steps (every `eval.every_steps` and at the end) and its metrics join that step's eval line."""
  # Config: the one ConfigDict -> dataclass boundary, then checks against devices and files.
  tc = from_config_dict(config)
  tc = dataclasses.replace(tc, model=model_config_for_run(tc, workdir))
  mesh_shape = check_runtime(tc, jax.device_count(), jax.process_count())
  distributed.check_slices(math.prod(tc.mesh.dcn_shape.values()), jax.default_backend())
  if tc.eval.has_tasks and task_eval is None:
    raise ConfigError("eval.tasks: benchmark tasks need an evaluator: run launch/train.py (it builds one)")
  tasks = task_eval(tc, workdir) if tc.eval.has_tasks else None
  peak = _peak(tc)  # Before the mesh is active: measured on one device.
  # Optimizer and data.
  optimizer, schedule = make_optimizer(tc)
  holdout = heldout.holdout_split(tc.eval) if tc.eval.enabled else None
  it = inputs.make_iterator(tc.data, tc.model.vocab_size, holdout=holdout)
  # The training core: mesh, sharded state, restore (or initialise).
  c = core.build(
    tc.model,
    optimizer,
    mesh_shape=mesh_shape,
    preset=tc.mesh.rules,
    seed=tc.seed,
    init_from=tc.checkpoint.init_from,
    read_budget_bytes=tc.checkpoint.read_budget_bytes,
    workdir=workdir,
    keep=tc.checkpoint.keep,
    async_save=tc.checkpoint.async_save,
    on_unreadable=tc.checkpoint.on_unreadable,
    data_iter=it,
    offload_opt_state=tc.optim.offload_state,
    resume_from=tc.checkpoint.resume_from,
    pipeline=pipeline_spec(tc, mesh_shape),
    dcn_shape=tc.mesh.dcn_shape,
  )
  if c.restored_step is not None:
    say(f"resumed from {c.ckpt.directory}/{c.restored_step}")
    if not c.data_restored:
      it = inputs.make_iterator(tc.data, tc.model.vocab_size, seed_offset=int(c.state.step), holdout=holdout)
  # Step and loop.
  step_fn = c.jit(make_step(tc, c.mdef, optimizer, schedule, pipeline=pipeline_spec(tc, mesh_shape)))
  evaluator = make_evaluator(tc, c) if tc.eval.enabled else None
  if evaluator is not None and tasks is not None:
    same = set(getattr(tasks, "names", ())) & {s.name for s in evaluator.sources}
    if same:
      raise ConfigError(f"eval.tasks: {sorted(same)} also name held-out sources (eval/<name>/...): rename them")
  try:
    return _Loop(tc, workdir, step_fn, c.ckpt, c.batch_sharding, c.meta, peak, evaluator, tasks).run(c.state, it)
  finally:
    if hasattr(tasks, "close"):
      tasks.close()


def make_evaluator(tc: TrainConfig, layout: core.Layout) -> heldout.Evaluator:
  """The held-out evaluator of `eval.*` on the training mesh (`eval.path`'s files or `eval.fraction` of
  `data.path`), with training's tokenizer, sequence length and data kind."""
  return heldout.Evaluator(
    heldout.sources_for(tc.eval, tc.data.path or BUNDLED_CORPUS),
    layout,
    kind=tc.data.kind,
    seq_len=tc.data.seq_len,
    rows=eval_rows(tc),
    tokenizer_path=tc.data.tokenizer_path or BUNDLED_TOKENIZER,
    max_batches=tc.eval.steps,
  )


def make_optimizer(tc: TrainConfig) -> tuple[optax.GradientTransformationExtraArgs, optax.Schedule]:
  """MuonClip with the run's WSD schedule: (optimizer, schedule)."""
  schedule = _schedule(tc)
  o = tc.optim
  optimizer = muonclip(
    schedule,
    weight_decay=o.weight_decay,
    momentum=o.momentum,
    adam_b1=o.adam_b1,
    adam_b2=o.adam_b2,
    adam_eps=o.adam_eps,
    qk_clip_tau=_qk_clip_tau(tc),
    qk_clip_spec=QKClipSpec.from_config(tc.model),
  )
  return optimizer, schedule


def make_step(tc: TrainConfig, mdef, optimizer, schedule, *, pipeline=None) -> Callable:
  """The (unjitted) pretraining / SFT step of `run()`; `launch/train.py --aot` compiles exactly this for a
  TPU topology (k2jax.train.aot). `pipeline`: `config.pipeline_spec` on the run's mesh."""
  return make_train_step(
    mdef,
    optimizer,
    schedule,
    num_microbatches=tc.data.num_microbatches,
    bias_update_rate=tc.optim.bias_update_rate,
    qk_clip_tau=_qk_clip_tau(tc),
    pipeline=pipeline,
  )


def _qk_clip_tau(tc: TrainConfig) -> float | None:
  return tc.optim.qk_clip_tau if tc.optim.qk_clip_tau > 0 else None


def _schedule(tc: TrainConfig):
  decay = round(tc.optim.decay_fraction * tc.steps)
  warmup = min(tc.optim.warmup_steps, tc.steps - decay)
  return wsd_schedule(
    tc.optim.peak_lr,
    warmup_steps=warmup,
    stable_steps=tc.steps - decay - warmup,
    decay_steps=decay,
    final_lr=tc.optim.final_lr,
  )


def _peak(tc: TrainConfig) -> tuple[float, str]:
  """(per-device peak FLOP/s for MFU, where it came from)."""
  if tc.log.peak_flops > 0:
    return tc.log.peak_flops, "config log.peak_flops"
  dtype = tc.model.compute_dtype
  return measure_peak_flops(dtype), f"measured {dtype} matmul rate of one device at start"


class _Loop:
  """The host loop: feed batches, save checkpoints, log metrics one step behind the device."""

  def __init__(
    self,
    tc: TrainConfig,
    workdir: str,
    step_fn,
    ckpt: Checkpointer,
    batch_sharding,
    meta: dict,
    peak: tuple[float, str],
    evaluator: heldout.Evaluator | None = None,
    tasks: TaskEval | None = None,
  ):
    self.tc, self.workdir, self.step_fn, self.ckpt = tc, workdir, step_fn, ckpt
    self.batch_sharding = batch_sharding
    self.primary = jax.process_index() == 0
    self.spikes = SpikeDetector(tc.log.spike_factor, tc.log.spike_window, meta.get("spike_history"))
    self.flops_per_token = flops_per_token(tc.model, tc.data.seq_len)
    self.tokens_per_step = tc.data.global_batch_size * tc.data.seq_len
    self._sigterm = threading.Event()
    self.last: dict = {}
    self.peak, self.peak_source = peak
    self.evaluator, self.tasks = evaluator, tasks

  def run(self, state: TrainState, it) -> dict:
    tc = self.tc
    start = int(state.step)
    previous_handler = self._install_sigterm()
    say(
      f"MFU peak {self.peak:.3e} FLOP/s per device ({self.peak_source}); "
      f"{self.flops_per_token:.3e} training FLOPs/token"
    )
    self.log = MetricsLogger(
      self.workdir,
      total_steps=tc.steps,
      start_step=start,
      tensorboard=tc.log.tensorboard,
      progress=tc.log.progress,
      enabled=self.primary,
    )
    self._t, self._t_step = 0.0, None
    step, pending, saved = start, None, start
    try:
      if (self.evaluator is not None or self.tasks is not None) and tc.eval.at_start:
        self._evaluate(step, state)
      while step < tc.steps:
        if self._sigterm.is_set() or self.ckpt.reached_preemption(step):
          logging.warning("stop requested at step %d: saving a checkpoint and exiting", step)
          break
        data_state = it.get_state() if tc.log.spike_factor > 0 else None
        host = next(it)
        state, metrics = self.step_fn(state, inputs.to_global(host, self.batch_sharding, tc.data.global_batch_size))
        step += 1
        if pending is not None:
          self._handle(*pending)
        pending = (step, metrics, inputs.fingerprint(host), data_state)
        evaluate = self._eval_due(step)
        if step % tc.checkpoint.every_steps == 0 or evaluate:
          # Read this step's metrics first: the saved spike history then ends exactly at `step`, and the
          # eval line follows its step's training line. The eval comes before the save: a run killed after
          # the save resumes past this step and keeps its eval line (metrics.jsonl keeps lines <= step).
          self._handle(*pending)
          pending = None
          if evaluate:
            self._evaluate(step, state)
          if step % tc.checkpoint.every_steps == 0:
            self._save(step, state, it)
            saved = step
      if pending is not None:
        self._handle(*pending)
      if saved != step:
        self._save(step, state, it)
    finally:
      self.ckpt.close()
      self.log.close()
      if previous_handler is not None:
        signal.signal(signal.SIGTERM, previous_handler)
    return dict(self.last, step=step)

  def _eval_due(self, step: int) -> bool:
    if self.evaluator is None and self.tasks is None:
      return False
    every = self.tc.eval.every_steps
    return step == self.tc.steps or (every > 0 and step % every == 0)

  def _evaluate(self, step: int, state: TrainState) -> None:
    t = time.perf_counter()
    record = self.evaluator.evaluate(state.params, state.bias) if self.evaluator is not None else {}
    if self.tasks is not None:
      record.update(self.tasks(step, merge_dicts(state.params, state.bias)))
    seconds = time.perf_counter() - t
    self.log.write_eval({"step": step, **record, "eval/seconds": seconds})
    self._t += seconds  # Eval time is not training time: tokens/s and MFU leave it out.

  def _save(self, step: int, state: TrainState, it) -> None:
    meta = {"spike_history": self.spikes.state(), "process_count": jax.process_count()}
    self.ckpt.save(step, state, it, meta)

  def _handle(self, step: int, metrics: dict, fp: str, data_state: Any) -> None:
    """Read step `step`'s metrics (its successor is already dispatched): spikes, then logging."""
    loss = float(jax.device_get(metrics["loss"]))
    if self._t_step is None:  # The first step includes compilation: time from its end instead.
      self._t, self._t_step = time.perf_counter(), step
    if self.spikes.check(loss):
      self._report_spike(step, loss, fp, data_state)
    if step % self.tc.log.every_steps and step != self.tc.steps:
      self.log.advance(step)
      return
    fetched = jax.device_get(metrics)
    now = time.perf_counter()
    steps_timed = step - self._t_step
    tps = self.tokens_per_step * steps_timed / (now - self._t) if steps_timed else 0.0
    self._t, self._t_step = now, step
    mfu = tps * self.flops_per_token / (self.peak * jax.device_count())
    self.last = to_record(step, fetched, tokens_per_sec=tps, mfu=mfu)
    self.log.write(self.last)

  def _report_spike(self, step: int, loss: float, fp: str, data_state: Any) -> None:
    rec = {
      "step": step,
      "loss": loss,
      "baseline_mean": sum(self.spikes.history) / len(self.spikes.history),
      "batch_fingerprint": fp,
      "process_index": jax.process_index(),
      "data_state_before": data_state,
    }
    logging.warning("loss spike at step %d: %.4f (batch %s)", step, loss, fp)
    with open(os.path.join(self.workdir, f"spikes.process{jax.process_index()}.jsonl"), "a") as f:
      f.write(json.dumps(rec, sort_keys=True, default=str) + "\n")

  def _install_sigterm(self):
    """Single-process SIGTERM -> save and stop (multi-host runs use JAX's preemption sync instead).
    Returns the handler it replaced (None when it installed nothing)."""
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      return signal.signal(signal.SIGTERM, lambda *_: self._sigterm.set())
    return None
