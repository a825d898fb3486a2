"""Pipeline parallelism: a scanned layer stack split into stages, run with a circular schedule.

SPMD form (MaxText's `layers/pipeline.py`; reference scale.md §3): every stage runs the same program under one
`jax.vmap` over a leading `stage` dimension (`spmd_axis_name="stage"`), so one device group of the `stage` mesh
axis computes one stage, and each iteration shifts the stage outputs one stage on (`jnp.roll` over the
stage-sharded dimension: a collective permute). With `p` stages, `v` repeats (virtual stages) and `k` layers per
stage, the pipelined stack of `L = v * p * k` layers is read in C order as `[v, p, k]`: stage `s` holds layers
`r * p * k + s * k + i` for every repeat `r` ("24 layers, 4 stages, 2 repeats: stage 0 runs 0, 1, 2 and 12, 13,
14"). The batch is split into `m >= p` microbatches; at iteration `t` stage `s` works on item `t - s` of the
sequence (microbatch 0, 1, ..., m-1 of repeat 0, then of repeat 1, ...); an item of repeat `r > 0` enters stage 0
from the last stage's output of repeat `r - 1`, which arrived `m - p + 1` iterations before (hence `m >= p`).
Iterations: `v * m + p - 1`; bubble fraction `(p - 1) / (v * m + p - 1)` (`bubble_fraction`).

Statistics are per layer and collected from real iterations only: a bubble slot (`t - s` outside
`[0, v * m)`) computes on zeros or on a stale input and its per-head max logits and expert counts are dropped,
so QK-Clip and the balancing bias see exactly the unpipelined step's values (max over microbatches, counts
summed), re-indexed to layer order `[L, ...]` (a gather over `stage`).

The backward pass is jax's transpose of the iteration scan (GPipe order: all forwards, then all backwards), not
1F1B; each layer saves what the model's remat policy keeps, per iteration, as the unpipelined scan would.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from k2jax import sharding as sharding_lib

STAGE_AXIS = "stage"


class PipelineError(ValueError):
  """A pipeline layout that cannot work; the message names the knob and the values."""


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """`stages` (the `stage` mesh axis), `repeats` (virtual stages per device group), `microbatches` (0: as many
  as stages) and `layers` (how many of the pipelined stack's layers, counted from its end, are pipelined; 0:
  all). The pipelined stack is the MoE stack (the dense stack when the model has no MoE layer); its other layers,
  the dense first layers, the embedding and the head run outside the pipeline."""

  stages: int
  repeats: int = 1
  microbatches: int = 0
  layers: int = 0

  @property
  def num_microbatches(self) -> int:
    return self.microbatches or self.stages


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each layer of the pipelined stack runs: `outside` leading layers scanned before the pipeline, then
  `stages x repeats x per_stage` pipelined ones."""

  stages: int
  repeats: int
  microbatches: int
  per_stage: int
  outside: int

  @property
  def pipelined(self) -> int:
    return self.stages * self.repeats * self.per_stage

  @property
  def iterations(self) -> int:
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    return bubble_fraction(self.stages, self.repeats, self.microbatches)


def bubble_fraction(stages: int, repeats: int, microbatches: int) -> float:
  """Idle share of a circular pipeline: (p - 1) / (v * m + p - 1) (gPipe when v = 1; interleaved 1F1B's too)."""
  return (stages - 1) / (repeats * microbatches + stages - 1)


def plan(spec: PipelineSpec, stack_layers: int, *, rows: int | None = None) -> Plan:
  """Checks `spec` against a stack of `stack_layers` layers (and a batch of `rows` rows): a clear error when
  the stages do not divide the pipelined layers, microbatches are fewer than stages or do not divide the rows."""
  p, v, m = spec.stages, spec.repeats, spec.num_microbatches
  if p < 1 or v < 1 or spec.microbatches < 0 or spec.layers < 0:
    raise PipelineError(f"pipeline: stages {p}, repeats {v} must be >= 1 and microbatches, layers >= 0")
  n = spec.layers or stack_layers
  if n > stack_layers:
    raise PipelineError(f"pipeline.layers: {n} > the {stack_layers} layers of the pipelined stack")
  if n % (p * v):
    raise PipelineError(
      f"pipeline.layers: {n} pipelined layers are not divisible by mesh.stage ({p}) x pipeline.repeats ({v}) = "
      f"{p * v}; pipeline fewer layers (the rest run before the pipeline) or change stages/repeats"
    )
  if m < p:
    raise PipelineError(
      f"pipeline.microbatches: {m} < {p} stages: the last stage's output of a microbatch must reach stage 0 "
      "before that microbatch's next repeat; use >= stages (2 x stages hides the transfer)"
    )
  if rows is not None and rows % m:
    raise PipelineError(f"pipeline.microbatches: {m} does not divide the {rows} rows of a (gradient) microbatch")
  return Plan(p, v, m, n // (p * v), stack_layers - n)


def split_rows(x_B, m: int):
  """[B, ...] -> [m, B/m, ...]; microbatch i = rows i, i+m, ... (each device's rows split evenly)."""
  b = x_B.shape[0] // m
  return jnp.swapaxes(x_B.reshape(b, m, *x_B.shape[1:]), 0, 1)


def merge_rows(x_MB):
  """The inverse of `split_rows`."""
  m, b = x_MB.shape[:2]
  return jnp.swapaxes(x_MB, 0, 1).reshape(m * b, *x_MB.shape[2:])


def _stage_vmap(fn: Callable, p: int) -> Callable:
  """`jax.vmap` over stages, spread over the `stage` mesh axis when the active mesh has one of size `p`."""
  ctx = sharding_lib.current()
  size = dict(ctx.mesh.shape).get(STAGE_AXIS, 1) if ctx is not None else 1
  if size not in (1, p):
    raise PipelineError(f"pipeline: mesh axis '{STAGE_AXIS}' has size {size}, the pipeline {p} stages")
  return jax.vmap(fn, spmd_axis_name=STAGE_AXIS if size > 1 else None)


def run(layer: Callable, state, x_BTD, side, pl: Plan):
  """The pipelined part of a stack: `layer(x, layer_state, side) -> (x, (max_logit_H, counts_E or None))`,
  `state` stacked over the `pl.pipelined` layers, `side` a tuple of [B, ...] per-token inputs.
  Returns (x [B, T, D], max_logits [L, H], counts [L, E] or None) as a scan over the layers would."""
  p, v, m, k = pl.stages, pl.repeats, pl.microbatches, pl.per_stage
  # [L, ...] -> [v, p, k, ...] -> [p, v, k, ...]: stage s holds layers r*p*k + s*k + i.
  state_P = jax.tree.map(lambda a: jnp.swapaxes(a.reshape(v, p, k, *a.shape[1:]), 0, 1), state)
  x_MbTD = split_rows(x_BTD, m)
  side_M = jax.tree.map(lambda a: split_rows(a, m), side)
  stats = jax.eval_shape(
    lambda: layer(x_MbTD[0], jax.tree.map(lambda a: a[0, 0, 0], state_P), jax.tree.map(lambda a: a[0], side_M))[1]
  )
  has_counts = stats[1] is not None
  stage_P = jnp.arange(p)

  def stage(s, w_Vk, shift_bTD, circ_MbTD, acc_m_VkH, acc_c_VkE, t):
    """One stage at iteration t: pick its input, run its k layers of the current repeat, keep valid stats."""
    item = t - s
    valid = (item >= 0) & (item < v * m)
    item = jnp.clip(item, 0, v * m - 1)
    mb, r = item % m, item // m
    fresh = jnp.where(r == 0, x_MbTD[mb], circ_MbTD[mb])
    x = jnp.where(s == 0, fresh, shift_bTD)
    w_k = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), w_Vk)
    side_b = jax.tree.map(lambda a: a[mb], side_M)
    x, (m_kH, c_kE) = jax.lax.scan(lambda x, w: layer(x, w, side_b), x, w_k)
    acc_m_VkH = acc_m_VkH.at[r].set(jnp.where(valid, jnp.maximum(acc_m_VkH[r], m_kH), acc_m_VkH[r]))
    if has_counts:
      acc_c_VkE = acc_c_VkE.at[r].add(jnp.where(valid, c_kE, 0))
    return x, acc_m_VkH, acc_c_VkE

  def receive(circ_MbTD, in_bTD, t):
    """Stage 0 keeps the last stage's output of item t - (p - 1) for that microbatch's next repeat."""
    item = t - (p - 1)
    ok = (item >= 0) & (item < v * m)
    mb = jnp.clip(item, 0, v * m - 1) % m
    return circ_MbTD.at[mb].set(jnp.where(ok, in_bTD, circ_MbTD[mb]))

  stage_v = _stage_vmap(stage, p)
  receive_v = _stage_vmap(receive, p)

  def iteration(carry, t):
    shift_PbTD, circ_PMbTD, acc_m, acc_c = carry
    out_PbTD, acc_m, acc_c = stage_v(stage_P, state_P, shift_PbTD, circ_PMbTD, acc_m, acc_c, jnp.broadcast_to(t, p))
    shift_PbTD = jnp.roll(out_PbTD, 1, axis=0)  # stage s -> s + 1; the last stage's output -> stage 0
    circ_PMbTD = receive_v(circ_PMbTD, shift_PbTD, jnp.broadcast_to(t, p))
    return (shift_PbTD, circ_PMbTD, acc_m, acc_c), None

  H = stats[0].shape[-1]
  E = stats[1].shape[-1] if has_counts else 0
  zeros_P = jnp.zeros((p, *x_MbTD.shape[1:]), x_BTD.dtype)
  carry = (
    zeros_P,
    jnp.zeros((p, *x_MbTD.shape), x_BTD.dtype),
    jnp.full((p, v, k, H), -jnp.inf, stats[0].dtype),
    jnp.zeros((p, v, k, E), stats[1].dtype if has_counts else jnp.int32),
  )
  (_, circ_PMbTD, acc_m, acc_c), _ = jax.lax.scan(iteration, carry, jnp.arange(pl.iterations))
  # Stage 0's buffer holds every microbatch's output of the last repeat.
  x_BTD = merge_rows(circ_PMbTD[0])
  to_layers = lambda a: jnp.swapaxes(a, 0, 1).reshape(v * p * k, a.shape[-1])  # noqa: E731
  return x_BTD, to_layers(acc_m), to_layers(acc_c) if has_counts else None
