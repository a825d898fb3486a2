"""Sweeps: a config file's `get_sweep(name)` (a list of {dotted key: value}) -> one train command each.

Each run gets its own workdir `<base>/<sweep>/<index>_<key>=<value>...` and absl overrides
`--config.<key>=<value>`; the commands run one after another locally, or are printed wrapped in
`launch/tpu_pod.sh run` for a TPU pod slice.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys


def load_sweep(config_arg: str, name: str) -> list[dict]:
  """`configs/k2.py:tiny` + sweep name -> the list of override dicts (each checked against the config)."""
  path, _, variant = config_arg.partition(":")
  spec = importlib.util.spec_from_file_location("_sweep_config", path)
  if spec is None or not os.path.isfile(path):
    raise FileNotFoundError(f"--config: no config file at {path!r}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"{path}: defines no get_sweep(name)")
  runs = module.get_sweep(name)
  base = module.get_config(variant) if variant else module.get_config()
  for run in runs:
    for key in run:
      node = base
      for part in key.split("."):
        if part not in node:
          raise KeyError(f"sweep {name!r}: {key!r} is not a key of {config_arg}")
        node = node[part]
  return runs


def run_name(index: int, run: dict) -> str:
  parts = [f"{k.split('.')[-1]}={v}" for k, v in run.items()]
  return re.sub(r"[^A-Za-z0-9_.=+-]", "_", f"{index:03d}_" + ",".join(parts))


def train_command(config_arg: str, workdir: str, run: dict, extra: list[str]) -> list[str]:
  return [
    sys.executable,
    "launch/train.py",
    f"--config={config_arg}",
    f"--workdir={workdir}",
    *(f"--config.{k}={v}" for k, v in run.items()),
    *extra,
  ]


def pod_command(cmd: list[str], tpu_name: str, zone: str) -> str:
  """The same train command on every worker of a TPU VM slice (see launch/tpu_pod.sh)."""
  train = " ".join(shlex.quote(c) for c in ["python", *cmd[1:]])
  return f"bash launch/tpu_pod.sh run {shlex.quote(tpu_name)} {shlex.quote(zone)} -- {train}"
