"""Model configuration: one frozen dataclass that round-trips the Hugging Face `config.json`.

Field names are the HF DeepSeek-V3 / Kimi-K2 names, so a published `config.json` maps onto this class
without a translation table. Fields that k2jax adds (dtypes, layer scanning, remat) are not written to
`config.json`. Unknown HF keys (e.g. `quantization_config`, `transformers_version`) are kept verbatim in
`extra` so a load -> save cycle loses nothing.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "yarn")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# "auto": the Pallas flash kernel when compiling for TPU or GPU, the einsum path on CPU (model/mla.py).
ATTENTION_KINDS = ("auto", "einsum", "flash", "flash_xla", "flash_triton")
# What MLA gathers over the context-parallel axis (model/mla.py says why 'latent' is the default).
CP_GATHERS = ("latent", "heads")
MOE_DISPATCHES = ("auto", "fixed", "ragged")
# The routed experts' grouped GEMM per compile target (model/moe_gemm.py documents each).
MOE_GEMMS = ("auto", "ragged_dot", "tiled", "tokamax", "tokamax_triton", "jax_triton")
# Quantization-aware training of the routed experts (model/int4.py): "none", or "int4" = the forward pass
# sees each expert weight on Kimi-K2-Thinking's INT4 grid (group 32, amax/7) with a straight-through gradient.
EXPERT_QATS = ("none", "int4")
# How the routed experts' weights are held: "float" (param_dtype), or "int4" = packed codes + bf16 scales on the
# same grid, dequantized per layer (serving only: an engine holding INT4 experts; model/int4.py).
EXPERT_STORAGES = ("float", "int4")

# Execution knobs: how to run the architecture, never written to config.json. A key of that name in a
# config.json is not one of ours: it is kept verbatim in `extra` like any unknown HF key.
EXEC_FIELDS = (
  "param_dtype",
  "compute_dtype",
  "scan_layers",
  "remat_policy",
  "attention",
  "cp_gather",
  "moe_dispatch",
  "moe_chunk_tokens",
  "moe_gemm",
  "expert_qat",
  "expert_storage",
)
_K2JAX_FIELDS = EXEC_FIELDS + ("extra",)
# HF keys derived from others or meaningless here; accepted on input, not kept in `extra`.
_IGNORED_HF_KEYS = (
  "rope_parameters",
  "rope_scaling",
  "auto_map",
  "qk_head_dim",
  "head_dim",
  "num_mtp_layers",
  "output_router_logits",
  "_name_or_path",
)


class ConfigError(ValueError):
  """A config value is missing, unsupported or inconsistent; the message names the field."""


@dataclasses.dataclass(frozen=True)
class K2Config:
  """Kimi K2 / DeepSeek-V3 architecture (HF field names) plus k2jax execution knobs."""

  vocab_size: int = 163840
  hidden_size: int = 7168
  intermediate_size: int = 18432  # dense-layer SwiGLU width
  moe_intermediate_size: int = 2048  # per routed expert (and per shared expert)
  num_hidden_layers: int = 61
  num_attention_heads: int = 64
  num_key_value_heads: int = 64  # MLA: must equal num_attention_heads
  q_lora_rank: int = 1536
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  n_routed_experts: int = 384
  num_experts_per_tok: int = 8
  n_shared_experts: int = 1
  first_k_dense_replace: int = 1
  moe_layer_freq: int = 1
  n_group: int = 1
  topk_group: int = 1
  topk_method: str = "noaux_tc"
  scoring_func: str = "sigmoid"
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 2.827
  hidden_act: str = "silu"
  rms_norm_eps: float = 1e-6
  rope_theta: float = 50000.0
  # YaRN etc. as a sorted tuple of (key, value) so the dataclass stays hashable; None = plain RoPE.
  rope_scaling: tuple[tuple[str, Any], ...] | None = (
    ("beta_fast", 1.0),
    ("beta_slow", 1.0),
    ("factor", 32.0),
    ("mscale", 1.0),
    ("mscale_all_dim", 1.0),
    ("original_max_position_embeddings", 4096),
    ("type", "yarn"),
  )
  rope_interleave: bool = True
  max_position_embeddings: int = 131072
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  initializer_range: float = 0.02
  bos_token_id: int | None = 163584
  eos_token_id: int | None = 163585
  num_nextn_predict_layers: int = 0
  # Moonshot's own config.json says "kimi_k2" (for its remote code); the architecture is DeepSeek-V3's,
  # and "deepseek_v3" lets transformers load exports natively (SGLang/vLLM dispatch on `architectures`).
  # A loaded config keeps whatever it declared, so round trips stay exact.
  model_type: str = "deepseek_v3"
  architectures: tuple[str, ...] = ("DeepseekV3ForCausalLM",)
  # --- k2jax execution knobs (not part of config.json) ---
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  scan_layers: bool = True
  remat_policy: str = "none"
  attention: str = "auto"  # auto | einsum | flash | flash_xla | flash_triton (ATTENTION_KINDS)
  # Context parallelism: gather MLA's compressed latent + shared rope key ('latent') or the per-head
  # keys and values ('heads') over the context axis (CP_GATHERS; model/mla.py).
  cp_gather: str = "latent"
  # Expert-parallel all-to-all (expert_parallel.py): 'ragged' sends exactly the routed rows (TPU/GPU),
  # 'fixed' a dropless worst-case buffer per destination (XLA:CPU has no ragged-all-to-all);
  # 'auto' picks ragged where the compile target's platform has it.
  moe_dispatch: str = "auto"
  # Expert parallelism runs each device's tokens through dispatch, experts and combine in chunks of at
  # most this many tokens (0: one chunk), each chunk rematerialised in the backward pass: the dropless
  # worst-case receive buffer (ep * n * min(k, E_loc) rows) shrinks with n. Outputs are the same; the
  # routed experts' weight gradients are summed over chunks in the compute dtype.
  moe_chunk_tokens: int = 0
  # The grouped GEMM of the routed experts: auto = the CPU kernel on CPU, tokamax's kernels on GPU,
  # XLA's native ragged_dot on TPU (MOE_GEMMS; model/moe_gemm.py).
  moe_gemm: str = "auto"
  # Fake-quantize the routed experts' weights in the forward pass (EXPERT_QATS; model/int4.py): "int4" trains
  # on the grid the INT4 release serves. Attention, shared experts, dense layers, router, embeddings and
  # head stay in full precision. Off by default.
  expert_qat: str = "none"
  # Serving: hold the routed experts as INT4 (EXPERT_STORAGES): packed codes two per byte and bf16 scales,
  # about 0.56 bytes per weight, each layer's experts dequantized when it runs. Pushed float weights are
  # quantized on arrival (`int4.served_params`), so an engine serves what an expert_qat='int4' trainer
  # trains on. Not trainable.
  expert_storage: str = "float"
  extra: tuple[tuple[str, str], ...] = ()  # unknown HF keys -> JSON-encoded values

  def __post_init__(self):
    validate(self)

  # Derived sizes used throughout the model.
  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def num_dense_layers(self) -> int:
    return min(self.first_k_dense_replace, self.num_hidden_layers)

  @property
  def num_moe_layers(self) -> int:
    return self.num_hidden_layers - self.num_dense_layers

  @property
  def rope(self) -> dict[str, Any]:
    """rope_scaling as a dict with `rope_type` normalised ('default' when absent)."""
    d = dict(self.rope_scaling or ())
    d["rope_type"] = d.pop("type", d.pop("rope_type", "default"))
    return d

  def replace(self, **kw) -> "K2Config":
    return dataclasses.replace(self, **kw)

  # --- HF config.json round trip ---
  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], **k2jax_fields) -> "K2Config":
    d = dict(d)
    names = {f.name for f in dataclasses.fields(cls)} - set(_K2JAX_FIELDS)
    kw: dict[str, Any] = {}
    rope = d.get("rope_scaling") or None
    params = d.get("rope_parameters")
    if rope is None and isinstance(params, dict):
      # transformers >= 5 writes `rope_parameters` (rope_theta inside, rope_type 'default' for plain RoPE).
      rope = {k: v for k, v in params.items() if k != "rope_theta"}
      if "rope_theta" in params and "rope_theta" not in d:
        kw["rope_theta"] = float(params["rope_theta"])
      if rope.get("rope_type", rope.get("type")) == "default":
        rope = None
    if rope is not None:
      if not isinstance(rope, dict):
        raise ConfigError(f"rope_scaling: expected a dict, got {type(rope).__name__}")
      rope = dict(rope)
      if "rope_type" in rope:
        rope["type"] = rope.pop("rope_type")
      kw["rope_scaling"] = tuple(sorted(rope.items()))
    else:
      kw["rope_scaling"] = None
    extra = []
    for k, v in d.items():
      if k in names and k != "rope_scaling":
        kw[k] = tuple(v) if k == "architectures" else v
      elif k not in _IGNORED_HF_KEYS and k not in names:
        extra.append((k, json.dumps(v, sort_keys=True)))
    for k in ("rope_theta", "routed_scaling_factor", "rms_norm_eps"):
      if k in kw and kw[k] is not None:
        kw[k] = float(kw[k])
    return cls(**kw, extra=tuple(sorted(extra)), **k2jax_fields)

  def to_hf_dict(self) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(self):
      if f.name in _K2JAX_FIELDS:
        continue
      v = getattr(self, f.name)
      if f.name == "rope_scaling":
        v = None if v is None else dict(v)
      elif f.name == "architectures":
        v = list(v)
      out[f.name] = v
    for k, v in self.extra:
      out[k] = json.loads(v)
    return dict(sorted(out.items()))

  @classmethod
  def from_json_file(cls, path: str, **k2jax_fields) -> "K2Config":
    try:
      with open(path) as f:
        d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ConfigError(f"{path}: cannot read config.json ({e})") from e
    try:
      return cls.from_hf_dict(d, **k2jax_fields)
    except (ConfigError, TypeError) as e:
      raise ConfigError(f"{path}: {e}") from e


def _need(cond: bool, field: str, msg: str):
  if not cond:
    raise ConfigError(f"{field}: {msg}")


def validate(c: K2Config) -> None:
  """Raise ConfigError naming the first unsupported or inconsistent field."""
  for name in (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
  ):
    v = getattr(c, name)
    _need(isinstance(v, int) and v > 0, name, f"must be a positive int, got {v!r}")
  _need(
    not any(a not in SUPPORTED_ARCHITECTURES for a in c.architectures),
    "architectures",
    f"unsupported {list(c.architectures)}; k2jax supports {list(SUPPORTED_ARCHITECTURES)}",
  )
  _need(
    c.q_lora_rank is not None and c.q_lora_rank > 0,
    "q_lora_rank",
    f"k2jax implements MLA with a q LoRA (Kimi K2 / DeepSeek-V3); got q_lora_rank={c.q_lora_rank!r}",
  )
  _need(
    c.num_key_value_heads in (None, c.num_attention_heads),
    "num_key_value_heads",
    f"MLA needs num_key_value_heads == num_attention_heads ({c.num_attention_heads}), got {c.num_key_value_heads}",
  )
  _need(c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"must be even, got {c.qk_rope_head_dim}")
  _need(
    c.num_experts_per_tok <= c.n_routed_experts,
    "num_experts_per_tok",
    f"{c.num_experts_per_tok} > n_routed_experts {c.n_routed_experts}",
  )
  _need(
    c.n_group >= 1 and c.n_routed_experts % c.n_group == 0,
    "n_group",
    f"n_routed_experts {c.n_routed_experts} is not divisible by n_group {c.n_group}",
  )
  _need(1 <= c.topk_group <= c.n_group, "topk_group", f"must be in [1, n_group={c.n_group}], got {c.topk_group}")
  if c.n_group > 1:
    per_group = c.n_routed_experts // c.n_group
    _need(per_group >= 2, "n_group", "group-limited routing needs >= 2 experts per group")
    _need(
      c.topk_group * per_group >= c.num_experts_per_tok,
      "topk_group",
      f"topk_group {c.topk_group} x {per_group} experts/group < num_experts_per_tok {c.num_experts_per_tok}",
    )
  _need(c.scoring_func == "sigmoid", "scoring_func", f"only 'sigmoid' is supported, got {c.scoring_func!r}")
  _need(c.topk_method == "noaux_tc", "topk_method", f"only 'noaux_tc' is supported, got {c.topk_method!r}")
  _need(c.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got {c.hidden_act!r}")
  _need(c.moe_layer_freq == 1, "moe_layer_freq", f"only 1 is supported, got {c.moe_layer_freq}")
  _need(0 <= c.first_k_dense_replace, "first_k_dense_replace", "must be >= 0")
  _need(not c.attention_bias, "attention_bias", "K2 has no attention biases")
  _need(not c.tie_word_embeddings, "tie_word_embeddings", "K2 unties embedding and LM head")
  _need(c.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
  _need(c.remat_policy in REMAT_POLICIES, "remat_policy", f"one of {REMAT_POLICIES}, got {c.remat_policy!r}")
  _need(c.attention in ATTENTION_KINDS, "attention", f"one of {ATTENTION_KINDS}, got {c.attention!r}")
  _need(c.cp_gather in CP_GATHERS, "cp_gather", f"one of {CP_GATHERS}, got {c.cp_gather!r}")
  _need(c.moe_chunk_tokens >= 0, "moe_chunk_tokens", f">= 0 (0: one chunk), got {c.moe_chunk_tokens}")
  _need(c.moe_gemm in MOE_GEMMS, "moe_gemm", f"one of {MOE_GEMMS}, got {c.moe_gemm!r}")
  _need(c.expert_qat in EXPERT_QATS, "expert_qat", f"one of {EXPERT_QATS}, got {c.expert_qat!r}")
  _need(
    c.expert_qat == "none" or c.num_moe_layers > 0,
    "expert_qat",
    f"{c.expert_qat!r} quantizes routed experts and this model has none (first_k_dense_replace="
    f"{c.first_k_dense_replace} >= num_hidden_layers={c.num_hidden_layers}: every layer is a dense MLP)",
  )
  _need(c.expert_storage in EXPERT_STORAGES, "expert_storage", f"one of {EXPERT_STORAGES}, got {c.expert_storage!r}")
  _need(
    c.expert_storage == "float" or c.num_moe_layers > 0,
    "expert_storage",
    f"{c.expert_storage!r} stores routed experts and this model has none (every layer is a dense MLP)",
  )
  _need(c.moe_dispatch in MOE_DISPATCHES, "moe_dispatch", f"one of {MOE_DISPATCHES}, got {c.moe_dispatch!r}")
  for name in ("param_dtype", "compute_dtype"):
    _need(getattr(c, name) in ("float32", "bfloat16"), name, f"float32 or bfloat16, got {getattr(c, name)!r}")
  rope = c.rope
  _need(
    rope["rope_type"] in SUPPORTED_ROPE_TYPES,
    "rope_scaling.type",
    f"unsupported {rope['rope_type']!r}; supported {SUPPORTED_ROPE_TYPES}",
  )
  if rope["rope_type"] == "yarn":
    _need(
      "original_max_position_embeddings" in rope, "rope_scaling.original_max_position_embeddings", "required for YaRN"
    )
