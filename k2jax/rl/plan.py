"""`launch/rl.py --dry_run`: the RL update's per-device memory plan from shapes alone (`k2jax.memory`).

XLA's own figures for a TPU slice, generation phase included, come from `k2jax.rl.aot` (`--aot=SLICE`).
"""

from __future__ import annotations

from ml_collections import config_dict

from k2jax.rl.learner import model_config
from k2jax.train.config import mesh_spec
from k2jax.train.dryrun import plan_report


def dry_run(config: config_dict.ConfigDict) -> str:
  """Counts and the per-device memory plan of the RL update on `config.topology`, from shapes alone (no
  tokenizer, task file, engine or devices needed). The update's forward/backward holds the rollout rows
  and the PTX rows at once."""
  model = model_config(config)
  rows = config.rollout.target_groups * config.rollout.group_size
  seq = config.train.seq_len
  ptx_tokens = config.ptx.batch_size * config.ptx.seq_len if config.loss.ptx_coef > 0 else 0
  report = plan_report(
    model,
    mesh_spec(config.mesh),
    config.topology,
    seq_len=seq,
    tokens_per_step=rows * seq * config.optim.updates_per_batch,
    tokens_per_pass=rows * seq + ptx_tokens,
  )
  return f"rl_rows={rows}\nptx_rows={config.ptx.batch_size if ptx_tokens else 0}\n" + report
