"""The Kimi K2 decoder: embedding, dense layers, MoE layers, final norm, untied LM head.

Layers of each kind are stored stacked (leading `layers` axis) and run with `jax.lax.scan` over the
stacked state, so a 61-layer model compiles one dense and one MoE layer body. `scan_layers=False` runs
the same stacked parameters in a Python loop (used to check the scan, and for debugging).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k2jax import sharding as sharding_lib
from k2jax.model import context_parallel as cp
from k2jax.model import pipeline as pipeline_lib
from k2jax.model import rope as rope_lib
from k2jax.model.block import Block
from k2jax.model.config import ConfigError, K2Config
from k2jax.model.layers import RMSNorm, make_param

REMAT = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class ModelOutput(NamedTuple):
  logits: jnp.ndarray  # [B, T, S] float32
  max_logits: jnp.ndarray  # [num_hidden_layers, H] float32: per-head max pre-softmax logit
  expert_counts: jnp.ndarray  # [num_moe_layers, E] int32: tokens routed to each expert


class K2Model(nnx.Module):
  """Kimi K2 / DeepSeek-V3 causal LM. `model(input_ids)` -> ModelOutput."""

  def __init__(self, cfg: K2Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = jnp.dtype(cfg.param_dtype)
    self.embed = nnx.Module()
    self.embed.embedding = make_param(
      rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), stack=None, std=cfg.initializer_range, dtype=dt
    )
    if cfg.num_dense_layers:
      self.dense_layers = Block(cfg, moe=False, stack=cfg.num_dense_layers, rngs=rngs)
    if cfg.num_moe_layers:
      self.moe_layers = Block(cfg, moe=True, stack=cfg.num_moe_layers, rngs=rngs)
    self.final_norm = RMSNorm(cfg.hidden_size, "embed", eps=cfg.rms_norm_eps, stack=None, rngs=rngs, dtype=dt)
    self.lm_head = nnx.Module()
    self.lm_head.w = make_param(
      rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), stack=None, std=cfg.initializer_range, dtype=dt
    )

  def __call__(
    self, input_ids_BT, segment_ids_BT=None, positions_BT=None, *, pipeline: pipeline_lib.PipelineSpec | None = None
  ) -> ModelOutput:
    """`pipeline`: run the MoE stack (the dense stack when there is no MoE layer) as a pipeline over the
    `stage` mesh axis (k2jax.model.pipeline); the same outputs as without it."""
    cfg = self.cfg
    B, T = input_ids_BT.shape
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones((B, T), jnp.int32)
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cdt = jnp.dtype(cfg.compute_dtype)
    # Context parallelism: every layer runs in the causally load-balanced order; positions and segments
    # travel with their tokens (identity without a context axis).
    input_ids_BT, segment_ids_BT, positions_BT = (cp.balance(a) for a in (input_ids_BT, segment_ids_BT, positions_BT))
    x_BTD = embed_lookup(self.embed.embedding[...], input_ids_BT, cdt)
    cos_BTk, sin_BTk = rope_lib.rope_cos_sin(cfg, positions_BT)
    token_valid_BT = segment_ids_BT > 0
    side = (cos_BTk, sin_BTk, segment_ids_BT, token_valid_BT)
    max_logits, counts = [], None
    piped = "moe" if cfg.num_moe_layers else "dense"
    if cfg.num_dense_layers:
      x_BTD, m_LH, _ = self._run_stack(self.dense_layers, x_BTD, side, pipeline if piped == "dense" else None)
      max_logits.append(m_LH)
    if cfg.num_moe_layers:
      x_BTD, m_LH, counts = self._run_stack(self.moe_layers, x_BTD, side, pipeline)
      max_logits.append(m_LH)
    if counts is None:
      counts = jnp.zeros((0, cfg.n_routed_experts), jnp.int32)
    x_BTD = self.final_norm(cp.restore(x_BTD))
    logits_BTS = jnp.dot(x_BTD, self.lm_head.w[...].astype(cdt), preferred_element_type=jnp.float32)
    return ModelOutput(logits_BTS.astype(jnp.float32), jnp.concatenate(max_logits, axis=0), counts)

  def _run_stack(self, stack: Block, x_BTD, side, pipeline: pipeline_lib.PipelineSpec | None = None):
    graphdef, state = nnx.split(stack)
    # QAT fake-quantizes the routed experts' float32 masters (model/int4.py), not a bf16 copy of them
    state = compute_copy(state, x_BTD.dtype, skip=("experts",) if self.cfg.expert_qat != "none" else ())

    def layer(x, layer_state, side):
      x, m_H, c_E = nnx.merge(graphdef, layer_state)(x, *side)
      return x, (m_H, c_E)

    if self.cfg.remat_policy != "none":
      layer = jax.checkpoint(layer, policy=REMAT[self.cfg.remat_policy], prevent_cse=not self.cfg.scan_layers)
    n = jax.tree.leaves(state)[0].shape[0]
    if pipeline is None:
      return _scan_layers(layer, state, x_BTD, side, self.cfg.scan_layers)
    pl = pipeline_lib.plan(pipeline, n, rows=x_BTD.shape[0])
    _check_stage_kernels(self.cfg, pipeline, moe=hasattr(stack, "moe"))
    outs = []
    if pl.outside:  # The leading layers that are not pipelined run first, as a plain scan.
      before = jax.tree.map(lambda a: a[: pl.outside], state)
      x_BTD, m_LH, c_LE = _scan_layers(layer, before, x_BTD, side, self.cfg.scan_layers)
      outs.append((m_LH, c_LE))
    piped = jax.tree.map(lambda a: a[pl.outside :], state)
    x_BTD, m_LH, c_LE = pipeline_lib.run(layer, piped, x_BTD, side, pl)
    outs.append((m_LH, c_LE))
    m_LH = jnp.concatenate([o[0] for o in outs])
    c_LE = None if c_LE is None else jnp.concatenate([o[1] for o in outs])
    return x_BTD, m_LH, c_LE


def _check_stage_kernels(cfg: K2Config, pipeline: pipeline_lib.PipelineSpec, *, moe: bool) -> None:
  """The CPU grouped GEMM ('tiled', a while loop) inside the expert-parallel shard_map cannot be vmapped over a
  stage mesh axis while shard_map checks varying axes (jax 0.10: AssertionError in `pvary` of the loop's carry)."""
  ctx = sharding_lib.current()
  if not moe or ctx is None or pipeline.stages == 1 or dict(ctx.mesh.shape).get("stage", 1) == 1:
    return
  from k2jax.model import expert_parallel, moe_gemm  # noqa: PLC0415 (the MoE kernels, only to name the conflict)

  if expert_parallel.CHECK_VMA and moe_gemm.resolve(cfg.moe_gemm) == "tiled":
    raise ConfigError(
      "moe_gemm: the CPU kernel 'tiled' (moe_gemm=auto on CPU) cannot run inside pipeline stages spread over a "
      "mesh 'stage' axis; set model.moe_gemm=ragged_dot for pipelined runs on CPU"
    )


def _scan_layers(layer, state, x_BTD, side, scan: bool):
  """(x, max_logits [L, H], counts [L, E] or None) of the stacked layers in order (lax.scan, or a Python loop)."""
  if scan:
    x_BTD, (m_LH, c_LE) = jax.lax.scan(lambda x, w: layer(x, w, side), x_BTD, state)
    return x_BTD, m_LH, c_LE
  n = jax.tree.leaves(state)[0].shape[0]
  outs = []
  for i in range(n):
    x_BTD, out = layer(x_BTD, jax.tree.map(lambda a, i=i: a[i], state), side)
    outs.append(out)
  m_LH = jnp.stack([o[0] for o in outs])
  c_LE = None if outs[0][1] is None else jnp.stack([o[1] for o in outs])
  return x_BTD, m_LH, c_LE


@functools.cache
def param_logical_axes() -> dict[str, tuple[str, ...]]:
  """Every K2Model parameter's dotted path (e.g. 'moe_layers.moe.experts.w_down') -> its logical axes.

  Names and axes do not depend on sizes, so the tiny preset (dense and MoE layers, shared experts)
  gives the table for every preset; the optimizer lays out Newton-Schulz by it (optim/muon.py).
  """
  from k2jax.model import presets  # noqa: PLC0415 (presets import this module's config only)

  abstract = nnx.eval_shape(lambda: K2Model(presets.get("tiny"), rngs=nnx.Rngs(0)))
  flat = jax.tree_util.tree_flatten_with_path(
    nnx.state(abstract, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)
  )[0]
  return {
    ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): tuple(var.get_metadata()["axes"])
    for path, var in flat
  }


def compute_copy(state, dtype, skip: tuple[str, ...] = ()):
  """The stacked layer weights that the layers cast to the compute dtype (every `w_*` matrix except the
  float32 router's, and those under a `skip` name), cast once for the whole stack before the layer scan.

  The same values reach every matmul; what changes is where the cast's transpose runs: the scan's
  stacked weight gradients come out in the compute dtype (bf16: half the float32 buffer, K2 1t: 3.7
  GiB less per device) and are converted to float32 after the scan, the values bit for bit the same.
  """

  def cast(path, x):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if names and names[-1] == "value":
      names = names[:-1]
    matrix = bool(names) and names[-1].startswith("w_") and "router" not in names and not set(skip) & set(names)
    return x.astype(dtype) if matrix and jnp.issubdtype(x.dtype, jnp.floating) else x

  return jax.tree_util.tree_map_with_path(cast, state)


def embed_lookup(table_VD, ids_BT, dtype):
  """`jnp.take(table, ids, axis=0).astype(dtype)`, sharded by hand under a mesh whose rules shard the
  table's `embed` dim (and not `vocab`) over axes that also shard the batch (fsdp presets).

  Left to the partitioner, the lookup of batch-sharded ids in a D-sharded table gathers the whole
  float32 table on every device, and its gradient is a whole-table scatter-add plus an all-reduce
  (K2: 4.4 GiB each per device). Here each device all-gathers the ids of its `embed` group, looks them up
  in its own D slice and an all-to-all returns every token's full row to the token's device: the
  gradient is a scatter-add into the local slice (reduced over the axes that replicate the table).
  """
  ctx = sharding_lib.current()
  gathered = lambda: jnp.take(table_VD, ids_BT, axis=0).astype(dtype)  # noqa: E731
  if ctx is None or ctx.rules["vocab"] or ctx.axis_size("embed") == 1:
    return gathered()
  embed_axes = tuple(ctx.rules["embed"])
  ids_spec = sharding_lib.logical_to_spec(("act_batch", "act_length"), ctx.preset)
  batch_axes = sharding_lib.spec_mesh_axes(ids_spec[0])
  row_shards = math.prod(ctx.mesh.shape[a] for a in batch_axes)  # under CP the sequence takes its axis
  if not set(embed_axes) <= set(batch_axes) or ids_BT.shape[0] % row_shards:
    return gathered()
  axis = embed_axes[0] if len(embed_axes) == 1 else embed_axes

  def local(table_Vd, ids_bT):
    ids_gT = jax.lax.all_gather(ids_bT, axis, axis=0, tiled=True)  # the embed group's tokens
    x_gTd = jnp.take(table_Vd, ids_gT, axis=0).astype(dtype)
    return jax.lax.all_to_all(x_gTd, axis, 0, 2, tiled=True)  # [b, T, D]: own tokens, every D slice

  table_spec = jax.sharding.PartitionSpec(None, axis)
  out_spec = jax.sharding.PartitionSpec(ids_spec[0], ids_spec[1], None)
  return jax.shard_map(local, mesh=ctx.mesh, in_specs=(table_spec, ids_spec), out_specs=out_spec)(table_VD, ids_BT)
