"""`--dry_run` of every loop (launch/train.py, launch/rl.py): parameter counts and the memory plan, from
shapes alone."""

from __future__ import annotations

import math

from ml_collections import config_dict

from k2jax import memory
from k2jax.model import pipeline as pipeline_lib
from k2jax.model.config import ConfigError, K2Config
from k2jax.sharding import MESH_AXES
from k2jax.train.config import MeshSpec, from_config_dict
from k2jax.train.counting import count_params, flops_per_token


def report(config: config_dict.ConfigDict) -> str:
  """`key=value` lines for a configs/k2.py config: params_total, params_activated, FLOPs, then the
  memory plan for `config.topology` (when set) on the configured mesh and rules preset."""
  tc = from_config_dict(config)
  micro_rows = tc.data.global_batch_size // tc.data.num_microbatches
  return pipeline_report(tc) + plan_report(
    tc.model,
    tc.mesh,
    tc.topology,
    seq_len=tc.data.seq_len,
    tokens_per_step=tc.data.global_batch_size * tc.data.seq_len,
    tokens_per_pass=micro_rows * tc.data.seq_len,
    num_microbatches=tc.data.num_microbatches,
    offload_opt_state=tc.optim.offload_state,
    stage_sharded=_stage_sharded(tc),
  )


def _stage_sharded(tc) -> str | None:
  """The stack the trainer stores over `stage` (k2jax.train.partition.pipelined_stack's rule), or None."""
  cfg, k = tc.model, tc.pipeline
  if tc.mesh.stage <= 1 or k.layers not in (0, cfg.num_moe_layers or cfg.num_dense_layers):
    return None
  return "moe_layers" if cfg.num_moe_layers else "dense_layers"


def pipeline_report(tc) -> str:
  """The mesh and pipeline knobs as configured, and (at `mesh.stage` > 1) the schedule: layers per stage, the
  layers outside the pipeline, iterations and bubble fraction (p - 1) / (v * m + p - 1); '' lines when off."""
  lines = [f"mesh_{a}={getattr(tc.mesh, a)}" for a in MESH_AXES] + [f"mesh_rules={tc.mesh.rules}"]
  lines += [f"mesh_dcn_{a}={n}" for a, n in tc.mesh.dcn_shape.items()]
  p = tc.mesh.stage
  if p > 1:
    k = tc.pipeline
    spec = pipeline_lib.PipelineSpec(p, repeats=k.repeats, microbatches=k.microbatches, layers=k.layers)
    cfg = tc.model
    stack = "moe" if cfg.num_moe_layers else "dense"
    try:
      pl = pipeline_lib.plan(spec, cfg.num_moe_layers or cfg.num_dense_layers)
    except pipeline_lib.PipelineError as e:
      raise ConfigError(str(e)) from None
    lines += [
      f"pipeline_stages={pl.stages}",
      f"pipeline_repeats={pl.repeats}",
      f"pipeline_microbatches={pl.microbatches}",
      f"pipeline_stack={stack}",
      f"pipeline_layers={pl.pipelined}",
      f"pipeline_layers_per_stage_per_repeat={pl.per_stage}",
      f"pipeline_layers_before={pl.outside + (cfg.num_dense_layers if stack == 'moe' else 0)}",
      f"pipeline_iterations={pl.iterations}",
      f"pipeline_bubble_fraction={pl.bubble_fraction:.4f}",
    ]
  else:
    lines.append("pipeline_stages=1")
  return "\n".join(lines) + "\n"


def plan_report(
  model: K2Config,
  mesh: MeshSpec,
  topology: str,
  *,
  seq_len: int,
  tokens_per_step: int,
  tokens_per_pass: int,
  num_microbatches: int = 1,
  offload_opt_state: bool = False,
  stage_sharded: str | None = None,
) -> str:
  """Counts and (with a topology) the per-device memory plan of one forward/backward over
  `tokens_per_pass` tokens (all rows whose activations live at once), shared by every loop."""
  counts = count_params(model)
  lines = [
    f"params_total={counts.total}",
    f"params_activated={counts.activated}",
    f"flops_per_token={flops_per_token(model, seq_len):.6e}",
    f"tokens_per_step={tokens_per_step}",
  ]
  if topology:
    if topology not in memory.TOPOLOGIES:
      raise ConfigError(f"topology: unknown {topology!r}; known: {sorted(memory.TOPOLOGIES)}")
    n_dev = memory.TOPOLOGIES[topology].num_devices
    slices = math.prod(mesh.dcn_shape.values())  # `topology` is one slice; the mesh.* sizes are per slice
    plan = memory.plan(
      model,
      {a: getattr(mesh, a) for a in MESH_AXES},
      mesh.rules,
      tokens_per_pass // (n_dev * slices),
      seq_len=seq_len,
      topology=topology,
      num_microbatches=num_microbatches,
      offload_opt_state=offload_opt_state,
      stage_sharded=stage_sharded,
    )
    lines.append(f"topology={topology}")
    lines.append(f"slices={slices}")
    lines.append(memory.format_plan(plan))
    if mesh.dcn_data > 1:
      # Data parallelism across n slices: each device's gradient shard is all-reduced over the slices
      # (reduce-scatter in the slice, all-reduce across, all-gather in the slice): 2 (n - 1) / n of its bytes
      # cross DCN (reference scale.md §4.2). XLA reduces each microbatch's gradient where the accumulation loop
      # computes it, so with microbatches that is once per microbatch, in the gradient's compute dtype
      # (`1t_multislice --aot=2xv5p-1024`: 16 x 4.12 GB, against this estimate's 16 x 4.41). An estimate from
      # the plan; `--aot` measures the compiled step.
      n = mesh.dcn_data
      per_pass = plan["grad_accum_bytes_per_device"] if num_microbatches > 1 else plan["grads_bytes_per_device"]
      dcn = 2 * (n - 1) / n * num_microbatches * per_pass
      lines.append(f"dcn_grad_allreduce_bytes_per_device_per_step_estimate={dcn:.0f}")
  return "\n".join(lines)
