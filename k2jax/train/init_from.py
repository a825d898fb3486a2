"""Where a run's model comes from, for every loop (pretraining, SFT, RL) and `k2jax.load`: a preset, or an
`init_from` directory (a k2jax workdir or an HF directory), and the first TrainState when nothing is restored.

With `init_from`, the architecture is read from that directory (its `model_config.json` or `config.json`);
the config's execution knobs (dtypes, scan, remat) still apply. A workdir that already holds checkpoints of
a different architecture is refused, naming the differing fields, so a config mistake is never taken for a
corrupt checkpoint.
"""

from __future__ import annotations

import os

import jax

from k2jax.api import source_config, source_state
from k2jax.convert import workdir as wd
from k2jax.convert.reader import READ_BUDGET_BYTES
from k2jax.model.config import EXEC_FIELDS, ConfigError, K2Config
from k2jax.train.checkpoint import merge_dicts, split_dict
from k2jax.train.step import TrainState, init_state


def resolve_model(preset_cfg: K2Config, init_from: str, *, key: str) -> K2Config:
  """`preset_cfg`, or the architecture of `init_from` with `preset_cfg`'s execution knobs; errors name `key`."""
  if not init_from:
    return preset_cfg
  try:
    return source_config(init_from, **{k: getattr(preset_cfg, k) for k in EXEC_FIELDS})
  except FileNotFoundError as e:
    raise ConfigError(f"{key}: {e}") from None


def check_workdir_model(workdir: str, cfg: K2Config) -> None:
  """Refuse a workdir whose checkpoints are of another architecture (names the differing fields)."""
  if not (wd.is_workdir(workdir) and os.path.isdir(os.path.join(workdir, wd.CHECKPOINTS))):
    return
  have, want = wd.read_model_config(workdir).to_hf_dict(), cfg.to_hf_dict()
  diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
  if diff:
    raise ConfigError(
      f"model: {os.path.join(workdir, wd.MODEL_CONFIG)} holds checkpoints of a different "
      f"model; differing fields {diff} (e.g. {diff[0]}: workdir "
      f"{have.get(diff[0])!r} vs config {want.get(diff[0])!r}); use a new workdir"
    )


def model_config_for_run(tc, workdir: str | None = None) -> K2Config:
  """The pretraining/SFT run's K2Config (from `checkpoint.init_from` when set), checked against `workdir`."""
  cfg = resolve_model(tc.model, tc.checkpoint.init_from, key="checkpoint.init_from")
  if workdir is not None:
    check_workdir_model(workdir, cfg)
  return cfg


def initial_state(
  cfg: K2Config, init_from: str, build, optimizer, shardings: TrainState, read_budget_bytes: int = READ_BUDGET_BYTES
) -> TrainState:
  """Step-0 state: `build()`'s random init, or `init_from`'s weights, placed per `shardings` (an HF
  directory is read by `convert.reader`: each process only its own slices, `read_budget_bytes` in flight)."""
  if not init_from:
    return jax.jit(lambda: init_state(build(), optimizer), out_shardings=shardings)()
  both = merge_dicts(shardings.params, shardings.bias)
  state = source_state(init_from, cfg, both, read_budget_bytes=read_budget_bytes)  # straight onto the mesh
  params, bias = split_dict(state, shardings.params)

  def fresh(p, b):
    zero = jax.numpy.zeros([], jax.numpy.int32)
    return TrainState(zero, p, b, optimizer.init(p), zero)

  return jax.jit(fresh, out_shardings=shardings)(params, bias)
