"""Writes the golden `param path -> PartitionSpec` dumps of the tiny config, one file per preset.

Run from the repo root after an intended layout change, and review the diff:
  python tests/sharding/golden/make_partition_specs.py
"""

import pathlib

from flax import nnx

from k2jax import sharding
from k2jax.model import K2Model, presets

HERE = pathlib.Path(__file__).parent


def golden_path(preset: str) -> pathlib.Path:
  return HERE / f"tiny_{preset}.txt"


def dump(preset: str) -> str:
  abstract = nnx.eval_shape(lambda: K2Model(presets.get("tiny"), rngs=nnx.Rngs(0)))
  return sharding.dump_partition_specs(nnx.state(abstract), preset)


if __name__ == "__main__":
  for name in sharding.RULES:
    golden_path(name).write_text(dump(name))
    print(f"wrote {golden_path(name)}")
