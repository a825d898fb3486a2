"""`launch/train.py --dry_run`: parameter counts and the memory plan, from shapes alone."""

from __future__ import annotations

from ml_collections import config_dict

from k2jax import memory
from k2jax.model.config import ConfigError
from k2jax.sharding import MESH_AXES
from k2jax.train.config import from_config_dict
from k2jax.train.counting import count_params, flops_per_token


def report(config: config_dict.ConfigDict) -> str:
  """`key=value` lines: params_total, params_activated, FLOPs, then the memory plan for
  `config.topology` (when set) on the configured mesh and rules preset."""
  tc = from_config_dict(config)
  counts = count_params(tc.model)
  lines = [
    f"params_total={counts.total}",
    f"params_activated={counts.activated}",
    f"flops_per_token={flops_per_token(tc.model, tc.data.seq_len):.6e}",
    f"tokens_per_step={tc.data.global_batch_size * tc.data.seq_len}",
  ]
  if tc.topology:
    if tc.topology not in memory.TOPOLOGIES:
      raise ConfigError(f"topology: unknown {tc.topology!r}; known: {sorted(memory.TOPOLOGIES)}")
    n_dev = memory.TOPOLOGIES[tc.topology].num_devices
    micro_tokens = tc.data.global_batch_size * tc.data.seq_len // tc.data.num_microbatches
    plan = memory.plan(
      tc.model,
      {a: getattr(tc.mesh, a) for a in MESH_AXES},
      tc.mesh.rules,
      micro_tokens // n_dev,
      seq_len=tc.data.seq_len,
      topology=tc.topology,
      num_microbatches=tc.data.num_microbatches,
    )
    lines.append(f"topology={tc.topology}")
    lines.append(memory.format_plan(plan))
  return "\n".join(lines)
