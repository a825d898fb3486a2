"""The typed config of pretraining / SFT (configs/k2.py): the single declaration of every training knob.

Each field below is a knob: its default, type and one-line doc (`configlib.knob`), and its check. configs/k2.py
starts from `config_dict()` (these defaults as a ConfigDict) and its presets only change fields; absl parses
`--config.a.b=v` against that ConfigDict. `from_config_dict` is the one boundary back to these frozen
dataclasses (`configlib.build`: unknown keys, types, choices, divisibility, schedule lengths; every error names
the dotted key); `check_runtime` checks the rest (mesh vs devices and hosts, data and tokenizer paths) before
anything is compiled.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os

from ml_collections import config_dict as mlc

from k2jax import configlib, sharding
from k2jax.configlib import knob, section, sections
from k2jax.data.eval_tasks import EvalTaskEntry
from k2jax.model import pipeline as pipeline_lib
from k2jax.model import presets
from k2jax.model.config import ConfigError, K2Config
from k2jax.model.pipeline import PipelineSpec

ON_UNREADABLE = ("error", "fresh")  # checkpoint.on_unreadable (k2jax.train.checkpoint.restore_latest)

DATA_KINDS = ("pretrain", "sft")
_POSITIVE = {"check": lambda v: v >= 1, "rule": "must be >= 1"}
_NONNEG_PIPE = {"check": lambda v: v >= 0, "rule": "must be >= 0"}
_NONE = "None = the preset's value"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """`model.*`: a k2jax.model.presets name, architecture overrides (HF DeepSeek-V3 names) and execution knobs."""

  preset: str = knob("tiny", "k2jax.model.presets name: tiny | small | 1t")
  vocab_size: int | None = knob(None, f"tokens in the vocabulary ({_NONE})")
  hidden_size: int | None = knob(None, f"model width ({_NONE})")
  intermediate_size: int | None = knob(None, f"dense-layer SwiGLU width ({_NONE})")
  moe_intermediate_size: int | None = knob(None, f"per routed (and shared) expert SwiGLU width ({_NONE})")
  num_hidden_layers: int | None = knob(None, f"transformer layers ({_NONE})")
  num_attention_heads: int | None = knob(None, f"attention heads; MLA kv heads follow ({_NONE})")
  q_lora_rank: int | None = knob(None, f"MLA query low-rank width ({_NONE})")
  kv_lora_rank: int | None = knob(None, f"MLA key/value latent width ({_NONE})")
  qk_nope_head_dim: int | None = knob(None, f"per-head query/key dims without RoPE ({_NONE})")
  qk_rope_head_dim: int | None = knob(None, f"per-head query/key dims with RoPE ({_NONE})")
  v_head_dim: int | None = knob(None, f"per-head value dims ({_NONE})")
  n_routed_experts: int | None = knob(None, f"routed experts per MoE layer ({_NONE})")
  num_experts_per_tok: int | None = knob(None, f"experts each token is routed to ({_NONE})")
  n_shared_experts: int | None = knob(None, f"always-on experts per MoE layer ({_NONE})")
  first_k_dense_replace: int | None = knob(None, f"leading dense (non-MoE) layers ({_NONE})")
  n_group: int | None = knob(None, f"expert groups for group-limited routing ({_NONE})")
  topk_group: int | None = knob(None, f"groups each token may route into ({_NONE})")
  max_position_embeddings: int | None = knob(None, f"longest sequence the model supports ({_NONE})")
  routed_scaling_factor: float | None = knob(None, f"scale of the routed experts' output ({_NONE})")
  rope_theta: float | None = knob(None, f"RoPE base ({_NONE})")
  rms_norm_eps: float | None = knob(None, f"RMSNorm epsilon ({_NONE})")
  initializer_range: float | None = knob(None, f"init std of the weights ({_NONE})")
  param_dtype: str = knob("float32", "master weights")
  compute_dtype: str = knob("float32", "activations / matmuls (bfloat16 on accelerators)")
  scan_layers: bool = knob(True, "lax.scan over stacked layers (one compiled layer body)")
  remat_policy: str = knob("none", "none | full | dots | dots_no_batch")
  # auto = the Pallas flash kernel (linear memory in seq_len, returns QK-Clip's max logit) when compiling for
  # TPU (GPU: its plain-JAX blocked fallback), the einsum path on CPU.
  attention: str = knob("auto", "attention kernel: auto | einsum | flash")
  cp_gather: str = knob(
    "latent", "context parallelism: gather MLA's latent + rope key (latent) or per-head K/V (heads)"
  )
  rope_factor: float | None = knob(
    None, f"YaRN factor over rope_scaling.original_max_position_embeddings; sets max_position_embeddings ({_NONE})"
  )
  moe_dispatch: str = knob("auto", "EP all-to-all: auto (ragged on TPU/GPU, fixed on CPU) | fixed | ragged")
  moe_chunk_tokens: int = knob(0, "EP: tokens per device per dispatch chunk (0 = all at once; bounds EP buffers)")
  moe_gemm: str = knob(
    "auto",
    "routed-expert grouped GEMM: auto (cpu: tiled, gpu: tokamax, tpu: ragged_dot) | ragged_dot | tiled | "
    "tokamax | tokamax_triton | jax_triton",
  )
  expert_qat: str = knob("none", "routed experts' QAT: none | int4 (Kimi-K2-Thinking's INT4 grid, model/int4.py)")


@dataclasses.dataclass(frozen=True)
class DataSpec:
  kind: str = knob("pretrain", "pretrain (packed documents) | sft (chat, assistant-only loss)", choices=DATA_KINDS)
  path: str = knob("", "'' = bundled corpus; else a file or glob (jsonl/parquet/array_record)")
  tokenizer_path: str = knob("", "'' = bundled tiny BPE; else a tiktoken rank file (K2's tiktoken.model) or its HF dir")
  seq_len: int = knob(64, "tokens per packed row", check=lambda v: v > 1, rule="must be > 1")
  global_batch_size: int = knob(16, "rows per optimizer step, summed over all hosts")
  num_microbatches: int = knob(1, "gradient accumulation: the global batch is split into this many", **_POSITIVE)
  seed: int = knob(0, "shuffle / packing seed")
  num_workers: int = knob(0, "grain worker processes per host (0 = in-process)")
  read_threads: int = knob(0, "grain read/tokenize threads per host")

  def validate(self):
    configlib.need(
      self.global_batch_size % self.num_microbatches == 0,
      "global_batch_size",
      f"{self.global_batch_size} is not divisible by data.num_microbatches={self.num_microbatches}",
    )


@dataclasses.dataclass(frozen=True)
class OptimSpec:
  """MuonClip (k2jax.optim.muonclip) + WSD schedule."""

  peak_lr: float = knob(2e-4, "constant-phase LR, shared by Muon (0.2*sqrt(max(A,B)) RMS) and AdamW")
  final_lr: float = knob(2e-5, "LR at the end of the cosine decay")
  warmup_steps: int = knob(500, "linear warmup from 0", check=lambda v: v >= 0, rule="must be >= 0")
  decay_fraction: float = knob(
    5.5 / 15.5, "fraction of `steps` in the cosine decay (K2: 5.5T of 15.5T tokens)", check=lambda v: 0 <= v <= 1
  )
  weight_decay: float = knob(0.1, "decoupled, times the LR, on Muon and AdamW leaves")
  momentum: float = knob(0.95, "Muon (plain-sum Nesterov) momentum")
  adam_b1: float = knob(0.9, "AdamW beta1 (non-matrix leaves)")
  adam_b2: float = knob(0.95, "AdamW beta2")
  adam_eps: float = knob(1e-8, "AdamW epsilon")
  qk_clip_tau: float = knob(100.0, "QK-Clip threshold on the max pre-softmax logit (<= 0 disables)")
  bias_update_rate: float = knob(
    1e-3, "aux-loss-free balancing: b_i += u * sign(mean_load - load_i)", check=lambda v: v >= 0, rule="must be >= 0"
  )
  # Brought to HBM for the update only. On CPU the device memory is host memory: ignored.
  offload_state: bool = knob(False, "keep the optimizer state in pinned host memory between steps (TPU/GPU)")

  def validate(self):
    configlib.need(
      self.peak_lr > 0 and 0 <= self.final_lr <= self.peak_lr,
      "final_lr",
      f"need 0 <= final_lr ({self.final_lr}) <= peak_lr ({self.peak_lr}) and peak_lr > 0",
    )


def _axis(v: int) -> bool:
  return v == -1 or v >= 1


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Device mesh and rules preset (the same keys for every loop); -1 = all remaining devices."""

  rules: str = knob(
    "fsdp", "k2jax.sharding rules preset: fsdp | fsdp_ep | fsdp_ep_tp (+ _cp: the sequence over `expert`)"
  )
  stage: int = knob(
    1, "pipeline stages (k2jax.model.pipeline; the `pipeline.*` knobs)", check=_axis, rule="must be >= 1 or -1"
  )
  data: int = knob(1, "data-parallel axis", check=_axis, rule="must be >= 1 or -1")
  fsdp: int = knob(-1, "FSDP axis (-1 = all remaining devices)", check=_axis, rule="must be >= 1 or -1")
  expert: int = knob(1, "expert-parallel axis", check=_axis, rule="must be >= 1 or -1")
  tensor: int = knob(1, "tensor-parallel axis", check=_axis, rule="must be >= 1 or -1")

  # The DCN level (multislice): slices per axis; the axes above are then sizes inside one slice (ICI).
  dcn_stage: int = knob(1, "pipeline stages across slices (DCN)", **_POSITIVE)
  dcn_data: int = knob(1, "data parallelism across slices (DCN): the gradient all-reduce crosses slices", **_POSITIVE)
  dcn_fsdp: int = knob(1, "FSDP across slices (DCN): weight gathers cross slices every layer", **_POSITIVE)
  dcn_expert: int = knob(1, "expert parallelism across slices (needs mesh.dcn_allow_expert)", **_POSITIVE)
  dcn_tensor: int = knob(1, "tensor parallelism across slices (DCN)", **_POSITIVE)
  dcn_allow_expert: bool = knob(False, "allow mesh.dcn_expert > 1: every MoE layer's all-to-all then crosses DCN")

  def validate(self):
    configlib.need(self.rules in sharding.RULES, "rules", f"one of {sorted(sharding.RULES)}, got {self.rules!r}")
    configlib.need(sum(getattr(self, a) == -1 for a in sharding.MESH_AXES) <= 1, "", "at most one axis may be -1")
    configlib.need(
      self.dcn_expert == 1 or self.dcn_allow_expert,
      "dcn_expert",
      f"{self.dcn_expert}: expert parallelism across slices puts two all-to-alls per MoE layer on DCN "
      "(~229 KB per token per layer for K2); keep experts inside a slice, or set mesh.dcn_allow_expert=True",
    )

  @property
  def dcn_shape(self) -> dict[str, int]:
    """{axis: slices} of the DCN level (all 1: one slice)."""
    return {a: getattr(self, "dcn_" + a) for a in sharding.MESH_AXES}


@dataclasses.dataclass(frozen=True)
class PipelineKnobs:
  """`pipeline.*`: the circular pipeline over `mesh.stage` stages (k2jax.model.pipeline; on when mesh.stage > 1).
  The pipelined stack is the MoE stack (the dense one in a model without MoE layers); the dense first layers,
  the stack's non-pipelined leading layers, the embedding and the head run before/after it on every stage."""

  repeats: int = knob(1, "virtual stages: each stage runs this many non-adjacent layer groups", **_POSITIVE)
  microbatches: int = knob(
    0, "microbatches each (gradient) microbatch is split into (0 = mesh.stage; >= stages)", **_NONNEG_PIPE
  )
  layers: int = knob(
    0, "layers of the stack pipelined, counted from its end (0 = all); the rest run before", **_NONNEG_PIPE
  )


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  every_steps: int = knob(100, "save every N steps (and at the end, and on SIGTERM/preemption)", **_POSITIVE)
  keep: int = knob(3, "keep the last K checkpoints", **_POSITIVE)
  async_save: bool = knob(True, "write in the background while training continues")
  init_from: str = knob("", "workdir or HF dir whose weights start a fresh run ('' = random init)")
  resume_from: str = knob(
    "",
    "workdir whose newest checkpoint (weights, optimizer state, routing bias) starts a fresh run at a new stage, "
    "e.g. 32k after 4k; its data position is not carried and the step count restarts at 0 ('' = none)",
  )
  read_budget_bytes: int = knob(
    2 << 30,
    "HF init_from: bytes of HF blocks each process holds in flight beyond its shards (orbax: 2 GiB)",
    **_POSITIVE,
  )
  # "error" stops naming each and why (nothing moved, exit != 0); "fresh" moves them to W/checkpoints_corrupt/
  # and trains from step 0.
  on_unreadable: str = knob(
    "error", "checkpoints exist but none restores: error | fresh (k2jax.train.checkpoint)", choices=ON_UNREADABLE
  )


@dataclasses.dataclass(frozen=True)
class LogSpec:
  every_steps: int = knob(10, "metrics.jsonl / TensorBoard / progress line cadence", **_POSITIVE)
  progress: bool = knob(True, "live rich progress line with ETA (only on a terminal)")
  tensorboard: bool = knob(True, "TensorBoard events in W/tb")
  peak_flops: float = knob(0.0, "per-device peak FLOP/s for MFU; 0 = measure fp32 matmul rate at start")
  spike_factor: float = knob(2.0, "loss > factor x running mean of the last window -> spike logged")
  spike_window: int = knob(50, "steps in the running mean", **_POSITIVE)


_NONNEG = {"check": lambda v: v >= 0, "rule": "must be >= 0"}


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """`eval.*`: held-out loss, perplexity and bits-per-byte (k2jax.train.heldout), on when `path` or
  `fraction` names a held-out set, and benchmark tasks (`tasks.<name>` / `tasks_file`, k2jax.eval's runner on
  an embedded engine over the current weights: `eval/<task>/pass@1`, ...). Both run at the same steps: every
  `every_steps` and at the end (one knob, one metrics line per evaluation). Record i of a training source is
  held out iff the splitmix64 hash of (i, seed) is below `fraction` (k2jax.data.sources.HoldoutSplit): the
  same split on every host, process count and resume, and training never reads those records."""

  path: str = knob("", "held-out files, '[name=]file_or_glob,...' (all their records); '' = none")
  fraction: float = knob(
    0.0,
    "fraction of data.path held out by record-id hash, never trained on (0 = none)",
    check=lambda v: 0 <= v < 1,
    rule="must be in [0, 1)",
  )
  seed: int = knob(0, "salt of the held-out split's record-id hash")
  every_steps: int = knob(0, "held-out loss and eval.tasks every N steps (0 = only at the end of training)", **_NONNEG)
  steps: int = knob(0, "batches per held-out source per evaluation (0 = all of it)", **_NONNEG)
  batch_size: int = knob(0, "global rows per eval batch (0 = a training microbatch)", **_NONNEG)
  at_start: bool = knob(False, "also evaluate the starting weights (step 0, or the step resumed from)")
  tasks: dict[str, EvalTaskEntry] = sections(
    EvalTaskEntry, "benchmark tasks (as RL's eval.tasks.<name>), logged as eval/<name>/<metric>"
  )
  tasks_file: str = knob("", "JSON list of more eval tasks, each {name, ...the keys of eval.tasks.<name>}")
  max_tokens: int = knob(64, "eval.tasks: response tokens per sample when a task gives max_tokens=0", **_POSITIVE)
  concurrency: int = knob(16, "eval.tasks: requests in flight", **_POSITIVE)
  engine_max_slots: int = knob(8, "eval.tasks' embedded engine: requests decoded together", **_POSITIVE)
  engine_max_seq_len: int = knob(
    0, "eval.tasks' embedded engine: prompt + response tokens (0 = model max_position_embeddings)", **_NONNEG
  )

  @property
  def enabled(self) -> bool:
    """Held-out loss is on."""
    return bool(self.path) or self.fraction > 0

  @property
  def has_tasks(self) -> bool:
    return bool(self.tasks) or bool(self.tasks_file)

  def validate(self):
    for key, v in (("every_steps", self.every_steps), ("at_start", self.at_start)):
      configlib.need(
        self.enabled or self.has_tasks or not v,
        key,
        f"{v!r} with nothing to evaluate: set eval.path (files) or eval.fraction (a split), or eval.tasks",
      )
    configlib.need(
      not (self.path and self.fraction > 0),
      "fraction",
      f"{self.fraction} with eval.path={self.path!r}: hold out a fraction of data.path or name held-out files, not both",
    )


def model_config(m: ModelSpec) -> K2Config:
  """`model.preset` plus the non-None `model.*` fields -> frozen K2Config."""
  overrides = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name != "preset"}
  overrides = {k: v for k, v in overrides.items() if v is not None}
  if "rope_factor" in overrides:
    overrides.update(_yarn(m.preset, overrides.pop("rope_factor")))
  if "num_attention_heads" in overrides:  # MLA: kv heads always equal q heads.
    overrides["num_key_value_heads"] = overrides["num_attention_heads"]
  try:
    return presets.get(m.preset, **overrides)
  except KeyError as e:
    raise configlib.Invalid("preset", e.args[0]) from None
  except ConfigError as e:  # K2Config's checks name the field: "num_experts_per_tok: ..."
    field, _, why = str(e).partition(": ")
    if field in {f.name for f in dataclasses.fields(K2Config)}:
      raise configlib.Invalid(field, why) from None
    raise configlib.Invalid("", str(e)) from None


def _yarn(preset: str, factor: float) -> dict:
  """The preset's YaRN rope_scaling with `factor`, and the context length it reaches."""
  rope = dict(presets.get(preset).rope)
  if rope["rope_type"] != "yarn":
    raise configlib.Invalid("rope_factor", f"preset {preset!r} has rope_scaling type {rope['rope_type']!r}, not yarn")
  if factor < 1:
    raise configlib.Invalid("rope_factor", f"must be >= 1, got {factor}")
  rope["factor"] = factor
  return {
    "rope_scaling": tuple(sorted(rope.items())),
    "max_position_embeddings": int(factor * rope["original_max_position_embeddings"]),
  }


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """configs/k2.py, typed. `model` is declared by ModelSpec and holds the resolved K2Config."""

  model: K2Config = section(
    ModelSpec, "architecture and execution", resolve=model_config, factory=lambda: presets.get("tiny")
  )
  steps: int = knob(300, "optimizer steps to train (the LR schedule spans them)", **_POSITIVE)
  seed: int = knob(0, "parameter init seed")
  topology: str = knob("", "k2jax.memory.TOPOLOGIES name for --dry_run's memory plan ('' = none)")
  data: DataSpec = section(DataSpec, "data pipeline")
  optim: OptimSpec = section(OptimSpec, "MuonClip + WSD schedule")
  mesh: MeshSpec = section(MeshSpec, "device mesh; -1 = all remaining devices")
  pipeline: PipelineKnobs = section(PipelineKnobs, "pipeline parallelism over mesh.stage (off at stage 1)")
  checkpoint: CheckpointSpec = section(CheckpointSpec, "orbax checkpoints and init_from")
  log: LogSpec = section(LogSpec, "metrics, progress and spike logging")
  eval: EvalSpec = section(EvalSpec, "held-out loss (off unless path or fraction) and benchmark tasks (eval.tasks)")

  def validate(self):
    rope = self.model.rope
    if rope["rope_type"] == "yarn" and rope.get("factor"):
      reach = rope["factor"] * rope["original_max_position_embeddings"]
      configlib.need(
        self.data.seq_len <= reach,
        "data.seq_len",
        f"{self.data.seq_len} is past YaRN's reach: factor {rope['factor']} x original_max_position_embeddings "
        f"{rope['original_max_position_embeddings']} = {reach:g} (set model.rope_factor >= "
        f"{self.data.seq_len / rope['original_max_position_embeddings']:g})",
      )
    configlib.need(
      self.data.seq_len <= self.model.max_position_embeddings,
      "data.seq_len",
      f"{self.data.seq_len} > model max_position_embeddings {self.model.max_position_embeddings}",
    )


def config_dict() -> mlc.ConfigDict:
  """The ConfigDict of TrainConfig's defaults (what configs/k2.py's presets change)."""
  return configlib.config_dict(TrainConfig)


def from_config_dict(c) -> TrainConfig:
  """ConfigDict (or plain dict) -> TrainConfig; raises ConfigError naming the key on any bad value."""
  return configlib.build(TrainConfig, c, error=ConfigError)


def _need(cond: bool, key: str, msg: str) -> None:
  if not cond:
    raise ConfigError(f"{key}: {msg}")


def check_runtime(tc: TrainConfig, n_devices: int, process_count: int) -> dict[str, int]:
  """Checks against the live runtime and files; returns the mesh shape. Call before compiling."""
  micro = tc.data.global_batch_size // tc.data.num_microbatches
  shape = mesh_shape(
    tc.mesh,
    tc.model,
    n_devices,
    rows=micro,
    what=f"data.global_batch_size (a microbatch of {micro} rows = global_batch_size / num_microbatches)",
    seq_len=tc.data.seq_len,
  )
  _need(
    tc.data.global_batch_size % process_count == 0,
    "data.global_batch_size",
    f"{tc.data.global_batch_size} is not divisible by the {process_count} processes",
  )
  pipeline_spec(tc, shape)  # checks the layout against the layers and rows
  if tc.data.path:
    found = glob.glob(tc.data.path) if glob.has_magic(tc.data.path) else [tc.data.path]
    _need(bool(found) and all(os.path.isfile(p) for p in found), "data.path", f"no data file at {tc.data.path!r}")
  if tc.eval.enabled:
    rows = eval_rows(tc)
    mesh_shape(tc.mesh, tc.model, n_devices, rows=rows, what=f"eval.batch_size ({rows} rows per eval batch)")
    for entry in filter(None, (e.strip() for e in tc.eval.path.split(","))):
      path = entry.partition("=")[2].strip() if "=" in entry else entry
      found = glob.glob(path) if glob.has_magic(path) else [path]
      _need(bool(found) and all(os.path.isfile(p) for p in found), "eval.path", f"no held-out file at {path!r}")
  if tc.data.tokenizer_path:
    tok = tc.data.tokenizer_path  # a rank file, or a Kimi-K2 HF directory holding tiktoken.model
    ok = os.path.isfile(tok) or os.path.isfile(os.path.join(tok, "tiktoken.model"))
    _need(ok, "data.tokenizer_path", f"no tokenizer file at {tok!r} (nor {os.path.join(tok, 'tiktoken.model')!r})")
  if tc.checkpoint.init_from:
    _need(
      os.path.isdir(tc.checkpoint.init_from), "checkpoint.init_from", f"no directory at {tc.checkpoint.init_from!r}"
    )
  if tc.checkpoint.resume_from:
    _need(
      os.path.isdir(tc.checkpoint.resume_from),
      "checkpoint.resume_from",
      f"no directory at {tc.checkpoint.resume_from!r}",
    )
    _need(not tc.checkpoint.init_from, "checkpoint.resume_from", "set resume_from or init_from, not both")
  return shape


def pipeline_spec(tc: TrainConfig, shape: dict[str, int]) -> PipelineSpec | None:
  """The run's pipeline on a mesh of `shape` (None at one stage), checked against the model's layers and the
  rows of a (gradient) microbatch: every error names the `pipeline.*` or `mesh.*` key."""
  p = shape.get("stage", 1)
  if p == 1:
    return None
  k = tc.pipeline
  spec = PipelineSpec(p, repeats=k.repeats, microbatches=k.microbatches, layers=k.layers)
  cfg = tc.model
  stack = cfg.num_moe_layers or cfg.num_dense_layers
  micro = tc.data.global_batch_size // tc.data.num_microbatches
  try:
    pl = pipeline_lib.plan(spec, stack, rows=micro)
  except pipeline_lib.PipelineError as e:
    raise ConfigError(str(e)) from None
  batch_axes = sharding.spec_mesh_axes(sharding.logical_to_spec(("act_batch",), tc.mesh.rules)[0])
  shards = math.prod(shape[a] for a in batch_axes)
  rows = micro // pl.microbatches
  _need(
    rows % shards == 0,
    "pipeline.microbatches",
    f"{pl.microbatches} pipeline microbatches of {rows} rows: not divisible by the {shards} batch shards "
    f"(mesh axes {batch_axes})",
  )
  return spec


def eval_rows(tc: TrainConfig) -> int:
  """Global rows of an eval batch: `eval.batch_size`, else one training microbatch."""
  return tc.eval.batch_size or tc.data.global_batch_size // tc.data.num_microbatches


def mesh_shape(
  spec: MeshSpec, model: K2Config, n_devices: int, *, rows: int, what: str, seq_len: int | None = None
) -> dict[str, int]:
  """The mesh shape of `spec` on `n_devices`, checked against the model and a batch of `rows` rows
  (`what` names the config key that sets the rows). Shared by every loop's config boundary."""
  dcn = spec.dcn_shape
  slices = math.prod(dcn.values())
  _need(
    n_devices % slices == 0,
    "mesh.dcn_*",
    f"{slices} slices (the DCN product {dcn}) do not divide the {n_devices} devices",
  )
  try:
    ici = sharding.resolve_mesh_shape({a: getattr(spec, a) for a in sharding.MESH_AXES}, n_devices // slices)
  except sharding.ShardingError as e:
    where = f" (per slice: {n_devices // slices} devices in each of {slices} slices)" if slices > 1 else ""
    raise ConfigError(f"mesh: {e}{where}") from None
  shape = {a: ici[a] * dcn[a] for a in sharding.MESH_AXES}
  # Rows split over the batch axes; under a context-parallel preset the CP axis splits each row instead.
  row_spec = sharding.logical_to_spec(("act_batch", "act_length"), spec.rules)
  batch_axes = sharding.spec_mesh_axes(row_spec[0])
  shards = math.prod(shape[a] for a in batch_axes)
  _need(
    rows % shards == 0,
    what,
    f"{rows} rows are not divisible by the {shards} batch shards (mesh axes {batch_axes} under mesh.rules={spec.rules!r})",
  )
  cp = math.prod(shape[a] for a in sharding.spec_mesh_axes(row_spec[1]))
  _need(
    seq_len is None or cp == 1 or seq_len % (2 * cp) == 0,
    "data.seq_len",
    f"{seq_len} is not divisible by 2 x the context-parallel degree {cp} = {2 * cp} (mesh.rules={spec.rules!r} "
    f"shards the sequence over {row_spec[1]!r} in 2 x {cp} load-balanced chunks)",
  )
  _need(
    model.n_routed_experts % shape["expert"] == 0,
    "mesh.expert",
    f"{shape['expert']} does not divide n_routed_experts {model.n_routed_experts}",
  )
  return shape


def mesh_spec(m) -> MeshSpec:
  """`mesh.*` keys -> MeshSpec, validated (the same keys and presets for every loop)."""
  return configlib.build(MeshSpec, m, key="mesh", error=ConfigError)
