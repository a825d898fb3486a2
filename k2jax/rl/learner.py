"""`run(config, workdir)`: the RL learner. It only orchestrates; every piece lives in its own module.

Phases: config -> tokenizer and task -> model and optimizer -> restore -> engine and weight sync ->
warm start -> loop. Each iteration is synchronous (K2 §3.3: colocated generate -> train -> push):
  1. rollout   `RolloutManager.collect` (groups, over-sampling, partial rollouts; rollout.py)
  2. check     bad samples are masked out and counted (batching.py)
  3. pi_old    recomputed by the trainer, or the engine's sampling logprobs (loss.old_logprobs)
  4. update    K2 objective + PTX, one or more MuonClip steps with QK-Clip (rl_step.py)
  5. sync      changed tensors as HF safetensors -> engine `update_weights` (weight_sync.py); the new
               version is stamped on every token sampled after it
  6. log       `W/metrics.jsonl`; orbax checkpoints `W/checkpoints/<it>/{model,opt,meta}` (`k2jax.load(W)`)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from ml_collections import config_dict

import k2jax
from k2jax.api import model_from_state
from k2jax.convert import hf as hf_io
from k2jax.convert import workdir as wd
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer
from k2jax.model import presets
from k2jax.model.config import ConfigError, K2Config
from k2jax.model.transformer import K2Model
from k2jax.optim import QKClipSpec, muonclip
from k2jax.rl import batching, rl_step
from k2jax.rl.algo import K2LossConfig, rollout_metrics, select_old_logprobs
from k2jax.engine.base import Engine, GenerateRequest, SamplingParams
from k2jax.engine.http import HttpEngine, HttpEngineConfig
from k2jax.engine.routed import RoutedEngine
from k2jax.rl.ptx import PTXConfig, PTXSet
from k2jax.rl.rewards.base import Completion, per_sample
from k2jax.rl.rollout import RolloutConfig, RolloutManager, TemperatureSchedule
from k2jax.rl.tasks import TASK_NAME, ArithmeticTask, ArithmeticTaskConfig, MathJsonlTask, strip_stop
from k2jax.rl.weight_sync import WeightSync, WeightSyncConfig
from k2jax.engine.inference import EngineConfig, InferenceEngine
from k2jax.train.checkpoint import merge_dicts, split_dict
from k2jax.train.counting import flops_per_token
from k2jax.train.metrics import MetricsLogger, measure_peak_flops, say
from k2jax.train.step import ModelDef, TrainState, init_state


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """The typed form of configs/rl.py (see that file for every field's meaning)."""

  seed: int
  iterations: int
  model: K2Config
  init_from: str
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
  tensorboard: bool
  eval_every: int

  @property
  def rows(self) -> int:
    return self.rollout.target_groups * self.rollout.group_size


TASK_NAMES = {"arith": TASK_NAME, "math_jsonl": MathJsonlTask.name}  # task.kind -> budget key


def from_config_dict(c: config_dict.ConfigDict, workdir: str, stop_ids: tuple[int, ...]) -> LearnerConfig:
  """ConfigDict -> LearnerConfig (the one boundary); errors name the config key."""
  model = _model_config(c.model)
  r = c.rollout
  rollout = RolloutConfig(
    group_size=r.group_size,
    target_groups=r.target_groups,
    launch_groups=r.launch_groups,
    partial_rollout=r.partial_rollout,
    max_staleness=r.max_staleness,
    task_budgets=((TASK_NAMES.get(c.task.kind, c.task.kind), c.task.budget),),
    truncation_penalty=c.task.truncation_penalty,
    temperature=TemperatureSchedule(r.temperature, r.temperature_final, r.temperature_half_life),
    top_p=r.top_p,
    stop_token_ids=tuple(stop_ids),
    max_concurrency=r.max_concurrency,
  )
  loss = K2LossConfig(tau=c.loss.tau, ptx_coef=c.loss.ptx_coef, old_logprobs=c.loss.old_logprobs)
  ptx = PTXConfig(c.ptx.source, c.ptx.num_samples, c.ptx.batch_size, c.ptx.seq_len) if loss.ptx_coef > 0 else None
  lc = LearnerConfig(
    seed=c.seed,
    iterations=c.iterations,
    model=model,
    init_from=c.model.init_from,
    tokenizer_path=c.tokenizer_path or BUNDLED_TOKENIZER,
    task_kind=c.task.kind,
    task_path=c.task.path,
    task=ArithmeticTaskConfig(c.task.a_min, c.task.a_max, c.task.b_min, c.task.b_max, c.task.seed, c.task.template),
    rollout=rollout,
    engine_url=r.engine_url,
    worker_urls=tuple(u for u in r.worker_urls.split(",") if u),
    engine=EngineConfig(max_slots=c.engine.max_slots, max_seq_len=c.engine.max_seq_len),
    loss=loss,
    ptx=ptx,
    warm_start_steps=c.warm_start.steps,
    warm_start_batch_size=c.warm_start.batch_size,
    warm_start_lr=c.warm_start.lr,
    lr=c.optim.lr,
    weight_decay=c.optim.weight_decay,
    momentum=c.optim.momentum,
    qk_clip_tau=c.optim.qk_clip_tau or None,
    bias_update_rate=c.optim.bias_update_rate,
    updates_per_batch=c.optim.updates_per_batch,
    seq_len=c.train.seq_len,
    sync=WeightSyncConfig(c.sync.root or os.path.join(workdir, "weights"), keep_last=c.sync.keep_last),
    checkpoint_every=c.checkpoint.every,
    checkpoint_keep=c.checkpoint.keep,
    tensorboard=c.log.tensorboard,
    eval_every=c.eval.every,
  )
  for key, ok in (
    ("iterations", lc.iterations >= 1),
    ("optim.lr", lc.lr > 0),
    ("task.kind", lc.task_kind in TASK_NAMES),
    ("task.path", lc.task_kind != "math_jsonl" or os.path.isfile(lc.task_path)),
    ("warm_start.steps", lc.task_kind == "arith" or lc.warm_start_steps == 0),
    ("optim.updates_per_batch", lc.updates_per_batch >= 1),
    ("warm_start.steps", lc.warm_start_steps >= 0),
    ("checkpoint.every", lc.checkpoint_every >= 1),
    ("train.seq_len", 2 <= lc.seq_len <= model.max_position_embeddings),
    ("rollout.engine_url", all(u.startswith(("http://", "https://")) for u in (lc.engine_url,) + lc.worker_urls if u)),
    ("rollout.worker_urls", not lc.worker_urls or bool(lc.engine_url)),
  ):
    if not ok:
      raise ConfigError(f"{key}: invalid value in the RL config")
  return lc


def _model_config(m: config_dict.ConfigDict) -> K2Config:
  exec_kw = {"param_dtype": m.param_dtype, "compute_dtype": m.compute_dtype}
  if not m.init_from:
    return presets.get(m.preset, **exec_kw)
  if wd.is_workdir(m.init_from):
    return wd.read_model_config(m.init_from, **exec_kw)
  if os.path.isfile(os.path.join(m.init_from, "config.json")):
    return hf_io.read_config(m.init_from, **exec_kw)
  raise ConfigError(f"model.init_from: {m.init_from!r} is neither a k2jax workdir nor an HF directory")


def run(config: config_dict.ConfigDict, workdir: str) -> dict:
  """RL-train per `config` in `workdir`, resuming from its latest checkpoint. Returns the last metrics."""
  tok = load_tokenizer(config.tokenizer_path or BUNDLED_TOKENIZER)
  # A chat-templated task also ends an answer at the end of the assistant turn.
  stop_ids = (tok.eos_id,) if config.task.kind == "arith" else (tok.eos_id, tok.special_ids["<|im_end|>"])
  lc = from_config_dict(config, workdir, stop_ids)
  if tok.vocab_size != lc.model.vocab_size:
    raise ConfigError(
      f"tokenizer_path: {tok.path} has {tok.vocab_size} tokens, the model's vocab_size is {lc.model.vocab_size}"
    )
  task = (
    ArithmeticTask(lc.task, tok.encode, tok.eos_id) if lc.task_kind == "arith" else MathJsonlTask(lc.task_path, tok)
  )
  learner = Learner(lc, workdir, task, strip_stop(tok.decode, lc.rollout.stop_token_ids))
  try:
    return learner.train()
  finally:
    learner.close()


def make_engine(lc: LearnerConfig, state: TrainState, decode) -> Engine:
  """The rollout engine: SGLang over HTTP when `engine_url` is set (through a router when `worker_urls`
  are too), else the embedded k2jax engine in this process, serving `state`'s weights."""
  if lc.engine_url:
    engine = HttpEngine(HttpEngineConfig(lc.engine_url))
    if lc.worker_urls:  # the router only forwards /generate: updates and aborts go to each worker
      engine = RoutedEngine(engine, [HttpEngine(HttpEngineConfig(u)) for u in lc.worker_urls])
    engine.wait_until_healthy(timeout_s=600)
    # Pushing weights and stamping tokens with versions the server confirms; over-sampling aborts stragglers.
    engine.capabilities().require(
      "RL with weight sync", lc.engine_url, weight_update=True, weight_version=True, abort=True
    )
    return engine
  model = model_from_state(lc.model, merge_dicts(state.params, state.bias))
  return InferenceEngine(model, lc.engine, eos_token_ids=lc.rollout.stop_token_ids)


class Learner:
  """Holds the train state, the engine, the rollout manager and the weight sync for one run."""

  def __init__(
    self, lc: LearnerConfig, workdir: str, task: ArithmeticTask | MathJsonlTask, decode, engine: Engine | None = None
  ):
    self.lc, self.workdir, self.task, self.decode = lc, os.path.abspath(workdir), task, decode
    # Model and optimizer: warm-start LR for the first warm_start_steps updates, then the RL LR.
    self.schedule = optax.join_schedules(
      [optax.constant_schedule(lc.warm_start_lr), optax.constant_schedule(lc.lr)], [lc.warm_start_steps]
    )
    self.optimizer = muonclip(
      self.schedule,
      weight_decay=lc.weight_decay,
      momentum=lc.momentum,
      qk_clip_tau=lc.qk_clip_tau,
      qk_clip_spec=QKClipSpec.from_config(lc.model),
    )
    model = self._initial_model()
    self.mdef = ModelDef.from_model(model)
    self.state = init_state(model, self.optimizer)
    del model
    # Restore.
    self._check_workdir()
    wd.write_model_config(lc.model, self.workdir)
    self.ckpt = wd.checkpoint_manager(self.workdir, max_to_keep=lc.checkpoint_keep)
    self.meta = {"iteration": 0, "weight_version": 0, "prompts_drawn": 0, "warm_start_done": False}
    self._restore()
    # Own every leaf: init shares one zero among counters, and the steps donate the state.
    self.state = jax.tree.map(lambda x: jnp.array(x, copy=True), self.state)
    # Steps (jitted once: fixed [rows, seq_len] shapes).
    tau = lc.qk_clip_tau
    self.rl_step = jax.jit(
      rl_step.make_rl_step(
        self.mdef,
        self.optimizer,
        self.schedule,
        lc.loss,
        num_groups=lc.rollout.target_groups,
        bias_update_rate=lc.bias_update_rate,
        qk_clip_tau=tau,
      ),
      donate_argnums=0,
    )
    self.sft_step = jax.jit(
      rl_step.make_sft_step(self.mdef, self.optimizer, self.schedule, qk_clip_tau=tau), donate_argnums=0
    )
    self.logprobs_fn = jax.jit(rl_step.make_logprobs_fn(self.mdef))
    self.ptx = PTXSet(lc.ptx, load_tokenizer(lc.tokenizer_path)) if lc.ptx else None
    # Engine, weight sync, rollouts.
    self.engine = engine or make_engine(lc, self.state, decode)
    self.sync = WeightSync(lc.sync, self.engine, initial_version=self.meta["weight_version"])
    self.manager = RolloutManager(
      lc.rollout, self.engine, self._prompts(self.meta["prompts_drawn"]), per_sample(task.reward), decode=decode
    )
    self.log = MetricsLogger(
      self.workdir,
      total_steps=lc.iterations,
      start_step=self.meta["iteration"],
      tensorboard=lc.tensorboard,
      progress=False,
      enabled=True,
    )
    self.peak = measure_peak_flops(lc.model.compute_dtype)
    self.flops_per_token = flops_per_token(lc.model, lc.seq_len)

  # ---- setup ------------------------------------------------------------------------------------
  def _initial_model(self) -> K2Model:
    lc = self.lc
    if lc.init_from:
      return k2jax.load(lc.init_from, param_dtype=lc.model.param_dtype, compute_dtype=lc.model.compute_dtype)
    return K2Model(lc.model, rngs=nnx.Rngs(lc.seed))

  def _check_workdir(self) -> None:
    if wd.is_workdir(self.workdir):
      have, want = wd.read_model_config(self.workdir).to_hf_dict(), self.lc.model.to_hf_dict()
      diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
      if diff:
        raise ConfigError(
          f"model: {self.workdir}/{wd.MODEL_CONFIG} is a different model (fields {diff}); use a new workdir"
        )

  def _prompts(self, start: int):
    for i, prompt in enumerate(self.task.prompts(start), start + 1):
      self.meta["prompts_drawn"] = i
      yield prompt

  # ---- checkpoints ------------------------------------------------------------------------------
  def _save(self) -> None:
    s = self.state
    self.ckpt.save(
      self.meta["iteration"],
      force=True,
      args=ocp.args.Composite(
        model=ocp.args.StandardSave(merge_dicts(s.params, s.bias)),
        opt=ocp.args.StandardSave({"opt_state": s.opt_state, "step": s.step, "skipped_steps": s.skipped_steps}),
        meta=ocp.args.JsonSave(dict(self.meta)),
      ),
    )
    self.ckpt.wait_until_finished()

  def _restore(self) -> None:
    step = self.ckpt.latest_step()
    if step is None:
      return
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state)
    out = self.ckpt.restore(
      step,
      args=ocp.args.Composite(
        model=ocp.args.StandardRestore(merge_dicts(abstract.params, abstract.bias)),
        opt=ocp.args.StandardRestore(
          {"opt_state": abstract.opt_state, "step": abstract.step, "skipped_steps": abstract.skipped_steps}
        ),
        meta=ocp.args.JsonRestore(),
      ),
    )
    params, bias = split_dict(out["model"], abstract.params)
    o = out["opt"]
    self.state = TrainState(o["step"], params, bias, o["opt_state"], o["skipped_steps"])
    self.meta.update(out["meta"])
    say(f"resumed RL from {self.workdir}/checkpoints/{step} (weight version {self.meta['weight_version']})")

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
    return last

  def iteration(self) -> dict:
    """One rollout -> update -> sync round; returns (and logs) its metrics."""
    lc, t0 = self.lc, time.perf_counter()
    version = self.sync.version
    batch, rstats = self.manager.collect(version)
    t1 = time.perf_counter()
    arrays, dropped = batching.to_train_arrays(
      batch, rows=lc.rows, seq_len=lc.seq_len, vocab_size=lc.model.vocab_size, version=version
    )
    s = self.state
    old_BT = select_old_logprobs(
      lc.loss,
      arrays["engine_logprobs_BT"],
      lambda: self.logprobs_fn(s.params, s.bias, arrays["tokens_BT"], arrays["segment_ids_BT"]),
    )
    ptx = None
    for _ in range(lc.updates_per_batch):
      if self.ptx is not None:
        ptx = self.ptx.batch(int(self.state.step))
      self.state, metrics = self.rl_step(self.state, arrays, old_BT, ptx)
    metrics = jax.device_get(metrics)
    t2 = time.perf_counter()
    new_version = self._push()
    t3 = time.perf_counter()
    self.meta.update(iteration=self.meta["iteration"] + 1, weight_version=new_version)
    rec = {k: v for k, v in metrics.items() if k not in ("finite", "max_attn_logit_per_layer")}
    rec.update(rollout_metrics(batch), **batching.staleness(batch, version))
    rec.update({f"rollout_{k}": v for k, v in rstats.items()})
    rec.update({f"dropped_{k}": int(dropped.get(k, 0)) for k in ("samples",) + batching.CHECKS})
    tokens = float(np.sum(arrays["segment_ids_BT"] > 0)) * lc.updates_per_batch
    wall = time.perf_counter() - t0
    if lc.eval_every and self.meta["iteration"] % lc.eval_every == 0:
      rec["eval_accuracy"] = self.evaluate()
    rec.update(
      rollout_time_s=t1 - t0,
      train_time_s=t2 - t1,
      sync_time_s=t3 - t2,
      trainer_idle_fraction=1.0 - (t2 - t1) / max(wall, 1e-9),
      weight_version=new_version,
      tokens_per_sec=tokens / max(t2 - t1, 1e-9),
      mfu=tokens / max(t2 - t1, 1e-9) * self.flops_per_token / self.peak,
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
      self.state, m = self.sft_step(self.state, tokens_BT, segment_ids_BT, mask_BT)
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
      rec["eval_accuracy"] = self.evaluate()
    self.log.write(rec)

  def evaluate(self) -> float:
    """Greedy exact-match accuracy over every distinct prompt of the task, through the engine."""
    prompts = self.task.all_prompts()
    budget = self.lc.rollout.budget(self.task.name)
    sampling = SamplingParams(max_new_tokens=budget, temperature=0.0, stop_token_ids=self.lc.rollout.stop_token_ids)

    def one(i_p):
      i, p = i_p
      res = self.engine.generate(GenerateRequest(f"eval/{self.meta['iteration']}/{i}", p.input_ids, sampling))
      text = self.decode(res.output_ids) if self.decode else (res.text or "")
      done = Completion(res.output_ids, text, res.finish_reason, res.finish_reason == "length")
      return self.task.reward(p, done).reward == 1.0

    with concurrent.futures.ThreadPoolExecutor(min(len(prompts), 64)) as pool:
      return float(np.mean(list(pool.map(one, enumerate(prompts)))))

  def _push(self, full: bool = False) -> int:
    host = jax.device_get(merge_dicts(self.state.params, self.state.bias))
    return self.sync.push(dict(hf_io.iter_hf_tensors(self.lc.model, host, dtype=None)), full=full)

  def close(self) -> None:
    self.manager.close()
    self.log.close()
    self.ckpt.close()
    self.engine.close()
