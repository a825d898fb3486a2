"""The typed config of RL (configs/rl.py): the single declaration of every RL knob.

Each field is a knob: default, type, one-line doc and check (`k2jax.configlib.knob`). configs/rl.py starts
from `config_dict()` (these defaults as a ConfigDict) and its presets only change fields (and add
`tasks.<name>` sections); absl parses `--config.a.b=v` against it. `k2jax.rl.learner.from_config_dict` builds
this tree (`configlib.build`: unknown keys, types and checks fail naming the dotted key) and derives the
runtime `LearnerConfig` from it; `LearnerConfig.spec` keeps the tree, so a new knob is read from there.
"""

from __future__ import annotations

import dataclasses

from ml_collections import config_dict as mlc

from k2jax import configlib
from k2jax.configlib import knob, section, sections
from k2jax.data.eval_tasks import EvalTaskEntry, eval_task_section  # noqa: F401  (configs/rl.py's presets)
from k2jax.grading.rubric import JUDGE_LAYOUTS
from k2jax.train.config import ON_UNREADABLE, MeshSpec

ROLLOUT_ENGINES = ("embedded", "sglang_jax_colocated")
TASK_KINDS = ("arith", "jsonl", "agentic")  # a tasks.<name> section's kind (k2jax/rl/tasks.py:task_specs)
OLD_LOGPROBS = ("trainer", "engine")
ROLLOUT_QUANTIZATIONS = ("", "int4")
_POSITIVE = {"check": lambda v: v >= 1, "rule": "must be >= 1"}
_NON_NEGATIVE = {"check": lambda v: v >= 0, "rule": "must be >= 0"}


def _urls(v: str) -> bool:
  return all(u.startswith(("http://", "https://")) for u in v.split(",") if u)


@dataclasses.dataclass(frozen=True)
class RLModelSpec:
  preset: str = knob("tiny", "k2jax.model.presets name (used when init_from is empty)")
  init_from: str = knob("", "k2jax workdir or HF dir to start the policy from ('' = random init)")
  read_budget_bytes: int = knob(
    2 << 30,
    "HF init_from: bytes of HF blocks each process holds in flight beyond its shards (orbax: 2 GiB)",
    **_POSITIVE,
  )
  param_dtype: str = knob("float32", "master weights")
  compute_dtype: str = knob("float32", "matmuls/activations ('bfloat16' on accelerators)")
  scan_layers: bool = knob(True, "lax.scan over stacked layers")
  remat_policy: str = knob("none", "none | full | dots | dots_no_batch")
  attention: str = knob("auto", "attention kernel, as configs/k2.py: auto | einsum | flash")
  expert_qat: str = knob(
    "none", "routed experts' QAT: none | int4 (the INT4 release's grid; rollout.quantization picks what rollouts serve)"
  )


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """The single task (k2jax/rl/tasks.py) when no `tasks.<name>` sections are given."""

  kind: str = knob("arith", "'arith': generated a+b, exact match; 'math_jsonl': task.path, \\boxed{} reward")
  path: str = knob("", "math_jsonl: {'question', 'answer'} records (chat-templated prompts)")
  a_min: int = knob(1, "arith: smallest a")
  a_max: int = knob(1, "arith: largest a ('1+b': the digit that follows b)")
  b_min: int = knob(0, "arith: smallest b")
  b_max: int = knob(8, "arith: largest b")
  seed: int = knob(0, "prompt stream (prompt i is a function of (seed, i))")
  template: str = knob("{a}+{b}", "prompt text ({a}, {b} = operands); ends on b so a tiny model reads it")
  budget: int = knob(4, "total response tokens per sample over all its segments (K2 budget control)", **_POSITIVE)
  truncation_penalty: float = knob(0.5, "subtracted from the reward of samples that hit the budget (all tasks)")


@dataclasses.dataclass(frozen=True)
class TaskEntry:
  """One `tasks.<name>` section of a mixed batch (kind 'arith' still reads task.a_min.. and task.template)."""

  kind: str = knob("jsonl", "arith | jsonl | agentic", choices=TASK_KINDS)
  reward: str = knob("", "reward kind (k2jax/grading; '' = exact for arith, env for agentic)")
  path: str = knob("", "jsonl records of the task")
  env: str = knob("", "agentic: environment name")
  budget: int = knob(1, "response tokens per sample", **_POSITIVE)
  weight: int = knob(1, "prompts of this task per cycle of the mix", **_POSITIVE)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """k2jax/grading/contract.py (the one reward contract)."""

  judge_url: str = knob(
    "", "OpenAI-compatible endpoint for judge/rubric rewards ('' = the rollout engine)", check=_urls
  )
  judge_model: str = knob("default", "model name sent to judge_url")
  judge_max_tokens: int = knob(64, "judge reply length", **_POSITIVE)
  judge_criteria: str = knob("", "judge criteria for prompts without data['criteria'] ('' = the default)")
  judge_layout: str = knob(
    "rubric",
    "rubric reward judge's prompt layout, also the critic's: rubric (K2's, real judges) | short (a tiny judge)",
    choices=JUDGE_LAYOUTS,
  )
  math_budget_s: float = knob(
    300.0,
    "seconds of math grading one batch may spend, summed over its samples; past it answers score 0 as timeouts"
    " (bounds what slow expressions cost a rollout; 0 = unbounded)",
    **_NON_NEGATIVE,
  )
  max_infra_error_frac: float = knob(
    0.5,
    "share of a batch's samples without a verdict (a grader failed: NaN reward) past which the run stops,"
    " naming the causes (a grader failing on every sample would train on nothing for hours)",
    check=lambda v: 0 <= v <= 1,
    rule="must be in [0, 1]",
  )


@dataclasses.dataclass(frozen=True)
class AgenticSpec:
  """Multi-turn episodes (k2jax/agentic): env services and turn limits."""

  env_urls: str = knob("", "'sim_tools=http://host:port,...'; an env without a URL gets a local service")
  local_workers: int = knob(1, "service processes started per environment without a URL", **_POSITIVE)
  max_turns: int = knob(4, "assistant turns per episode (a task's max_turns may lower it)", **_POSITIVE)
  max_new_tokens_per_turn: int = knob(64, "per engine call; the task budget caps the whole response", **_POSITIVE)
  step_timeout_s: float = knob(60.0, "an env reset/step slower than this fails the episode (dropped)")


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  engine_url: str = knob("", "'' = an engine in this process (rollout.engine); else an SGLang /generate server")
  engine: str = knob("embedded", "in-process engine: embedded (k2jax) | sglang_jax_colocated", choices=ROLLOUT_ENGINES)
  worker_urls: str = knob("", "with a router as engine_url: its workers, comma-separated (updates, aborts)")
  group_size: int = knob(8, "K responses per prompt")
  target_groups: int = knob(16, "complete groups per train batch")
  launch_groups: int = knob(20, "groups in flight (over-sampling; the slowest are aborted)")
  partial_rollout: bool = knob(True, "aborted samples resume next iteration (K1.5 partial rollouts)")
  max_staleness: int = knob(2, "resumed tokens at most this many weight versions old")
  temperature: float = knob(1.0, "initial sampling temperature ...")
  temperature_final: float = knob(1.0, "... decaying towards this (K2 temperature decay)")
  temperature_half_life: float = knob(100.0, "iterations")
  top_p: float = knob(1.0, "nucleus sampling (1 = off)")
  max_concurrency: int = knob(64, "rollout threads = in-flight engine requests")
  quantization: str = knob(
    "",
    "rollout weights: '' (as the trainer computes them: model.expert_qat's grid) | int4 (routed experts served as"
    " the INT4 release whatever model.expert_qat: the embedded engine holds them packed and quantizes each push on"
    " arrival; a remote engine gets INT4 pushes)",
    choices=ROLLOUT_QUANTIZATIONS,
  )

  def validate(self):
    bad = [u for u in (self.engine_url, *self.worker_urls.split(",")) if u and not _urls(u)]
    configlib.need(not bad, "engine_url", f"URLs must start with http:// or https://, got {bad}")
    configlib.need(not self.worker_urls or bool(self.engine_url), "worker_urls", "need rollout.engine_url (a router)")
    configlib.need(
      self.engine == "embedded" or not self.engine_url, "engine", f"{self.engine!r} runs in-process: no engine_url"
    )
    configlib.need(
      self.quantization == "" or self.engine == "embedded" or self.engine_url,
      "quantization",
      f"{self.quantization!r} rollouts need the embedded engine or a remote one (rollout.engine_url); sglang-jax's"
      f" colocated engine serves the pushed float weights as they are, got rollout.engine={self.engine!r}",
    )


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """The embedded engine only (k2jax.engine.EngineConfig)."""

  max_slots: int = knob(32, "requests decoded together", **_POSITIVE)
  max_seq_len: int = knob(64, "prompt + response tokens per request", **_POSITIVE)
  sharding: str = knob("", "serving preset on all devices (tp | ep | tp_ep; '' = one device, one process)")
  mesh: str = knob("", "serving mesh, e.g. 'expert:4,tensor:2' ('' = the preset's default)")


@dataclasses.dataclass(frozen=True)
class ColocateSpec:
  """engine.sharding set: generate/update phases (k2jax/rl/phases.py)."""

  offload_opt_state: bool = knob(True, "optimizer state to host memory while the engine generates")
  offload_params: bool = knob(False, "the float32 master weights too (the engine serves its own copy)")


@dataclasses.dataclass(frozen=True)
class SglangJaxSpec:
  """rollout.engine=sglang_jax_colocated (k2jax.engine.SglangJaxConfig)."""

  device: str = knob("cpu", "cpu | tpu | gpu")
  tp_size: int = knob(1, "its mesh: the first tp_size local devices", **_POSITIVE)
  dtype: str = knob("float32", "served weights ('bfloat16' on TPU; float32 matches the trainer's logprobs)")
  attention_backend: str = knob("native", "CPU: native; TPU: fa")
  context_length: int = knob(512, "prompt + response tokens per request")
  mem_fraction_static: float = knob(0.1, "device memory share for weights + KV pool")
  max_total_tokens: int = knob(4096, "KV pool size in tokens")
  max_running_requests: int = knob(8, "requests decoded together")
  chunked_prefill_size: int = knob(256, "prefill chunk in tokens")
  precompile_bs_paddings: str = knob("8", "comma-separated batch sizes compiled at start")
  precompile_token_paddings: str = knob("256", "comma-separated prefill token counts compiled at start")

  def validate(self):
    for name in ("precompile_bs_paddings", "precompile_token_paddings"):
      parts = [x for x in getattr(self, name).split(",") if x]
      configlib.need(
        all(x.strip().isdigit() for x in parts), name, f"comma-separated ints, got {getattr(self, name)!r}"
      )


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """k2jax.rl.algo.K2LossConfig."""

  tau: float = knob(1.0, "regulariser tau of the K2 objective")
  old_logprobs: str = knob(
    "trainer",
    "pi_old: 'trainer' (recomputed) or 'engine' (sampling logprobs: the trainer/engine gap is a gradient, so a"
    " batch of equal rewards still updates)",
    choices=OLD_LOGPROBS,
  )
  ptx_coef: float = knob(0.002, "weight of the PTX NLL on the curated set (0 disables PTX)")


@dataclasses.dataclass(frozen=True)
class PTXSpec:
  """k2jax.rl.ptx.PTXConfig."""

  source: str = knob("bundled", "jsonl of {'messages'} or {'text'} records; 'bundled' = offline corpus")
  num_samples: int = knob(32, "curated records kept (the first usable ones)")
  batch_size: int = knob(8, "PTX rows per update (a multiple of the mesh's batch shards)")
  seq_len: int = knob(32, "tokens per PTX row (longer records truncated)")


@dataclasses.dataclass(frozen=True)
class WarmStartSpec:
  """Format-only SFT before RL (random answers; see k2jax/rl/tasks.py)."""

  steps: int = knob(20, "warm-start updates (0 disables)", **_NON_NEGATIVE)
  batch_size: int = knob(32, "format examples per warm-start update")
  lr: float = knob(0.01, "constant LR during the warm start")


@dataclasses.dataclass(frozen=True)
class RLOptimSpec:
  """MuonClip (k2jax.optim.muonclip)."""

  lr: float = knob(0.003, "constant RL learning rate", check=lambda v: v > 0, rule="must be > 0")
  weight_decay: float = knob(0.0, "decoupled decay (times the LR) on Muon and AdamW params")
  momentum: float = knob(0.95, "Muon momentum")
  qk_clip_tau: float = knob(100.0, "QK-Clip threshold on the forward's max logits (0 disables)")
  bias_update_rate: float = knob(0.0, "MoE balancing-bias step per update (0 keeps the bias fixed)")
  updates_per_batch: int = knob(
    1,
    "optimizer steps per rollout batch (pi_old fixed across them). A step whose gradient is provably zero (every"
    " group's rewards equal, pi_old the trainer's, no PTX or critic rows) is dropped: params and optimizer state"
    " are kept, so the LR schedule and weight decay do not advance (they count applied updates), while the"
    " balancing bias still moves; metrics updates_dropped / dropped_updates, apart from updates_nonfinite",
    **_POSITIVE,
  )


@dataclasses.dataclass(frozen=True)
class RLTrainSpec:
  seq_len: int = knob(16, "trainer row length: prompt + response must fit")


@dataclasses.dataclass(frozen=True)
class SyncSpec:
  """k2jax.rl.weight_sync.WeightSyncConfig."""

  root: str = knob("", "shared dir for HF safetensors pushes ('' = WORKDIR/weights)")
  keep_last: int = knob(2, "pushed version directories kept on disk")
  dtype: str = knob("", "remote pushes: '' (param dtype) | bfloat16 | float32 | fp8 (block-FP8) | int4 (K2-Thinking)")


@dataclasses.dataclass(frozen=True)
class RLCheckpointSpec:
  every: int = knob(20, "iterations between orbax checkpoints (and one at the end)", **_POSITIVE)
  keep: int = knob(2, "checkpoints kept", **_POSITIVE)
  async_save: bool = knob(True, "write in the background while rollouts continue")
  # "error" stops naming each and why (nothing moved, exit != 0); "fresh" moves them to
  # WORKDIR/checkpoints_corrupt/ and starts from iteration 0.
  on_unreadable: str = knob("error", "checkpoints exist but none restores: error | fresh", choices=ON_UNREADABLE)


@dataclasses.dataclass(frozen=True)
class RLLogSpec:
  tensorboard: bool = knob(False, "also write TensorBoard events to WORKDIR/tb")
  rollouts: bool = knob(False, "also write every sample's tokens and loss mask to WORKDIR/rollouts.jsonl")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """Evaluation through k2jax.eval's runner on the rollout engine, after the update's push (k2jax/rl/evaluation.py)."""

  every: int = knob(10, "evaluate after the warm start, each N iterations and at the end (0 = off)", **_NON_NEGATIVE)
  train_prompts: bool = knob(
    True, "also every task's own greedy prompts: eval/<task>/pass@1 (their mean over prompts: eval_accuracy)"
  )
  concurrency: int = knob(64, "eval requests in flight", **_POSITIVE)
  tasks: dict[str, EvalTaskEntry] = sections(EvalTaskEntry, "held-out tasks, logged as eval/<name>/<metric>")
  tasks_file: str = knob("", "JSON list of more eval tasks, each {name, ...the keys of eval.tasks.<name>}")


@dataclasses.dataclass(frozen=True)
class CriticSpec:
  """Closed-loop critic refinement (K2 §3.2.2; k2jax/rl/critic.py): verifiable-reward pairs in the rubric
  reward's pairwise format, their verifier-consistent verdicts trained as an auxiliary NLL term."""

  coef: float = knob(0.0, "weight of the critic verdict NLL in the RL update (0 = off)", **_NON_NEGATIVE)
  batch_size: int = knob(16, "critic rows per update (a multiple of the mesh's batch shards)", **_POSITIVE)
  seq_len: int = knob(512, "tokens per critic row (judge prompt + verdict; longer examples dropped)", **_POSITIVE)
  heldout_fraction: float = knob(
    0.2,
    "content-hash share of pairs never trained on (critic_agreement is measured on them)",
    check=lambda v: 0.0 < v < 1.0,
    rule="must be in (0, 1)",
  )
  eval_pairs: int = knob(8, "held-out pairs scored per iteration (both orders, 4 rows each)", **_POSITIVE)
  replay_pairs: int = knob(
    256,
    "earlier batches' training pairs kept (newest, unique) and drawn beside the batch's own (0 = the batch's only)",
    **_NON_NEGATIVE,
  )
  rubrics: str = knob(
    "", "'|'-separated rubrics the critic's examples show ('' = the rubric reward's core + prescriptive ones)"
  )


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """configs/rl.py, typed (K2 §3.2.3: the K2 objective with MuonClip, rollouts, PTX, weight sync)."""

  seed: int = knob(0, "model init and warm-start sampling")
  iterations: int = knob(60, "RL iterations (one rollout batch each)", **_POSITIVE)
  tokenizer_path: str = knob("", "tiktoken model for prompts and rewards ('' = the bundled BPE)")
  topology: str = knob("", "k2jax.memory.TOPOLOGIES name for --dry_run's memory plan ('' = none)")
  model: RLModelSpec = section(RLModelSpec, "the policy")
  mesh: MeshSpec = section(MeshSpec, "device mesh and rules preset, exactly as configs/k2.py")
  task: TaskSpec = section(TaskSpec, "the single task (k2jax/rl/tasks.py)")
  tasks: dict[str, TaskEntry] = sections(TaskEntry, "mixed task batches: tasks.<name> replaces the single task")
  reward: RewardSpec = section(RewardSpec, "judge endpoint and reward knobs")
  agentic: AgenticSpec = section(AgenticSpec, "multi-turn episodes: env services and turn limits")
  rollout: RolloutSpec = section(RolloutSpec, "rollout engine, groups, over-sampling, sampling")
  engine: EngineSpec = section(EngineSpec, "the embedded engine")
  colocate: ColocateSpec = section(ColocateSpec, "colocated generate/update phases")
  sglang_jax: SglangJaxSpec = section(SglangJaxSpec, "the colocated sglang-jax engine")
  loss: LossSpec = section(LossSpec, "the K2 objective")
  ptx: PTXSpec = section(PTXSpec, "the PTX set")
  warm_start: WarmStartSpec = section(WarmStartSpec, "format-only SFT before RL")
  optim: RLOptimSpec = section(RLOptimSpec, "MuonClip")
  train: RLTrainSpec = section(RLTrainSpec, "trainer rows")
  sync: SyncSpec = section(SyncSpec, "weight pushes to a remote engine")
  checkpoint: RLCheckpointSpec = section(RLCheckpointSpec, "orbax checkpoints")
  critic: CriticSpec = section(CriticSpec, "closed-loop critic refinement on verifiable rollouts")
  log: RLLogSpec = section(RLLogSpec, "extra logs")
  eval: EvalSpec = section(EvalSpec, "evaluation: held-out tasks and the tasks' own prompts")

  def validate(self):
    int4 = self.rollout.quantization == "int4"
    configlib.need(
      not int4 or not self.rollout.engine_url or self.sync.dtype in ("", "int4"),
      "sync.dtype",
      f"rollout.quantization='int4' pushes INT4 to the remote engine; sync.dtype must be '' or 'int4', got"
      f" {self.sync.dtype!r}",
    )
    # The INT4-serving engine's packed codes and scales take the float experts' logical axes, and a serving
    # mesh splits their (halved, /32) input axes too: tiny's [.., 1, ..] scales of w_down do not divide.
    configlib.need(
      not int4 or self.rollout.engine_url or not self.engine.sharding,
      "rollout.quantization",
      f"'int4' rollouts run the embedded engine on one device; a serving mesh (engine.sharding="
      f"{self.engine.sharding!r}) does not shard INT4 experts: set engine.sharding='' or rollout.engine_url",
    )


def config_dict() -> mlc.ConfigDict:
  """The ConfigDict of RLConfig's defaults (what configs/rl.py's presets change)."""
  return configlib.config_dict(RLConfig)


def task_section(**values) -> mlc.ConfigDict:
  """A `tasks.<name>` section for a preset: TaskEntry's defaults with `values` set."""
  return configlib.item_config_dict(TaskEntry, **values)
