"""Memory planner: per-device bytes of parameters, gradients, MuonClip state and activations.

Nothing is allocated: parameters come from `nnx.eval_shape` of the model, optimizer state from
`jax.eval_shape` of the real MuonClip `init` (momentum for Muon leaves, two moments for AdamW leaves),
and each leaf's per-device shard follows its PartitionSpec under the rules preset and mesh sizes,
so a 512-chip plan runs on a laptop. Activations are an estimate (formula in `activation_bytes`).

  p = plan(presets.get("1t"), TOPOLOGIES["v5p-1024"].mesh, "fsdp_ep", 4096,
           seq_len=4096, topology="v5p-1024")
  print(format_plan(p))      # key=value lines, ending in fits=True|False
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from k2jax import sharding as sharding_lib
from k2jax.model import K2Config, K2Model, expert_parallel
from k2jax.optim import QKClipSpec, muonclip, path_name


@dataclasses.dataclass(frozen=True)
class Topology:
  """A machine: JAX devices, memory per device, and a default mesh and rules preset for `1t`."""

  num_devices: int
  device_memory_bytes: int
  mesh: Mapping[str, int]
  preset: str
  description: str


TOPOLOGIES: dict[str, Topology] = {
  # v5p: 95.73 GiB HBM per chip as XLA:TPU allocates it (k2jax.train.aot), one JAX device per chip;
  # v5p-1024 = 1024 TensorCores = 512 chips.
  # EP 8 x FSDP 64 follows MaxText's Kimi recipe (reference §7: ici_fsdp 64, ici_expert 8).
  "v5p-1024": Topology(
    512, int(95.73 * 2**30), {"fsdp": 64, "expert": 8}, "fsdp_ep", "TPU v5p-1024: 512 chips x 95 GiB HBM"
  ),
  # 32 nodes x 8 H200 (141 GB HBM3e each); EP within a node keeps the all-to-all on NVLink.
  "h200-32x8": Topology(
    256, 141 * 10**9, {"fsdp": 32, "expert": 8}, "fsdp_ep", "32 nodes x 8 NVIDIA H200: 256 GPUs x 141 GB HBM"
  ),
}


def topology(name: str) -> Topology:
  if name not in TOPOLOGIES:
    raise KeyError(f"unknown topology {name!r}; known: {sorted(TOPOLOGIES)}")
  return TOPOLOGIES[name]


def plan(
  model_cfg: K2Config,
  mesh_shape,
  rules_preset: str,
  batch_per_device_tokens: int,
  *,
  seq_len: int,
  topology: str | None = None,
  device_memory_bytes: int | None = None,
  num_devices: int | None = None,
  mu_dtype=None,
  num_microbatches: int = 1,
  accelerator: bool | None = None,
  offload_opt_state: bool = False,
  stage_sharded: str | None = None,
) -> dict:
  """Per-device memory of training `model_cfg` under `rules_preset` on a mesh of `mesh_shape`.

  Args:
    batch_per_device_tokens: tokens per device per forward/backward (one micro-batch).
    seq_len: sequence length (attention's score matrix is seq_len wide).
    topology: a TOPOLOGIES name: gives num_devices and device_memory_bytes.
    device_memory_bytes, num_devices: explicit values (override the topology's).
    mu_dtype: Muon/AdamW first-moment dtype (None: the parameter dtype), as given to `muonclip`.
    num_microbatches: > 1 holds each microbatch's gradient (`grad_accum`: stacked layer matrices in the
      compute dtype, the rest in the parameter dtype) beside the float32 gradient accumulator (`grads`).
    accelerator: whether the plan is for TPU/GPU (EP 'auto' dispatch is ragged there); None: true
      when `topology` is given, else this host's backend.
    offload_opt_state: the optimizer state waits in host memory (`optim.offload_state`; TPU/GPU only):
      its bytes are reported as `host_opt_bytes_per_device` and leave the device total.
    stage_sharded: the layer stack ('moe_layers' / 'dense_layers') whose `layers` dim a pipeline stores over
      the `stage` axis (k2jax.train.partition.pipelined_stack): its params, grads and optimizer state shrink by
      the stage count. Activations are planned as without a pipeline.
  Returns a dict of ints (bytes per device, parameter counts) plus `fits` (bool or None when no
  device memory is known).
  """
  topo = TOPOLOGIES[topology] if topology is not None else None
  n_dev = num_devices or (topo.num_devices if topo else jax.device_count())
  mem = device_memory_bytes or (topo.device_memory_bytes if topo else None)
  sizes = sharding_lib.resolve_mesh_shape(mesh_shape, n_dev)
  abstract = nnx.eval_shape(lambda: K2Model(model_cfg, rngs=nnx.Rngs(0)))
  state = nnx.state(abstract)
  specs = {}  # param path name -> (shape, spec)
  for path, var in jax.tree_util.tree_flatten_with_path(
    sharding_lib.param_specs(state, rules_preset), is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]:
    specs[path_name(path)] = var.get_value()
  over_stages = lambda name: stage_sharded is not None and name.startswith(stage_sharded + ".")  # noqa: E731
  specs = {n: P("stage", *tuple(sp)[1:]) if over_stages(n) else sp for n, sp in specs.items()}
  shapes = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
  params_bytes = sum(_shard_bytes(x, specs[n], sizes, n) for n, x in shapes.items())
  trained = nnx.state(abstract, nnx.Param)
  opt = muonclip(1e-3, qk_clip_spec=QKClipSpec.from_config(model_cfg), mu_dtype=mu_dtype)
  opt_state = jax.eval_shape(opt.init, trained)
  mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))
  opt_shardings = sharding_lib.opt_state_shardings(opt_state, trained, mesh, rules_preset)
  opt_bytes = sum(
    _shard_bytes(x, _opt_spec(path_name(p), x, s.spec, specs, shapes), sizes, path_name(p))
    for (p, x), s in zip(jax.tree_util.tree_flatten_with_path(opt_state)[0], jax.tree.leaves(opt_shardings))
  )
  grads_bytes = sum(
    _shard_bytes(x, specs[path_name(p)], sizes, path_name(p))
    for p, x in jax.tree_util.tree_flatten_with_path(trained)[0]
  )
  # The stacked layer matrices in the compute dtype (model.transformer.compute_copy): the copy the layer
  # scan reads, and each microbatch's gradient of them before it is added to the float32 accumulator.
  c = jnp.dtype(model_cfg.compute_dtype)
  trained_names = {path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(trained)[0]}
  copied = [n for n in trained_names if _compute_copied(n)] if c != jnp.dtype(model_cfg.param_dtype) else []
  copy_bytes = sum(_shard_bytes(jax.ShapeDtypeStruct(shapes[n].shape, c), specs[n], sizes, n) for n in copied)
  grad_accum = grads_bytes - sum(_shard_bytes(shapes[n], specs[n], sizes, n) for n in copied) + copy_bytes
  grad_accum = grad_accum if num_microbatches > 1 else 0
  gathered = gathered_layer_bytes(model_cfg, shapes, specs, sizes)
  if accelerator is None:
    accelerator = topo is not None or jax.default_backend() in expert_parallel.RAGGED_PLATFORMS
  ragged = model_cfg.moe_dispatch == "ragged" or (model_cfg.moe_dispatch == "auto" and accelerator)
  flash = model_cfg.attention == "flash" or (model_cfg.attention == "auto" and accelerator)
  act = activation_bytes(model_cfg, sizes, rules_preset, batch_per_device_tokens, seq_len, ragged=ragged, flash=flash)
  host_opt = opt_bytes if offload_opt_state and accelerator else 0
  # A sum, not the peak of one program point: XLA's own allocation for 1t on v5p-1024 (bench/aot.py, flash
  # attention, ragged EP) is 48.96 GiB against this plan's 50.65 (1.035), 40.76 with the optimizer state
  # offloaded against 42.45.
  total = params_bytes + grads_bytes + grad_accum + opt_bytes - host_opt + copy_bytes + gathered + act
  return dict(
    num_devices=n_dev,
    mesh=sharding_lib.mesh_text(sizes),
    rules_preset=rules_preset,
    batch_per_device_tokens=batch_per_device_tokens,
    seq_len=seq_len,
    params_bytes_per_device=params_bytes,
    grads_bytes_per_device=grads_bytes,
    grad_accum_bytes_per_device=grad_accum,
    opt_bytes_per_device=opt_bytes - host_opt,
    host_opt_bytes_per_device=host_opt,
    compute_copy_bytes_per_device=copy_bytes,
    gathered_bytes_per_device=gathered,
    act_bytes_per_device=act,
    total_bytes_per_device=total,
    device_memory_bytes=mem,
    fits=None if mem is None else total <= mem,
  )


def format_plan(p: dict) -> str:
  """`key=value` lines (bytes as ints, plus total in GiB) for the dry run."""
  lines = [f"{k}={v}" for k, v in p.items()]
  lines.insert(-2, f"total_gib_per_device={p['total_bytes_per_device'] / 2**30:.2f}")
  return "\n".join(lines)


def gathered_layer_bytes(cfg: K2Config, shapes: dict, specs: dict, sizes: Mapping[str, int]) -> int:
  """One layer's weights as FSDP all-gathers them for its backward, per device: the gathered copy in
  the compute dtype and its gradient before the reduce-scatter (2 copies of the largest layer kind;
  only fsdp shards are gathered). XLA:TPU's peak for 1t on v5p-1024 holds exactly these for one MoE
  layer."""
  c = jnp.dtype(cfg.compute_dtype).itemsize
  per_kind: dict[str, int] = {}
  for name, x in shapes.items():
    kind = name.split(".")[0]
    if kind not in ("dense_layers", "moe_layers") or len(x.shape) < 2:
      continue
    entries = tuple(specs[name]) + (None,) * len(x.shape)
    kept = [
      d // math.prod(sizes[a] for a in sharding_lib.spec_mesh_axes(e) if a != "fsdp")
      for d, e in zip(x.shape[1:], entries[1:])
    ]
    per_kind[kind] = per_kind.get(kind, 0) + math.prod(kept) * c
  return 2 * max(per_kind.values(), default=0)


# The einsum attention's backward of one layer holds this many float32 [T, H, S] buffers at XLA:TPU's
# peak: 1t on v5p-1024 (4096 tokens per device, full remat) allocates 28.7 GiB more with the einsum path
# than with the flash kernel (bench/aot.py: 69.50 vs 40.76 GiB), 7.2 such buffers of 4 GiB.
SCORES_BACKWARD = 7


def activation_bytes(
  cfg: K2Config,
  sizes: Mapping[str, int],
  preset: str,
  tokens: int,
  seq_len: int,
  *,
  ragged: bool = False,
  flash: bool = False,
) -> int:
  """Estimated activation bytes held for the backward pass, per device.

  Per token and layer (c = compute dtype bytes; widths divided by their `tensor` sharding):
    attention: c*(2D + 2Rq + 2H(Kn+Kr) + 2(Rkv+Kr) + H(Kn+V) + HV) + scores, where scores =
               (4 + c)*H*seq_len on the einsum path (float32 logits, compute-dtype probabilities) and
               0 with the flash kernel (memory linear in seq_len); the layer being differentiated holds
               SCORES_BACKWARD float32 [H, seq_len] rows per token instead (logits, probabilities, their
               gradients and masks)
    MoE:       c*(D + 3Fs) + 4E (router scores), plus the routed rows per token of one dispatch chunk
               (`moe_chunk_tokens` under expert parallelism: the rest of the chunks are rematerialised):
               ragged c*(k*D + o*k*(D + 3F)), fixed c*o*k*(2D + 3F), o = the dropless worst-case rows
               over real rows of the receive buffer (`expert_parallel.padding_overhead`)
    dense FFN: c*(D + 3F_dense)
    context parallelism (a `*_cp` preset over cp devices): each device's queries see the whole gathered
               sequence, cp keys per local token: cp*c*((Rkv + Kr) + 2H(Kn + Kr + V)) for the gathered
               latent (or per-head keys), the up-projected keys and values, and their gradients
  Remat: 'none' and 'dots' keep every layer; 'dots_no_batch' drops the attention score terms
  (batched dots); 'full' keeps only each layer's input (c*D) plus one layer recomputed in backward (with
  the backward's score rows).
  Plus the float32 logits and their gradient (2 * 4 * S per token).
  """
  c = jnp.dtype(cfg.compute_dtype).itemsize
  tp = lambda logical: math.prod(  # noqa: E731
    sizes[a] for a in (sharding_lib.rules(preset)[logical] or ())
  )
  D, H, S = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
  Kn, Kr, V, Rq, Rkv = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank)
  ht = tp("q_heads")
  scores = 0 if flash else (4 + c) * H * seq_len / ht
  attn = c * (2 * D + 2 * Rq + 2 * H * (Kn + Kr) / ht + 2 * (Rkv + Kr) + H * (Kn + V + V) / ht)
  cp = tp("act_length")
  if cp > 1:
    attn += cp * c * ((Rkv + Kr) + 2 * H * (Kn + Kr + V) / ht)
  ep = tp("experts")
  chunk = tokens // expert_parallel.num_chunks(tokens, cfg.moe_chunk_tokens) if ep > 1 else tokens
  o = (
    expert_parallel.padding_overhead(max(chunk, 1), cfg.num_experts_per_tok, cfg.n_routed_experts // ep, ep)
    if ep > 1
    else 1.0
  )
  F, Fs = cfg.moe_intermediate_size / tp("expert_mlp"), cfg.moe_intermediate_size * cfg.n_shared_experts
  k = cfg.num_experts_per_tok
  routed = c * (k * D + o * k * (D + 3 * F) if ragged else o * k * (2 * D + 3 * F))
  moe = tokens * (c * (D + 3 * Fs / tp("shared_mlp")) + 4 * cfg.n_routed_experts) + chunk * routed
  dense = tokens * c * (D + 3 * cfg.intermediate_size / tp("mlp"))
  per_layer = {"dense": tokens * (attn + scores) + dense, "moe": tokens * (attn + scores) + moe}
  if cfg.remat_policy == "dots_no_batch":
    per_layer = {k: v - tokens * scores for k, v in per_layer.items()}
  n = {"dense": cfg.num_dense_layers, "moe": cfg.num_moe_layers}
  if cfg.remat_policy == "full":
    backward = 0 if flash else tokens * (4 * SCORES_BACKWARD - 4 - c) * H * seq_len / ht
    held = tokens * cfg.num_hidden_layers * c * D + max(per_layer[k] for k in n if n[k]) + backward
  else:
    held = sum(n[k] * per_layer[k] for k in n)
  logits = tokens * 2 * 4 * S / tp("act_vocab")
  return int(held + logits)


def _compute_copied(name: str) -> bool:
  """Whether param `name` is a stacked layer matrix the layer scan reads in the compute dtype."""
  parts = name.split(".")
  return parts[0] in ("dense_layers", "moe_layers") and parts[-1].startswith("w_") and "router" not in parts


def _opt_spec(name: str, x, spec, param_specs: dict, shapes: dict):
  """An optimizer-state leaf's spec: its parameter's (as `opt_state_shardings` matches them: path suffix and
  shape), so a stage-sharded stack's moments are counted over stages too."""
  for pname, pspec in param_specs.items():
    if (name == pname or name.endswith("." + pname)) and tuple(shapes[pname].shape) == tuple(x.shape):
      return pspec
  return spec


def _shard_bytes(x, spec, sizes, name) -> int:
  sharding_lib.check_divisible(x.shape, spec, sizes, name)
  shard = [
    d // math.prod(sizes[a] for a in sharding_lib.spec_mesh_axes(e))
    for d, e in zip(x.shape, tuple(spec) + (None,) * len(x.shape))
  ]
  return math.prod(shard) * jnp.dtype(x.dtype).itemsize
