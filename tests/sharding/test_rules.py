"""Meshes, rules presets, golden PartitionSpec dumps and clear errors (no compiles)."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from k2jax import sharding
from k2jax.model import K2Model, presets

_spec = importlib.util.spec_from_file_location(
  "make_partition_specs", pathlib.Path(__file__).parent / "golden" / "make_partition_specs.py"
)
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


@pytest.mark.parametrize("preset", sorted(sharding.RULES))
def test_partition_specs_match_golden(preset):
  want = golden.golden_path(preset).read_text()
  assert golden.dump(preset) == want, (
    f"layout of preset {preset!r} changed; if intended, run "
    "python tests/sharding/golden/make_partition_specs.py and review the diff"
  )


def test_presets_are_complete_tables():
  for name, table in sharding.RULES.items():
    assert set(table) == set(sharding.LOGICAL_AXES), name
  abstract = nnx.eval_shape(lambda: K2Model(presets.get("tiny"), rngs=nnx.Rngs(0)))
  used = {
    a
    for v in jax.tree.leaves(nnx.state(abstract), is_leaf=lambda x: isinstance(x, nnx.Variable))
    for a in v.get_metadata()["axes"]
  }
  assert used == set(sharding.PARAM_AXES)  # every logical name the model uses, and no stale ones


def test_mesh_shape_rest_and_errors():
  assert sharding.resolve_mesh_shape({"fsdp": -1, "expert": 4}, 8) == dict(stage=1, data=1, fsdp=2, expert=4, tensor=1)
  assert sharding.resolve_mesh_shape((1, 1, 2, 2, 2), 8)["tensor"] == 2
  mesh = sharding.make_mesh({"expert": -1})
  assert dict(mesh.shape) == dict(stage=1, data=1, fsdp=1, expert=8, tensor=1)
  with pytest.raises(sharding.ShardingError, match="product 4 != 8 devices"):
    sharding.make_mesh({"fsdp": 4})
  with pytest.raises(sharding.ShardingError, match="not divisible by 3"):
    sharding.resolve_mesh_shape({"fsdp": -1, "expert": 3}, 8)
  with pytest.raises(sharding.ShardingError, match="unknown axes \\['model'\\]"):
    sharding.make_mesh({"model": 8})
  with pytest.raises(sharding.ShardingError, match="at most one -1"):
    sharding.make_mesh({"fsdp": -1, "expert": -1})
  with pytest.raises(sharding.ShardingError, match="unknown sharding rules preset 'megatron'"):
    sharding.rules("megatron")


def test_indivisible_dimension_names_the_tensor():
  cfg = presets.get("tiny", n_routed_experts=12)  # 12 experts over an expert axis of 8
  abstract = nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))
  mesh = sharding.make_mesh({"expert": 8})
  with pytest.raises(sharding.ShardingError, match=r"moe_layers\.moe\.experts\.w_\w+: dim 1 .*size 12"):
    sharding.param_shardings(nnx.state(abstract), mesh, "fsdp_ep")
  sharding.param_shardings(nnx.state(abstract), mesh, "fsdp")  # experts not sharded: fine


def test_logical_to_spec_uses_each_mesh_axis_once():
  assert sharding.logical_to_spec(("act_batch", "act_length", "act_embed"), "fsdp") == P(
    ("data", "fsdp", "expert", "tensor"), None, None
  )
  # `tensor` is taken by the vocab dim, so the batch dim does not use it again.
  assert sharding.logical_to_spec(("act_vocab", "act_batch"), "fsdp") == P(None, ("data", "fsdp", "expert", "tensor"))


def test_constrain_is_identity_without_mesh_and_shards_with_one():
  x = jnp.ones((8, 4))
  assert sharding.constrain(x, ("act_batch", None)) is x
  mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
  with sharding.use(mesh, "fsdp_ep"):
    y = jax.jit(lambda a: sharding.constrain(a * 2, ("act_batch", "act_embed")))(x)
    with pytest.raises(sharding.ShardingError, match="3 names"):
      sharding.constrain(x, ("act_batch", None, None))
  want = jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert", "tensor")))
  assert y.sharding.is_equivalent_to(want, 2) and len(y.sharding.device_set) == 8


def test_shard_model_places_every_variable():
  model = K2Model(presets.get("tiny"), rngs=nnx.Rngs(0))
  mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
  sharding.shard_model(model, mesh, "fsdp_ep")
  w = model.moe_layers.moe.experts.w_gate[...]
  assert w.sharding.spec == P(None, "expert", "fsdp", None)
  assert w.addressable_shards[0].data.shape == (2, 2, 32, 32)  # [L, E/4, D/2, F]
