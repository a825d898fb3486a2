"""The one boundary where a training ConfigDict (configs/k2.py) becomes frozen, typed dataclasses.

`from_config_dict` checks everything that can be checked without devices or data (unknown keys,
types, divisibility, schedule lengths); `check_runtime` checks the rest (mesh vs devices and hosts,
data and tokenizer paths) before anything is compiled. Every error names the config key.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os

from ml_collections import config_dict

from k2jax import sharding
from k2jax.model import presets
from k2jax.model.config import ConfigError, K2Config

ON_UNREADABLE = ("error", "fresh")  # checkpoint.on_unreadable (k2jax.train.checkpoint.restore_latest)

DATA_KINDS = ("pretrain", "sft")


@dataclasses.dataclass(frozen=True)
class DataSpec:
  kind: str
  path: str
  tokenizer_path: str
  seq_len: int
  global_batch_size: int
  num_microbatches: int
  seed: int
  num_workers: int
  read_threads: int


@dataclasses.dataclass(frozen=True)
class OptimSpec:
  peak_lr: float
  final_lr: float
  warmup_steps: int
  decay_fraction: float
  weight_decay: float
  momentum: float
  adam_b1: float
  adam_b2: float
  adam_eps: float
  qk_clip_tau: float
  bias_update_rate: float
  offload_state: bool = False


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  rules: str
  data: int
  fsdp: int
  expert: int
  tensor: int


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  every_steps: int
  keep: int
  async_save: bool
  init_from: str
  read_budget_bytes: int
  on_unreadable: str  # every checkpoint unreadable: "error" (stop, nothing moved) | "fresh" (start at step 0)


@dataclasses.dataclass(frozen=True)
class LogSpec:
  every_steps: int
  progress: bool
  tensorboard: bool
  peak_flops: float
  spike_factor: float
  spike_window: int


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: K2Config
  steps: int
  seed: int
  topology: str
  data: DataSpec
  optim: OptimSpec
  mesh: MeshSpec
  checkpoint: CheckpointSpec
  log: LogSpec


def from_config_dict(c: config_dict.ConfigDict) -> TrainConfig:
  """ConfigDict -> TrainConfig; raises ConfigError naming the key on any bad value."""
  known = {"steps", "seed", "topology", "model", "data", "optim", "mesh", "checkpoint", "log"}
  extra = sorted(set(c.keys()) - known)
  if extra:
    raise ConfigError(f"unknown config key(s) {extra}; known: {sorted(known)}")
  tc = TrainConfig(
    model=model_config(c.model),
    steps=c.steps,
    seed=c.seed,
    topology=c.topology,
    data=_section(DataSpec, c.data, "data"),
    optim=_section(OptimSpec, c.optim, "optim"),
    mesh=mesh_spec(c.mesh),
    checkpoint=_section(CheckpointSpec, c.checkpoint, "checkpoint"),
    log=_section(LogSpec, c.log, "log"),
  )
  _validate(tc)
  return tc


def model_config(m: config_dict.ConfigDict) -> K2Config:
  """`model.preset` plus the non-None `model.*` fields -> frozen K2Config."""
  overrides = {k: v for k, v in m.items() if k != "preset" and v is not None}
  names = {f.name for f in dataclasses.fields(K2Config)}
  bad = sorted(set(overrides) - names)
  if bad:
    raise ConfigError(f"model: unknown field(s) {bad}")
  if "num_attention_heads" in overrides:  # MLA: kv heads always equal q heads.
    overrides["num_key_value_heads"] = overrides["num_attention_heads"]
  try:
    return presets.get(m.preset, **overrides)
  except KeyError as e:
    raise ConfigError(f"model.preset: {e.args[0]}") from None
  except ConfigError as e:
    raise ConfigError(f"model.{e}") from None


def _section(cls, d: config_dict.ConfigDict, name: str):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  keys = set(d.keys())
  if keys != set(fields):
    raise ConfigError(
      f"{name}: unknown key(s) {sorted(keys - set(fields))}, missing key(s) {sorted(set(fields) - keys)}"
    )
  kw = {}
  for k, f in fields.items():
    v, want = d[k], {"int": int, "float": float, "str": str, "bool": bool}[f.type]
    if want is float and isinstance(v, int) and not isinstance(v, bool):
      v = float(v)
    if not isinstance(v, want) or (want is int and isinstance(v, bool)):
      raise ConfigError(f"{name}.{k}: expected {f.type}, got {v!r}")
    kw[k] = v
  return cls(**kw)


def _need(cond: bool, key: str, msg: str) -> None:
  if not cond:
    raise ConfigError(f"{key}: {msg}")


def _validate(tc: TrainConfig) -> None:
  d, o = tc.data, tc.optim
  _need(tc.steps > 0, "steps", f"must be > 0, got {tc.steps}")
  _need(d.kind in DATA_KINDS, "data.kind", f"one of {DATA_KINDS}, got {d.kind!r}")
  _need(d.seq_len > 1, "data.seq_len", f"must be > 1, got {d.seq_len}")
  _need(
    d.seq_len <= tc.model.max_position_embeddings,
    "data.seq_len",
    f"{d.seq_len} > model max_position_embeddings {tc.model.max_position_embeddings}",
  )
  _need(d.num_microbatches >= 1, "data.num_microbatches", f"must be >= 1, got {d.num_microbatches}")
  _need(
    d.global_batch_size % d.num_microbatches == 0,
    "data.global_batch_size",
    f"{d.global_batch_size} is not divisible by data.num_microbatches={d.num_microbatches}",
  )
  _need(
    o.peak_lr > 0 and 0 <= o.final_lr <= o.peak_lr,
    "optim.final_lr",
    f"need 0 <= final_lr ({o.final_lr}) <= peak_lr ({o.peak_lr}) and peak_lr > 0",
  )
  _need(0.0 <= o.decay_fraction <= 1.0, "optim.decay_fraction", f"in [0, 1], got {o.decay_fraction}")
  _need(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
  _need(o.bias_update_rate >= 0, "optim.bias_update_rate", f"must be >= 0, got {o.bias_update_rate}")
  _need(tc.checkpoint.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
  _need(tc.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1")
  _need(tc.checkpoint.read_budget_bytes >= 1, "checkpoint.read_budget_bytes", "must be >= 1")
  _need(
    tc.checkpoint.on_unreadable in ON_UNREADABLE,
    "checkpoint.on_unreadable",
    f"one of {ON_UNREADABLE}, got {tc.checkpoint.on_unreadable!r}",
  )
  _need(tc.log.every_steps >= 1, "log.every_steps", "must be >= 1")
  _need(tc.log.spike_window >= 1, "log.spike_window", "must be >= 1")


def check_runtime(tc: TrainConfig, n_devices: int, process_count: int) -> dict[str, int]:
  """Checks against the live runtime and files; returns the mesh shape. Call before compiling."""
  micro = tc.data.global_batch_size // tc.data.num_microbatches
  shape = mesh_shape(
    tc.mesh,
    tc.model,
    n_devices,
    rows=micro,
    what=f"data.global_batch_size (a microbatch of {micro} rows = global_batch_size / num_microbatches)",
  )
  _need(
    tc.data.global_batch_size % process_count == 0,
    "data.global_batch_size",
    f"{tc.data.global_batch_size} is not divisible by the {process_count} processes",
  )
  if tc.data.path:
    found = glob.glob(tc.data.path) if glob.has_magic(tc.data.path) else [tc.data.path]
    _need(bool(found) and all(os.path.isfile(p) for p in found), "data.path", f"no data file at {tc.data.path!r}")
  if tc.data.tokenizer_path:
    tok = tc.data.tokenizer_path  # a rank file, or a Kimi-K2 HF directory holding tiktoken.model
    ok = os.path.isfile(tok) or os.path.isfile(os.path.join(tok, "tiktoken.model"))
    _need(ok, "data.tokenizer_path", f"no tokenizer file at {tok!r} (nor {os.path.join(tok, 'tiktoken.model')!r})")
  if tc.checkpoint.init_from:
    _need(
      os.path.isdir(tc.checkpoint.init_from), "checkpoint.init_from", f"no directory at {tc.checkpoint.init_from!r}"
    )
  return shape


def mesh_shape(spec: MeshSpec, model: K2Config, n_devices: int, *, rows: int, what: str) -> dict[str, int]:
  """The mesh shape of `spec` on `n_devices`, checked against the model and a batch of `rows` rows
  (`what` names the config key that sets the rows). Shared by every loop's config boundary."""
  try:
    shape = sharding.resolve_mesh_shape({a: getattr(spec, a) for a in sharding.MESH_AXES}, n_devices)
  except sharding.ShardingError as e:
    raise ConfigError(f"mesh: {e}") from None
  batch_axes = sharding.spec_mesh_axes(sharding.logical_to_spec(("act_batch",), spec.rules)[0])
  shards = math.prod(shape[a] for a in batch_axes)
  _need(
    rows % shards == 0,
    what,
    f"{rows} rows are not divisible by the {shards} batch shards (mesh axes {batch_axes} under mesh.rules={spec.rules!r})",
  )
  _need(
    model.n_routed_experts % shape["expert"] == 0,
    "mesh.expert",
    f"{shape['expert']} does not divide n_routed_experts {model.n_routed_experts}",
  )
  return shape


def mesh_spec(m: config_dict.ConfigDict) -> MeshSpec:
  """`mesh.*` keys -> MeshSpec, validated (the same keys and presets for every loop)."""
  spec = _section(MeshSpec, m, "mesh")
  _need(spec.rules in sharding.RULES, "mesh.rules", f"one of {sorted(sharding.RULES)}, got {spec.rules!r}")
  for a in sharding.MESH_AXES:
    _need(getattr(spec, a) == -1 or getattr(spec, a) >= 1, f"mesh.{a}", f"must be >= 1 or -1, got {getattr(spec, a)}")
  _need(sum(getattr(spec, a) == -1 for a in sharding.MESH_AXES) <= 1, "mesh", "at most one axis may be -1")
  return spec
