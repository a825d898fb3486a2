"""`run(config, workdir)`: the RL learner. It only orchestrates; every piece lives in its own module.

Phases: config -> tokenizer and task -> model and optimizer -> the training core (mesh, sharded state,
restore; `k2jax.train.core`, shared with pretraining) -> engine and weight sync -> warm start -> loop.
Each iteration is synchronous (K2 §3.3: colocated generate -> train -> push):
  1. rollout   `RolloutManager.collect` on process 0 (groups, over-sampling, partial rollouts; rollout.py)
  2. check     bad samples are masked out and counted (batching.py); the arrays go to every process and
               onto the mesh, sharded on rows
  3. pi_old    recomputed by the sharded trainer, or the engine's sampling logprobs (loss.old_logprobs)
  4. update    K2 objective + PTX, one or more MuonClip steps with QK-Clip (rl_step.py), sharded per
               `mesh.rules` (fsdp | fsdp_ep | fsdp_ep_tp) exactly as pretraining
  5. sync      the colocated engine gets the new device arrays; a remote one the changed tensors, written
               by each process for the shards it holds (weight_sync.py); the new version is stamped on
               every token sampled after it
  6. eval      every `eval.every` iterations and at the end, after the push: held-out `eval.tasks` and the
               tasks' own prompts through k2jax.eval's runner on this engine (evaluation.py), `eval/<task>/*`
  7. log       `W/metrics.jsonl`; checkpoints `W/checkpoints/<it>/{model,opt,meta}` (`k2jax.train.Checkpointer`:
               async, keep-K, corrupt-latest fallback; `k2jax.load(W)`)
With several JAX processes (k2jax.distributed.initialize, as pretraining) the engine is remote, or the
embedded engine on a serving mesh over the trainer's own devices (`engine.sharding` tp | ep | tp_ep): every
process runs its loop in lockstep, process 0 drives the rollouts, and the phases alternate (phases.py:
optimizer state to host while generating, KV cache freed before the update, weights resharded device to
device after it; no file written). One process with `engine.sharding` set runs the same phases.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
from ml_collections import config_dict

from k2jax import configlib, distributed, sharding
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer
from k2jax.model import presets
from k2jax.model.config import ConfigError, K2Config
from k2jax.rl import batching, evaluation, rl_step
from k2jax.rl import critic as critic_lib
from k2jax.rl.config import EvalSpec, RLConfig, RLModelSpec
from k2jax.rl.algo import K2LossConfig, rollout_metrics, select_old_logprobs
from k2jax.engine.base import Engine
from k2jax.engine.sglang_jax import SglangJaxConfig
from k2jax.rl.phases import ColocateConfig, Phases
from k2jax.rl.programs import make_optimizer, make_update, trainer_mesh_shape
from k2jax.rl.ptx import PTXConfig, PTXSet
from k2jax.rl import tasks as tasks_lib
from k2jax.rl.rollout import RolloutConfig, RolloutManager, TemperatureSchedule
from k2jax.rl.rollout_engine import make_engine
from k2jax.rl.samples import append_rollouts
from k2jax.rl.task_runtime import TaskRuntime, TaskRuntimeConfig, runtime_config
from k2jax.rl.tasks import TASK_NAME, ArithmeticTaskConfig, MathJsonlTask, TaskSet, strip_stop
from k2jax.rl.weight_sync import WeightSync, WeightSyncConfig
from k2jax.engine.inference import EngineConfig, InferenceEngine
from k2jax.train import core
from k2jax.train.checkpoint import merge_dicts
from k2jax.train.config import MeshSpec
from k2jax.train.counting import flops_per_token
from k2jax.train.init_from import EXEC_FIELDS, check_workdir_model, resolve_model
from k2jax.train.metrics import MetricsLogger, measure_peak_flops, say


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """The runtime form of configs/rl.py, derived from its typed tree `k2jax.rl.config.RLConfig` (which declares
  every knob: default, type, doc, check) by `from_config_dict`."""

  seed: int
  iterations: int
  topology: str  # k2jax.memory.TOPOLOGIES name for --dry_run ('' = none)
  model: K2Config
  init_from: str
  read_budget_bytes: int  # HF init_from: host bytes of blocks in flight per process (convert/reader.py)
  mesh: MeshSpec
  tokenizer_path: str
  task_kind: str
  task_path: str
  task: ArithmeticTaskConfig
  rollout: RolloutConfig
  engine_url: str
  worker_urls: tuple[str, ...]
  engine: EngineConfig
  loss: K2LossConfig
  ptx: PTXConfig | None
  warm_start_steps: int
  warm_start_batch_size: int
  warm_start_lr: float
  lr: float
  weight_decay: float
  momentum: float
  qk_clip_tau: float | None
  bias_update_rate: float
  updates_per_batch: int
  seq_len: int
  sync: WeightSyncConfig
  checkpoint_every: int
  checkpoint_keep: int
  checkpoint_async: bool
  checkpoint_on_unreadable: str  # "error" | "fresh" (k2jax.train.checkpoint.restore_latest)
  tensorboard: bool
  eval_every: int
  log_rollouts: bool = False  # every sample's tokens and loss mask to W/rollouts.jsonl
  task_runtime: TaskRuntimeConfig = TaskRuntimeConfig()  # rewards (judge) and agentic episodes (env services)
  rollout_engine: str = "embedded"  # in-process engine without engine_url: embedded | sglang_jax_colocated
  sglang_jax: SglangJaxConfig = SglangJaxConfig()
  colocate: ColocateConfig = ColocateConfig()  # phases of an engine on a serving mesh (phases.py)
  critic: critic_lib.CriticConfig | None = None  # closed-loop critic refinement (critic.py); None = off
  spec: RLConfig | None = None  # the typed configs/rl.py tree this was derived from (new knobs: read them here)

  @property
  def rows(self) -> int:
    return self.rollout.target_groups * self.rollout.group_size


TASK_NAMES = {"arith": TASK_NAME, "math_jsonl": MathJsonlTask.name}  # task.kind -> budget key


def _spec(c) -> RLConfig:
  return c if isinstance(c, RLConfig) else configlib.build(RLConfig, c, error=ConfigError)


def model_config(c) -> K2Config:
  """The policy's K2Config: `model.preset` with its execution knobs, or `model.init_from`'s architecture.
  `c`: the RL ConfigDict (or plain dict) or its RLConfig."""
  m = c.model if isinstance(c, RLConfig) else configlib.build(RLModelSpec, c.model, key="model", error=ConfigError)
  try:
    preset = presets.get(m.preset, **{k: getattr(m, k) for k in EXEC_FIELDS if hasattr(m, k)})
  except KeyError as e:
    raise ConfigError(f"model.preset: {e.args[0]}") from None
  return resolve_model(preset, m.init_from, key="model.init_from")


def from_config_dict(c, workdir: str, stop_ids: tuple[int, ...], *, check_files: bool = True) -> LearnerConfig:
  """RL ConfigDict (or plain dict) -> LearnerConfig (the one boundary): `configlib.build` checks every key
  of the RLConfig tree (errors name the dotted key), then the values computed from several keys are derived
  here. `check_files=False` (compiling for a slice, `k2jax.rl.aot`) does not ask for the task file to exist."""
  rc = _spec(c)
  model = model_config(rc)
  r, t, o = rc.rollout, rc.task, rc.optim
  rollout = RolloutConfig(
    group_size=r.group_size,
    target_groups=r.target_groups,
    launch_groups=r.launch_groups,
    partial_rollout=r.partial_rollout,
    max_staleness=r.max_staleness,
    task_budgets=tasks_lib.task_budgets(c, check_files=check_files),
    truncation_penalty=t.truncation_penalty,
    temperature=TemperatureSchedule(r.temperature, r.temperature_final, r.temperature_half_life),
    top_p=r.top_p,
    stop_token_ids=tuple(stop_ids),
    max_concurrency=r.max_concurrency,
    max_infra_error_frac=rc.reward.max_infra_error_frac,
  )
  loss = K2LossConfig(**dataclasses.asdict(rc.loss))
  ptx = PTXConfig(**dataclasses.asdict(rc.ptx)) if loss.ptx_coef > 0 else None
  s = rc.sglang_jax
  paddings = {k: tuple(int(x) for x in getattr(s, k).split(",") if x) for k in SGLANG_PADDINGS}
  lc = LearnerConfig(
    seed=rc.seed,
    iterations=rc.iterations,
    topology=rc.topology,
    model=model,
    init_from=rc.model.init_from,
    read_budget_bytes=rc.model.read_budget_bytes,
    mesh=rc.mesh,
    tokenizer_path=rc.tokenizer_path or BUNDLED_TOKENIZER,
    task_kind=t.kind,
    task_path=t.path,
    task=ArithmeticTaskConfig(t.a_min, t.a_max, t.b_min, t.b_max, t.seed, t.template),
    rollout=rollout,
    engine_url=r.engine_url,
    worker_urls=tuple(u for u in r.worker_urls.split(",") if u),
    engine=EngineConfig(**dataclasses.asdict(rc.engine)),
    loss=loss,
    ptx=ptx,
    warm_start_steps=rc.warm_start.steps,
    warm_start_batch_size=rc.warm_start.batch_size,
    warm_start_lr=rc.warm_start.lr,
    lr=o.lr,
    weight_decay=o.weight_decay,
    momentum=o.momentum,
    qk_clip_tau=o.qk_clip_tau or None,
    bias_update_rate=o.bias_update_rate,
    updates_per_batch=o.updates_per_batch,
    seq_len=rc.train.seq_len,
    sync=WeightSyncConfig(
      rc.sync.root or os.path.join(workdir, "weights"), keep_last=rc.sync.keep_last, dtype=_push_dtype(rc)
    ),
    checkpoint_every=rc.checkpoint.every,
    checkpoint_keep=rc.checkpoint.keep,
    checkpoint_async=rc.checkpoint.async_save,
    checkpoint_on_unreadable=rc.checkpoint.on_unreadable,
    tensorboard=rc.log.tensorboard,
    eval_every=rc.eval.every,
    log_rollouts=rc.log.rollouts,
    task_runtime=runtime_config(c),
    rollout_engine=r.engine,
    sglang_jax=SglangJaxConfig(**{**dataclasses.asdict(s), **paddings}),
    colocate=ColocateConfig(**dataclasses.asdict(rc.colocate)),
    critic=critic_lib.CriticConfig(**dataclasses.asdict(rc.critic), seed=rc.seed) if rc.critic.coef > 0 else None,
    spec=rc,
  )
  if rc.rollout.quantization and model.num_moe_layers == 0:
    raise ConfigError(
      f"rollout.quantization: {rc.rollout.quantization!r} quantizes the routed experts and model "
      f"{rc.model.init_from or rc.model.preset!r} has none (every layer is a dense MLP)"
    )
  mixed = len(rc.tasks) > 0  # tasks.* sections (validated by tasks.task_specs) replace the single task.*
  for key, ok in (  # checks across sections or against the resolved model and files (the rest: RLConfig)
    ("task.kind", mixed or lc.task_kind in TASK_NAMES),
    ("task.path", mixed or lc.task_kind != "math_jsonl" or not check_files or os.path.isfile(lc.task_path)),
    ("warm_start.steps", mixed or lc.task_kind == "arith" or lc.warm_start_steps == 0),
    ("train.seq_len", 2 <= lc.seq_len <= model.max_position_embeddings),
  ):
    if not ok:
      raise ConfigError(f"{key}: invalid value in the RL config")
  return lc


SGLANG_PADDINGS = ("precompile_bs_paddings", "precompile_token_paddings")  # comma-separated ints in the config


def _push_dtype(rc: RLConfig) -> str | None:
  """The dtype of pushes to a remote engine: INT4 rollouts push the release's INT4 layout (RLConfig.validate
  refuses another sync.dtype with them)."""
  return rc.sync.dtype or ("int4" if rc.rollout.quantization == "int4" else None)


def run(config: config_dict.ConfigDict, workdir: str) -> dict:
  """RL-train per `config` in `workdir`, resuming from its latest checkpoint. Returns the last metrics."""
  tok = load_tokenizer(config.tokenizer_path or BUNDLED_TOKENIZER)
  task = tasks_lib.make_tasks(config, tok)
  lc = from_config_dict(config, workdir, tasks_lib.stop_ids(task, tok))
  if tok.vocab_size != lc.model.vocab_size:
    raise ConfigError(
      f"tokenizer_path: {tok.path} has {tok.vocab_size} tokens, the model's vocab_size is {lc.model.vocab_size}"
    )
  learner = Learner(lc, workdir, task, strip_stop(tok.decode, lc.rollout.stop_token_ids))
  try:
    return learner.train()
  finally:
    learner.close()


class Learner:
  """Holds the sharded train state, the engine, the rollout manager and the weight sync for one run."""

  def __init__(self, lc: LearnerConfig, workdir: str, task, decode, engine: Engine | None = None, devices=None):
    """`task`: a `tasks.TaskSet` (`tasks.make_tasks`) or one task (a set of one). `devices`: the trainer's
    mesh devices (default: every device of every process; a subset, for a single process whose other devices
    do other work)."""
    task = task if isinstance(task, TaskSet) else TaskSet([(task, 1)])
    self.lc, self.workdir, self.task, self.decode = lc, os.path.abspath(workdir), task, decode
    self.primary = jax.process_index() == 0
    # Model and optimizer: warm-start LR for the first warm_start_steps updates, then the RL LR.
    self.optimizer, self.schedule = make_optimizer(lc)
    # The training core: mesh, sharded state, restore (or init from init_from / the seed).
    shape = trainer_mesh_shape(lc, jax.device_count() if devices is None else len(devices))
    check_workdir_model(self.workdir, lc.model)
    self.core = core.build(
      lc.model,
      self.optimizer,
      mesh_shape=shape,
      dcn_shape=lc.mesh.dcn_shape,  # multislice: the slices' devices laid out as launch/train.py lays them
      preset=lc.mesh.rules,
      seed=lc.seed,
      init_from=lc.init_from,
      read_budget_bytes=lc.read_budget_bytes,
      devices=devices,
      workdir=self.workdir,
      keep=lc.checkpoint_keep,
      async_save=lc.checkpoint_async,
      on_unreadable=lc.checkpoint_on_unreadable,
    )
    self.state = self.core.state
    self.meta = {"iteration": 0, "weight_version": 0, "prompts_drawn": 0, "warm_start_done": False}
    # updates not applied, counted apart (rl_step.py): no signal (provably zero gradient), non-finite
    self.meta.update(dropped_updates=0, nonfinite_updates=0)
    if self.core.restored_step is not None:
      counters = ("dropped_updates", "nonfinite_updates")  # 0 in a checkpoint written before they were counted
      self.meta.update({k: self.core.meta.get(k, 0) if k in counters else self.core.meta[k] for k in self.meta})
      say(
        f"resumed RL from {self.core.ckpt.directory}/{self.core.restored_step} (weight version {self.meta['weight_version']})"
      )
    self.mdef = self.core.mdef
    # Engine (process 0 talks to it; on a serving mesh every process runs it) and weight sync.
    everywhere = not lc.engine_url and bool(lc.engine.sharding)
    self.engine = engine or (make_engine(lc, self._model_state(), decode) if self.primary or everywhere else None)
    self.sync = WeightSync(lc.sync, self.engine, lc.model, initial_version=self.meta["weight_version"])
    phased = isinstance(self.engine, InferenceEngine) and not self.engine.shares_pushed_buffers
    self.phases = Phases(self.engine, lc.colocate, lambda: self.state, self._set_state) if phased else None
    # Steps: the K2 objective and the warm-start NLL plugged into the core (fixed [rows, seq_len] shapes);
    # the params stay undonated when the engine may serve the trainer's own arrays.
    donate = not self.sync.shares_buffers
    tau = lc.qk_clip_tau
    self.rl_step = self.core.jit(make_update(lc, self.mdef, self.optimizer, self.schedule), donate_params=donate)
    sft_step = rl_step.make_sft_step(self.mdef, self.optimizer, self.schedule, qk_clip_tau=tau)
    self.sft_step = self.core.jit(sft_step, donate_params=donate)
    logprobs = distributed.compiled_together(
      jax.jit(rl_step.make_logprobs_fn(self.mdef), out_shardings=self.core.batch_sharding), "logprobs"
    )

    def logprobs_fn(params, bias, tokens_BT, segment_ids_BT):
      with self.core.use():
        return logprobs(params, bias, tokens_BT, segment_ids_BT)

    self.logprobs_fn = logprobs_fn
    self.ptx = PTXSet(lc.ptx, load_tokenizer(lc.tokenizer_path)) if lc.ptx else None
    self.manager = self.runtime = None
    rubric = lc.task_runtime.reward.rubric  # the critic learns the rubric reward's own pairwise judgment
    self.critic = critic_lib.make_refiner(lc.critic, lc.tokenizer_path, rubric, task.reward_kinds)
    if self.primary:
      self.runtime = TaskRuntime(task, lc.task_runtime, self.engine, load_tokenizer(lc.tokenizer_path))
      self.manager = RolloutManager(
        lc.rollout,
        self.engine,
        self._prompts(self.meta["prompts_drawn"]),
        self.critic.recording(self.runtime.reward_fn) if self.critic else self.runtime.reward_fn,
        decode=decode,
        episodes=self.runtime.episodes,
        grading_budget=self.runtime.grading_budget,
        start_iteration=self.meta["iteration"],
        start_uid=self.meta["prompts_drawn"],
      )
    self.evaluator = None  # process 0: held-out tasks and the tasks' own prompts on the rollout engine
    if self.primary and lc.eval_every:
      tok = load_tokenizer(lc.tokenizer_path)
      model = evaluation.engine_model(self.engine, tok, lc.rollout.stop_token_ids, lc.engine_url)
      spec = lc.spec.eval if lc.spec is not None else EvalSpec(every=lc.eval_every)
      self.evaluator = evaluation.Evaluator(spec, task, tok, model, self.workdir, lc.rollout.budget)
    self.log = MetricsLogger(
      self.workdir,
      total_steps=lc.iterations,
      start_step=self.meta["iteration"],
      tensorboard=lc.tensorboard,
      progress=False,
      enabled=self.primary,
    )
    self.peak = measure_peak_flops(lc.model.compute_dtype)
    self.flops_per_token = flops_per_token(lc.model, lc.seq_len)

  # ---- setup ------------------------------------------------------------------------------------
  def _set_state(self, state) -> None:
    self.state = state

  def _generate(self, fn, *, push_follows: bool = True):
    """`fn()` on process 0 while the engine serves (None elsewhere); a generation phase when colocated on
    a serving mesh (every process enters it: the engine's loops run in lockstep)."""
    if self.phases is None:
      return fn() if self.primary else None
    with self.phases.generation(release_weights=push_follows):
      return fn() if self.primary else None

  def _model_state(self) -> dict:
    return merge_dicts(self.state.params, self.state.bias)

  def _prompts(self, start: int):
    for i, prompt in enumerate(self.task.prompts(start), start + 1):
      self.meta["prompts_drawn"] = i
      yield prompt

  def _on_mesh(self, arrays: dict) -> dict:
    """Host arrays (the whole batch, identical on every process) -> global arrays sharded on rows."""
    out = {}
    for k, v in arrays.items():
      v = np.asarray(v)
      sh = sharding.batch_sharding(self.core.mesh, self.core.preset, ndim=v.ndim)
      out[k] = distributed.global_batch(v[distributed.process_rows(v.shape[0], sh)], sh, v.shape[0])
    return out

  def _share(self, arrays: dict) -> dict:
    """Process 0's host arrays on every process (the rollouts only run there)."""
    if jax.process_count() == 1:
      return arrays
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(arrays))

  # ---- checkpoints ------------------------------------------------------------------------------
  def _save(self) -> None:
    self.core.ckpt.save(self.meta["iteration"], self.state, None, dict(self.meta))

  # ---- loop -------------------------------------------------------------------------------------
  def train(self) -> dict:
    lc = self.lc
    self._push(full=True)  # wherever the engine started from, it now serves the trainer's weights
    if not self.meta["warm_start_done"]:
      self._warm_start()
    last: dict = {}
    while self.meta["iteration"] < lc.iterations:
      last = self.iteration()
      if self.meta["iteration"] % lc.checkpoint_every == 0 or self.meta["iteration"] == lc.iterations:
        self._save()
    self.core.ckpt.wait()  # the last checkpoint is on disk when train() returns
    return last

  def iteration(self) -> dict:
    """One rollout -> update -> sync round; returns (and logs) its metrics ({} off process 0)."""
    lc, t0 = self.lc, time.perf_counter()
    version = self.sync.version
    shape = {"rows": lc.rows, "seq_len": lc.seq_len}
    collected = self._generate(lambda: self.manager.collect(version))
    if self.primary:
      batch, rstats = collected
      if lc.log_rollouts:
        append_rollouts(os.path.join(self.workdir, "rollouts.jsonl"), batch, version)
      arrays, dropped = batching.to_train_arrays(batch, **shape, vocab_size=lc.model.vocab_size, version=version)
    else:
      arrays = batching.empty_train_arrays(**shape)
    t1 = time.perf_counter()
    host = self._share(arrays)
    dev = self._on_mesh(host)
    s = self.state
    old_BT = select_old_logprobs(
      lc.loss,
      dev["engine_logprobs_BT"],
      lambda: self.logprobs_fn(s.params, s.bias, dev["tokens_BT"], dev["segment_ids_BT"]),
    )
    critic = None  # this batch's verifiable pairs: rows for the update, agreement on held-out pairs
    if self.critic is not None:
      score = lambda tokens_BT, seg_BT: self.logprobs_fn(s.params, s.bias, tokens_BT, seg_BT)  # noqa: E731
      share = lambda a: self._on_mesh(self._share(a))  # noqa: E731
      it = self.meta["iteration"]
      critic, crec = critic_lib.critic_step(self.critic, collected[0] if self.primary else None, it, share, score)
    ptx, applied = None, []
    for _ in range(lc.updates_per_batch):
      if self.ptx is not None:
        ptx = self._on_mesh(self.ptx.batch(int(self.state.step)))
      self.state, metrics = self.rl_step(self.state, dev, old_BT, ptx, critic)
      applied.append((metrics["dropped"], metrics["finite"]))
    metrics, applied = jax.device_get((metrics, applied))
    updates = {
      "updates_dropped": sum(int(d) for d, _ in applied),  # no signal: provably zero gradient (rl_step.py)
      "updates_nonfinite": sum(1 - int(f) for _, f in applied),
    }
    self.meta.update(
      dropped_updates=self.meta["dropped_updates"] + updates["updates_dropped"],
      nonfinite_updates=self.meta["nonfinite_updates"] + updates["updates_nonfinite"],
    )
    t2 = time.perf_counter()
    new_version = self._push()
    t3 = time.perf_counter()
    self.meta.update(iteration=self.meta["iteration"] + 1, weight_version=new_version)
    it = self.meta["iteration"]
    evaluate = lc.eval_every and (it % lc.eval_every == 0 or it == lc.iterations)
    evals = self._generate(self.evaluate, push_follows=False) if evaluate else None
    if not self.primary:
      return {}
    rec = {k: v for k, v in metrics.items() if k not in ("finite", "dropped", "max_attn_logit_per_layer")}
    rec.update(updates, dropped_updates=self.meta["dropped_updates"], nonfinite_updates=self.meta["nonfinite_updates"])
    rec.update(rollout_metrics(batch), **batching.staleness(batch, version))
    if lc.loss.old_logprobs == "trainer" and jax.process_count() == 1:  # train/inference mismatch of the engine
      gap = batching.engine_logprob_gap(arrays, batch, jax.device_get(old_BT), version)
      if gap is not None:
        rec["engine_logprob_max_abs_diff"] = gap
    rec.update({f"rollout_{k}": v for k, v in rstats.items()})
    if critic is not None:
      rec.update(crec)
    rec.update({f"dropped_{k}": int(dropped.get(k, 0)) for k in ("samples",) + batching.CHECKS})
    tokens = float(np.sum(host["segment_ids_BT"] > 0)) * lc.updates_per_batch
    wall = time.perf_counter() - t0
    if evaluate:
      rec.update(evals)
    if self.phases is not None:
      rec.update({f"{k}_time_s": v for k, v in self.phases.seconds.items()})
    rec.update(
      rollout_time_s=t1 - t0,
      train_time_s=t2 - t1,
      sync_time_s=t3 - t2,
      trainer_idle_fraction=1.0 - (t2 - t1) / max(wall, 1e-9),
      weight_version=new_version,
      tokens_per_sec=tokens / max(t2 - t1, 1e-9),
      mfu=tokens / max(t2 - t1, 1e-9) * self.flops_per_token / (self.peak * self.core.mesh.size),
    )
    rec = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in rec.items()}
    rec = {k: (np.asarray(v).tolist() if isinstance(v, np.ndarray) else v) for k, v in rec.items()}
    rec["step"] = self.meta["iteration"]
    self.log.write(rec)
    return rec

  def _warm_start(self) -> None:
    """Format-only SFT (random answers; tasks.py) for warm_start_steps updates, then greedy eval."""
    lc = self.lc
    rng = np.random.default_rng([lc.seed, 7])
    t0, losses = time.perf_counter(), []
    for _ in range(lc.warm_start_steps):
      tokens_BT = np.zeros((lc.warm_start_batch_size, lc.seq_len), np.int32)
      segment_ids_BT = np.zeros_like(tokens_BT)
      mask_BT = np.zeros_like(tokens_BT, dtype=np.float32)
      for b, (prompt, response) in enumerate(self.task.format_examples(lc.warm_start_batch_size, rng)):
        ids = (prompt + response)[: lc.seq_len]
        tokens_BT[b, : len(ids)], segment_ids_BT[b, : len(ids)] = ids, 1
        mask_BT[b, len(prompt) : len(ids)] = 1.0
      dev = self._on_mesh({"tokens_BT": tokens_BT, "segment_ids_BT": segment_ids_BT, "mask_BT": mask_BT})
      self.state, m = self.sft_step(self.state, dev["tokens_BT"], dev["segment_ids_BT"], dev["mask_BT"])
      losses.append(float(m["loss"]))
    self.meta["warm_start_done"] = True
    if lc.warm_start_steps:
      self._push()
    rec = {
      "step": 0,
      "phase": "warm_start",
      "loss": losses[-1] if losses else 0.0,
      "warm_start_loss_first": losses[0] if losses else 0.0,
      "warm_start_steps": lc.warm_start_steps,
      "lr": lc.warm_start_lr,
      "tokens_per_sec": 0.0,
      "mfu": 0.0,
      "warm_start_time_s": time.perf_counter() - t0,
      "weight_version": self.sync.version,
    }
    if lc.eval_every:
      evals = self._generate(self.evaluate, push_follows=False)
      if self.primary:
        rec.update(evals)
    self.log.write(rec)

  def evaluate(self) -> dict:
    """Every eval task on the policy the engine serves now (k2jax/rl/evaluation.py, through k2jax.eval's
    runner): `eval/<task>/<metric>`, `eval_accuracy` (the tasks' own prompts), `eval_time_s`."""
    return self.evaluator.run(self.meta["iteration"], self.sync.version)

  def _push(self, full: bool = False) -> int:
    return self.sync.push(self._model_state(), full=full)

  def close(self) -> None:
    if self.manager is not None:
      self.manager.close()
    if self.runtime is not None:
      self.runtime.close()
    self.log.close()
    self.core.ckpt.close()
    if self.engine is not None:
      self.engine.close()
