"""Where a run's model comes from: the config's preset, or `checkpoint.init_from` (a k2jax workdir or
an HF directory, e.g. SFT on a pretrained model), and the first TrainState when nothing is restored.

With `init_from`, the architecture is read from that directory (its `model_config.json` or
`config.json`); the config's execution knobs (dtypes, scan, remat) still apply. A workdir that
already holds checkpoints of a different architecture is refused, naming the differing fields, so
a config mistake is never taken for a corrupt checkpoint.
"""

from __future__ import annotations

import os

import jax

from k2jax.convert import hf as hf_io
from k2jax.convert import workdir as wd
from k2jax.model.config import EXEC_FIELDS, ConfigError, K2Config
from k2jax.train.checkpoint import split_dict
from k2jax.train.config import TrainConfig
from k2jax.train.step import TrainState, init_state


def model_config_for_run(tc: TrainConfig, workdir: str | None = None) -> K2Config:
  """The run's K2Config (from `init_from` when set), checked against `workdir`'s existing one."""
  cfg = tc.model
  if tc.checkpoint.init_from:
    exec_kw = {k: getattr(tc.model, k) for k in EXEC_FIELDS}
    src = tc.checkpoint.init_from
    if not (wd.is_workdir(src) or os.path.isfile(os.path.join(src, "config.json"))):
      raise ConfigError(
        f"checkpoint.init_from: {src!r} is neither a k2jax workdir ({wd.MODEL_CONFIG}) "
        "nor an HF directory (config.json)"
      )
    cfg = wd.read_model_config(src, **exec_kw) if wd.is_workdir(src) else hf_io.read_config(src, **exec_kw)
  if workdir is not None and wd.is_workdir(workdir) and os.path.isdir(os.path.join(workdir, wd.CHECKPOINTS)):
    have = wd.read_model_config(workdir).to_hf_dict()
    want = cfg.to_hf_dict()
    diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
    if diff:
      raise ConfigError(
        f"model: {os.path.join(workdir, wd.MODEL_CONFIG)} holds checkpoints of a different "
        f"model; differing fields {diff} (e.g. {diff[0]}: workdir "
        f"{have.get(diff[0])!r} vs config {want.get(diff[0])!r}); use a new workdir"
      )
  return cfg


def initial_state(tc: TrainConfig, build, optimizer, shardings: TrainState) -> TrainState:
  """Step-0 state: random init (seed `tc.seed`) or `init_from`'s weights, placed per `shardings`."""
  if not tc.checkpoint.init_from:
    return jax.jit(lambda: init_state(build(), optimizer), out_shardings=shardings)()
  src = tc.checkpoint.init_from
  if wd.is_workdir(src):
    _, full = wd.restore_model_state(src, hf_io.abstract_state(tc.model))
  else:
    _, full = hf_io.load_hf(src, **{k: getattr(tc.model, k) for k in EXEC_FIELDS})
  params, bias = split_dict(full, shardings.params)
  params = jax.device_put(params, shardings.params)
  bias = jax.device_put(bias, shardings.bias)

  def fresh(p, b):
    zero = jax.numpy.zeros([], jax.numpy.int32)
    return TrainState(zero, p, b, optimizer.init(p), zero)

  return jax.jit(fresh, out_shardings=shardings)(params, bias)
